"""Token files the trainer reads: their formats, and how a spec's `data.path` resolves to one. No torch.

Two formats, both a little-endian array of token ids read through a memory map:
- **flat**: the file is the array, no header (nanoGPT; Megatron's raw `.bin`): its dtype comes from
  `data.dtype` and its length is size / itemsize.
- **megatron**: Megatron-LM's indexed dataset, a prefix P with `P.bin` (the documents' tokens, concatenated
  in order) and `P.idx` (Megatron-Core `_IndexWriter`: the 9-byte magic `MMIDIDX\\x00\\x00`, u64 version 1,
  u8 dtype code, u64 sequence count, u64 document-index count, then int32 sequence lengths, int64 byte
  pointers, int64 document indices). The dtype comes from the index. Documents already end with the
  end-of-document token when preprocessed with `--append-eod`, so reading `P.bin` as one stream of
  windows is the concatenation Megatron's GPT dataset trains on.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainctl.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

ITEMSIZE = {"uint8": 1, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8}
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
# Megatron-Core DType codes (megatron/core/datasets/indexed_dataset.py); token files use these four.
MEGATRON_CODES = {1: "uint8", 4: "int32", 5: "int64", 8: "uint16"}
MEGATRON_CODE_OF = {v: k for k, v in MEGATRON_CODES.items()}
_HEAD = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count


@dataclass(frozen=True)
class TokenFile:
    """A resolved token source: the file holding the ids, their dtype, and how many there are."""

    path: Path  # the file of ids (for a Megatron dataset, P.bin)
    dtype: str
    count: int
    source: str  # what the user named (data.path)
    format: str  # flat | megatron

    def tokens(self) -> np.ndarray:
        import numpy as np

        return np.memmap(self.path, dtype=np.dtype(self.dtype).newbyteorder("<"), mode="r")


def megatron_prefix(path: str | Path) -> Path | None:
    """The dataset prefix if `path` names a Megatron indexed dataset (P, P.bin or P.idx with both files)."""
    p = Path(path)
    prefix = p.with_suffix("") if p.suffix in (".bin", ".idx") else p
    if prefix.with_name(prefix.name + ".idx").is_file() and prefix.with_name(prefix.name + ".bin").is_file():
        return prefix
    return None


@dataclass(frozen=True)
class MegatronIndex:
    dtype: str
    sizes: np.ndarray  # tokens per sequence
    pointers: np.ndarray  # byte offset of each sequence in P.bin
    document_indices: np.ndarray  # sequence index where each document starts, with a final sentinel


def read_megatron_index(idx_path: str | Path) -> MegatronIndex:
    import numpy as np

    raw = Path(idx_path).read_bytes()
    if len(raw) < _HEAD.size:
        raise UsageError(f"{idx_path}: {len(raw)} bytes, too short for a Megatron index")
    magic, version, code, n_seq, n_doc = _HEAD.unpack_from(raw)
    if magic != MEGATRON_MAGIC:
        raise UsageError(f"{idx_path}: not a Megatron indexed-dataset index (magic {magic!r})")
    if version != MEGATRON_VERSION:
        raise UsageError(f"{idx_path}: index version {version}, trainctl reads version {MEGATRON_VERSION}")
    if code not in MEGATRON_CODES:
        raise UsageError(f"{idx_path}: token dtype code {code} is not an integer token type",
                         hint=f"token files use {', '.join(MEGATRON_CODES.values())}")
    need = _HEAD.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if len(raw) != need:
        raise UsageError(f"{idx_path}: {len(raw)} bytes but its header describes {need} (truncated or not an "
                         "index)")
    off = _HEAD.size
    sizes = np.frombuffer(raw, dtype="<i4", count=n_seq, offset=off)
    pointers = np.frombuffer(raw, dtype="<i8", count=n_seq, offset=off + 4 * n_seq)
    docs = np.frombuffer(raw, dtype="<i8", count=n_doc, offset=off + 12 * n_seq)
    return MegatronIndex(MEGATRON_CODES[code], sizes, pointers, docs)


class MegatronWriter:
    """Streams documents into a Megatron indexed dataset (one sequence per document), written under
    temporary names and renamed into place on `close()`, so a crash never leaves a half dataset behind."""

    def __init__(self, prefix: str | Path, dtype: str) -> None:
        self.prefix, self.dtype = Path(prefix), dtype
        self.sizes: list[int] = []
        self._bin_tmp = self._path(".bin.tmp")
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed in close()/abort()

    def _path(self, suffix: str) -> Path:
        return self.prefix.with_name(self.prefix.name + suffix)

    def add(self, ids: np.ndarray | list[int]) -> None:
        import numpy as np

        arr = np.asarray(ids, dtype=np.dtype(self.dtype).newbyteorder("<"))
        self._bin.write(arr.tobytes())
        self.sizes.append(len(arr))

    def close(self) -> int:
        """Write the index, rename both files into place; the dataset's token count."""
        import numpy as np

        self._bin.close()
        sizes = np.array(self.sizes, dtype="<i4")
        pointers = np.zeros(len(sizes), dtype="<i8")
        if len(sizes) > 1:
            pointers[1:] = np.cumsum(sizes[:-1], dtype=np.int64) * ITEMSIZE[self.dtype]
        doc_idx = np.arange(len(sizes) + 1, dtype="<i8")
        idx_tmp = self._path(".idx.tmp")
        with open(idx_tmp, "wb") as f:
            f.write(_HEAD.pack(MEGATRON_MAGIC, MEGATRON_VERSION, MEGATRON_CODE_OF[self.dtype], len(sizes),
                               len(doc_idx)))
            f.write(sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())
        self._bin_tmp.replace(self._path(".bin"))
        idx_tmp.replace(self._path(".idx"))
        return int(sizes.sum(dtype=np.int64))

    def abort(self) -> None:
        self._bin.close()
        for p in (self._bin_tmp, self._path(".idx.tmp")):
            p.unlink(missing_ok=True)


def ids_file(path: str | Path, fmt: str = "auto") -> Path:
    """The file holding the ids `data.path` names (P.bin for a Megatron dataset), without reading anything."""
    prefix = megatron_prefix(path) if fmt in ("auto", "megatron") else None
    return prefix.with_name(prefix.name + ".bin") if prefix is not None else Path(path)


def open_token_file(path: str | Path, fmt: str = "auto", dtype: str = "uint16") -> TokenFile:
    """Resolve `data.path` (with `data.format`, `data.dtype`) to the file of ids, its dtype and length."""
    prefix = megatron_prefix(path) if fmt in ("auto", "megatron") else None
    if fmt == "megatron" and prefix is None:
        raise UsageError(f"data.path {path}: no Megatron indexed dataset (P.bin and P.idx) there",
                         hint="give the prefix Megatron's preprocess_data.py wrote (without .bin/.idx)")
    if prefix is not None:
        index = read_megatron_index(prefix.with_name(prefix.name + ".idx"))
        bin_path = prefix.with_name(prefix.name + ".bin")
        size = bin_path.stat().st_size
        itemsize = ITEMSIZE[index.dtype]
        total = int(index.sizes.sum(dtype="int64"))
        last = int(index.pointers[-1]) + int(index.sizes[-1]) * itemsize if len(index.sizes) else 0
        if size != total * itemsize or last != size:
            raise UsageError(f"{bin_path}: {size} bytes but its index describes {total} {index.dtype} tokens "
                             f"({total * itemsize} bytes)", hint="the .bin and .idx files do not belong together")
        return TokenFile(bin_path, index.dtype, total, str(path), "megatron")
    p = Path(path)
    if dtype not in ITEMSIZE:
        raise UsageError(f"data.dtype {dtype!r} is not a token dtype", hint="use uint16 or uint32")
    if not p.exists():
        raise UsageError(f"data.path {p}: no such file",
                         hint="run `trainctl data prepare TEXT OUT.bin` or fix data.path (or use data.synthetic)")
    if not p.is_file():
        raise UsageError(f"data.path {p}: not a regular file", hint="point data.path at a token .bin file")
    size = p.stat().st_size
    if size % ITEMSIZE[dtype]:
        other = "uint32" if dtype == "uint16" else "uint16"
        raise UsageError(f"data.path {p}: {size} bytes is not a whole number of {dtype} tokens",
                         hint=f"check data.dtype (the file may be {other}) or whether the file is truncated")
    return TokenFile(p, dtype, size // ITEMSIZE[dtype], str(path), "flat")

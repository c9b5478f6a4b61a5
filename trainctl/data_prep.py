"""Token files: the byte-level tokenizer, `trainctl data prepare`, and the checks launch runs first.

A token file is a flat little-endian array of token ids (uint16 or uint32), the format nanoGPT and
Megatron's raw `.bin` use: no header, so its length in tokens is its size / itemsize.

No torch here, and numpy only inside functions: the CLI imports this module at start-up.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from trainctl.errors import UsageError

if TYPE_CHECKING:
    from trainctl.spec import RunSpec

BYTE_VOCAB = 256  # byte-level tokenizer: each UTF-8 byte is one token id 0..255
ITEMSIZE = {"uint16": 2, "uint32": 4}
CHUNK_BYTES = 16 << 20  # prepare streams the text in chunks so big files need little memory


def sample_text_path() -> Path:
    """The ~60 KB public-domain English text shipped for the quickstart (sources: trainctl/data/README.md)."""
    return Path(str(resources.files("trainctl") / "data" / "sample.txt"))


def encode(text: str | bytes) -> list[int]:
    """Byte-level tokenizer: UTF-8 bytes -> ids 0..255 (no vocabulary file, nothing to download)."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return list(data)


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Prepared:
    path: Path
    tokens: int
    dtype: str
    vocab: int = BYTE_VOCAB

    def spec_block(self) -> str:
        """The `data:` block to paste into a run spec."""
        return f"data:\n  path: {self.path}\n  dtype: {self.dtype}"


def prepare(text_path: str | Path, out_path: str | Path, dtype: str = "uint16") -> Prepared:
    """Tokenize a text file byte by byte into a flat token file, written atomically (temp + rename)."""
    import numpy as np

    if dtype not in ITEMSIZE:
        raise UsageError(f"--dtype {dtype!r} is not a token dtype", hint="use uint16 or uint32")
    src, out = Path(text_path), Path(out_path)
    if not src.is_file():
        what = "is a directory" if src.is_dir() else "does not exist"
        raise UsageError(f"input text {src} {what}", hint="pass the path of a UTF-8 text file")
    if src.stat().st_size == 0:
        raise UsageError(f"input text {src} is empty", hint="pass a file with some text in it")
    if out.is_dir():
        raise UsageError(f"output {out} is a directory", hint="pass a file name such as tokens.bin")
    if not out.parent.is_dir():
        raise UsageError(f"output directory {out.parent} does not exist", hint="create it first")
    # The temp file lives beside the target so the final rename is atomic (same filesystem).
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    tokens = 0
    try:
        with os.fdopen(fd, "wb") as dst, open(src, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                ids = np.frombuffer(chunk, dtype=np.uint8).astype(np.dtype(dtype).newbyteorder("<"))
                dst.write(ids.tobytes())
                tokens += len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Prepared(path=out.resolve(), tokens=tokens, dtype=dtype)


def token_count(path: str | Path, dtype: str) -> int:
    """Tokens in a token file; raise UsageError (exit 2) when it is missing or not whole tokens."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"data.path {p}: no such file",
                         hint="run `trainctl data prepare TEXT OUT.bin` or fix data.path (or use data.synthetic)")
    if not p.is_file():
        raise UsageError(f"data.path {p}: not a regular file", hint="point data.path at a token .bin file")
    size = p.stat().st_size
    itemsize = ITEMSIZE[dtype]
    if size % itemsize:
        other = "uint32" if dtype == "uint16" else "uint16"
        raise UsageError(f"data.path {p}: {size} bytes is not a whole number of {dtype} tokens",
                         hint=f"check data.dtype (the file may be {other}) or whether the file is truncated")
    return size // itemsize


def check_token_file(path: str | Path, dtype: str, seq_len: int, vocab: int) -> int:
    """Everything that can be checked before ranks start; returns the number of tokens.

    Every token is checked against the vocabulary (trainctl.data_check: a vectorised scan, cached next to
    the file), since the vocab-parallel embedding and loss would mask an out-of-range id, not fail on it."""
    import sys

    from trainctl.data_check import other_dtype_fits, scan_cached, uint32_read_as_uint16

    n = token_count(path, dtype)
    if n < seq_len + 1:
        raise UsageError(f"data.path {path}: {n} tokens, fewer than one training window of "
                         f"model.seq_len + 1 = {seq_len + 1}",
                         hint="use more text or a smaller model.seq_len")

    def progress(done: int, total: int) -> None:  # large files only: a scan of a few GB takes seconds
        if total * ITEMSIZE[dtype] >= 1 << 30:
            print(f"\rchecking every token of {path}: {done / total:.0%}", end="" if done < total else "\n",
                  file=sys.stderr, flush=True)

    result = scan_cached(path, dtype, vocab, progress)
    if not result.in_range(vocab):
        other = other_dtype_fits(path, dtype, vocab)
        hint = (f"the file reads as valid {other} tokens: set data.dtype: {other}" if other else
                "re-tokenize with a tokenizer whose vocabulary fits, or raise model.vocab to cover it "
                f"(`trainctl data check {path} --vocab {vocab} --dtype {dtype}` lists the damage)")
        raise UsageError(f"data.path {path}: token id {result.first_bad_id} at token offset "
                         f"{result.first_bad_offset:,} (byte {result.first_bad_offset * ITEMSIZE[dtype]:,}) is >= "
                         f"model.vocab {vocab}; {result.out_of_range:,} of {n:,} ids are out of range", hint=hint)
    if uint32_read_as_uint16(path, dtype):
        raise UsageError(f"data.path {path}: every second uint16 token is 0; the file looks like uint32 tokens",
                         hint="set data.dtype: uint32")
    return n


def check_data(spec: RunSpec) -> int | None:
    """Preflight for a run: the token count of data.path, None for synthetic data."""
    if spec.data.synthetic:
        return None
    assert spec.data.path is not None  # the spec model guarantees one source
    return check_token_file(spec.data.path, spec.data.dtype, spec.model.seq_len, spec.model.vocab)

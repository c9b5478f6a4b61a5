"""Token files: the byte-level tokenizer, `trainctl data prepare`, and the checks launch runs first.

A token file is a flat little-endian array of token ids (uint16 or uint32), the format nanoGPT and
Megatron's raw `.bin` use: no header, so its length in tokens is its size / itemsize.

No torch here, and numpy only inside functions: the CLI imports this module at start-up.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from trainctl.data.files import ITEMSIZE, MegatronWriter, TokenFile, open_token_file
from trainctl.errors import UsageError
from trainctl.fileio import default_mode, require_writable

if TYPE_CHECKING:
    from trainctl.spec import RunSpec

BYTE_VOCAB = 256  # byte-level tokenizer: each UTF-8 byte is one token id 0..255
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
    format: str = "flat"
    documents: int = 1

    def spec_block(self) -> str:
        """The `data:` block to paste into a run spec."""
        if self.format == "megatron":
            return f"data:\n  path: {self.path}\n  format: megatron"
        return f"data:\n  path: {self.path}\n  dtype: {self.dtype}"


EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
DOC_BATCH = 1000  # documents encoded per call (the tokenizers library parallelises inside a batch)


def _documents(src: Path, json_key: str) -> Iterator[str]:
    """The documents of a text file, the same for every tokenizer: JSON lines (one document per line, text
    under `json_key`, as Megatron's preprocess_data.py reads), or plain text with documents separated by
    blank lines."""
    import json

    if src.suffix == ".jsonl":
        for n, line in _utf8_lines(src):
            if line.strip():
                try:
                    text = json.loads(line)[json_key]
                except (ValueError, KeyError, TypeError):
                    text = None
                if not isinstance(text, str):
                    raise UsageError(f"{src}:{n}: not a JSON object with a {json_key!r} string",
                                     hint="pass --json-key for another field")
                yield text
        return
    paragraph: list[str] = []
    for _, line in _utf8_lines(src):
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "".join(paragraph)
            paragraph = []
    if paragraph:
        yield "".join(paragraph)


def _utf8_lines(src: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 file; a byte that is not UTF-8 stops it with its offset (a binary file
    passed by mistake, or text in another encoding, would otherwise train as garbage tokens)."""
    offset = 0
    with open(src, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(f"input text {src}: not UTF-8: byte {raw[e.start]:#04x} at offset "
                                 f"{offset + e.start:,} (line {n})",
                                 hint="pass UTF-8 text (convert it with iconv); a token file needs no prepare "
                                      "(`trainctl data check` reads it)") from None
            yield n, line
            offset += len(raw)


def prepare_with_tokenizer(text_path: str | Path, out_path: str | Path, tokenizer_json: str | Path, *,
                           fmt: str = "flat", dtype: str | None = None, eot: str | None = None,
                           json_key: str = "text") -> Prepared:
    """Tokenize documents with a local Hugging Face `tokenizer.json` (the `tokenizers` library), each
    followed by the end-of-text token, into a flat token file or a Megatron indexed dataset (OUT is then the
    prefix). The dtype is the smallest that holds the vocabulary unless given."""
    import numpy as np

    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError("--tokenizer needs the `tokenizers` package",
                         hint="pip install 'trainctl[data]' (or pip install tokenizers)") from None
    src, out = Path(text_path), Path(out_path)
    _check_paths(src, out)
    try:
        tok = Tokenizer.from_file(str(tokenizer_json))
    except Exception as e:  # the library raises its own exception types for a bad file
        raise UsageError(f"--tokenizer {tokenizer_json}: cannot load ({str(e).splitlines()[0][:120]})",
                         hint="pass a tokenizer.json written by the tokenizers library") from None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    names = [eot] if eot else [c for c in EOT_CANDIDATES if tok.token_to_id(c) is not None][:1]
    eot_id = tok.token_to_id(names[0]) if names else None
    if eot_id is None:
        raise UsageError(f"--tokenizer {tokenizer_json}: no end-of-text token "
                         f"{'named ' + repr(eot) if eot else 'among ' + ', '.join(EOT_CANDIDATES)}",
                         hint="pass --eot with the token that separates documents")
    wide = "int32" if fmt == "megatron" else "uint32"  # Megatron-Core's choice for vocabularies > 65535
    dtype = dtype or ("uint16" if vocab <= 1 << 16 else wide)
    if dtype not in ITEMSIZE or vocab > 1 << (8 * ITEMSIZE[dtype]):
        raise UsageError(f"--dtype {dtype}: cannot hold the tokenizer's {vocab:,} ids", hint=f"use {wide}")
    docs = _documents(src, json_key)
    tokens = documents = 0
    if fmt == "megatron":
        writer = MegatronWriter(out, dtype)
        try:
            while batch := list(itertools.islice(docs, DOC_BATCH)):
                for enc in tok.encode_batch(batch, add_special_tokens=False):
                    writer.add([*enc.ids, eot_id])
                    documents += 1
            tokens = writer.close()
        except BaseException:
            writer.abort()
            raise
    else:
        with _atomic_output(out) as dst:
            while batch := list(itertools.islice(docs, DOC_BATCH)):
                for enc in tok.encode_batch(batch, add_special_tokens=False):
                    ids = np.asarray([*enc.ids, eot_id], dtype=np.dtype(dtype).newbyteorder("<"))
                    dst.write(ids.tobytes())
                    tokens += len(ids)
                    documents += 1
    if documents == 0:
        raise UsageError(f"input text {src} holds no documents", hint="pass a file with some text in it")
    return Prepared(path=out.resolve(), tokens=tokens, dtype=dtype, vocab=vocab, format=fmt, documents=documents)


def _check_paths(src: Path, out: Path) -> None:
    if not src.is_file():
        what = "is a directory" if src.is_dir() else "does not exist"
        raise UsageError(f"input text {src} {what}", hint="pass the path of a UTF-8 text file")
    if src.stat().st_size == 0:
        raise UsageError(f"input text {src} is empty", hint="pass a file with some text in it")
    if out.is_dir():
        raise UsageError(f"output {out} is a directory", hint="pass a file name such as tokens.bin")
    if not out.parent.is_dir():
        raise UsageError(f"output directory {out.parent} does not exist", hint="create it first")
    require_writable(out.parent, f"output {out}")  # written beside it, then renamed into place


@contextlib.contextmanager
def _atomic_output(out: Path) -> Iterator[BinaryIO]:
    """A file beside `out` (same filesystem, so the final rename is atomic), fsynced and renamed on success."""
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as dst:
            yield dst
            dst.flush()
            os.fsync(dst.fileno())
        os.chmod(tmp, default_mode())  # mkstemp makes 0600; a token file is read by the whole team
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def prepare(text_path: str | Path, out_path: str | Path, dtype: str = "uint16", *,
            json_key: str = "text") -> Prepared:
    """Tokenize the documents of a text file byte by byte into a flat token file, written atomically (temp +
    rename). The byte vocabulary has no id to spare for an end-of-text token, so documents are separated as
    plain text separates them, by one blank line: a text file written that way comes back byte for byte
    (longer runs of blank lines become one)."""
    import numpy as np

    if dtype not in ("uint16", "uint32"):
        raise UsageError(f"--dtype {dtype!r} is not a token dtype", hint="use uint16 or uint32")
    src, out = Path(text_path), Path(out_path)
    _check_paths(src, out)
    tokens = documents = 0
    pending = bytearray()
    with _atomic_output(out) as dst:
        def flush() -> None:
            ids = np.frombuffer(bytes(pending), dtype=np.uint8)  # a copy: the buffer is cleared next
            dst.write(ids.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
            pending.clear()

        for doc in _documents(src, json_key):
            pending += (b"\n" if documents else b"") + doc.encode("utf-8") + (b"" if doc.endswith("\n") else b"\n")
            documents += 1
            if len(pending) >= CHUNK_BYTES:
                tokens += len(pending)
                flush()
        tokens += len(pending)
        flush()
        if documents == 0:
            raise UsageError(f"input text {src} holds no documents", hint="pass a file with some text in it")
    return Prepared(path=out.resolve(), tokens=tokens, dtype=dtype, documents=documents)


def check_token_file(path: str | Path, dtype: str, seq_len: int, vocab: int, fmt: str = "auto") -> TokenFile:
    """Everything that can be checked before ranks start, for one token source; returns it resolved.

    Every token is checked against the vocabulary (trainctl.data.check: a vectorised scan, cached next to
    the file), since the vocab-parallel embedding and loss would mask an out-of-range id, not fail on it."""
    import sys

    from trainctl.data.check import other_dtype_fits, scan_cached, uint32_read_as_uint16

    tf = open_token_file(path, fmt, dtype)
    n = tf.count
    if n < seq_len + 1:
        raise UsageError(f"data.path {path}: {n} tokens, fewer than one training window of "
                         f"model.seq_len + 1 = {seq_len + 1}",
                         hint="use more text or a smaller model.seq_len")
    itemsize = ITEMSIZE[tf.dtype]

    def progress(done: int, total: int) -> None:  # large files only: a scan of a few GB takes seconds
        if total * itemsize >= 1 << 30:
            print(f"\rchecking every token of {path}: {done / total:.0%}", end="" if done < total else "\n",
                  file=sys.stderr, flush=True)

    result = scan_cached(tf.path, tf.dtype, vocab, progress)
    if not result.in_range(vocab):
        other = other_dtype_fits(tf.path, tf.dtype, vocab) if tf.format == "flat" else None
        hint = (f"the file reads as valid {other} tokens: set data.dtype: {other}" if other else
                "re-tokenize with a tokenizer whose vocabulary fits, or raise model.vocab to cover it "
                f"(`trainctl data check {path} --vocab {vocab} --dtype {tf.dtype}` lists the damage)")
        bad = result.first_bad_id or 0
        what = f">= model.vocab {vocab}" if bad >= 0 else "negative"
        raise UsageError(f"data.path {path}: token id {bad} at token offset {result.first_bad_offset:,} (byte "
                         f"{(result.first_bad_offset or 0) * itemsize:,}) is {what}; {result.out_of_range:,} of "
                         f"{n:,} ids are out of range", hint=hint)
    if tf.format == "flat" and uint32_read_as_uint16(tf.path, tf.dtype):
        raise UsageError(f"data.path {path}: every second uint16 token is 0; the file looks like uint32 tokens",
                         hint="set data.dtype: uint32")
    return tf


def check_data(spec: RunSpec) -> int | None:
    """Preflight for a run: the tokens of every data source (summed over a blend), None for synthetic data."""
    if spec.data.synthetic:
        return None
    return sum(check_token_file(src.path, src.dtype, spec.model.seq_len, spec.model.vocab, src.format).count
               for src in spec.data.sources())

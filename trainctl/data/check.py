"""Every token of a token file checked against the vocabulary, before a run starts. No torch.

A vocab-parallel embedding and loss mask ids outside their shard, so an out-of-range id does not crash
training: it silently trains on garbage. The scan is vectorised over a memory map in chunks (about 1 GB/s
here, see `trainctl data check`), and its result is cached next to the file (trainctl.data.sidecar), so a relaunch or
every rank of a job reads a few bytes instead of rescanning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainctl.data import sidecar
from trainctl.data.files import ITEMSIZE

CHUNK_TOKENS = 1 << 24  # 32-64 MB per chunk: big enough to be vectorised, small enough for any host
CACHE_SUFFIX = ".trainctl-scan.json"
CACHE_VERSION = 2  # 2: keyed by the inode too

Progress = Callable[[int, int], None]  # (tokens scanned, tokens in all)


@dataclass(frozen=True)
class Scan:
    """What a whole-file scan found. `first_bad_*`: the first id outside 0..vocab-1 (None: none, or no vocab)."""

    path: str
    dtype: str
    count: int
    min: int
    max: int
    vocab: int | None = None
    out_of_range: int = 0
    first_bad_offset: int | None = None  # token index (byte offset = index * itemsize)
    first_bad_id: int | None = None

    def in_range(self, vocab: int) -> bool:
        return self.count == 0 or (self.min >= 0 and self.max < vocab)


def _tokens(path: str | Path, dtype: str) -> np.ndarray:
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


def scan(path: str | Path, dtype: str, vocab: int | None = None, progress: Progress | None = None) -> Scan:
    """Count, min and max of every token; with `vocab`, also how many ids are outside 0..vocab-1 and the
    first one."""
    tokens = _tokens(path, dtype)
    n = len(tokens)
    lo, hi, bad, first_at, first_id = None, None, 0, None, None
    for start in range(0, n, CHUNK_TOKENS):
        chunk = np.asarray(tokens[start: start + CHUNK_TOKENS])
        c_lo, c_hi = int(chunk.min()), int(chunk.max())
        lo = c_lo if lo is None else min(lo, c_lo)
        hi = c_hi if hi is None else max(hi, c_hi)
        if vocab is not None and (c_hi >= vocab or c_lo < 0):
            mask = (chunk >= vocab) | (chunk < 0)
            bad += int(np.count_nonzero(mask))
            if first_at is None:
                i = int(np.argmax(mask))
                first_at, first_id = start + i, int(chunk[i])
        if progress is not None:
            progress(min(start + CHUNK_TOKENS, n), n)
    return Scan(path=str(path), dtype=dtype, count=n, min=lo or 0, max=hi or 0, vocab=vocab, out_of_range=bad,
                first_bad_offset=first_at, first_bad_id=first_id)


def scan_cached(path: str | Path, dtype: str, vocab: int, progress: Progress | None = None) -> Scan:
    """`scan`, reusing the cached count/min/max while the file is unchanged (trainctl.data.sidecar). The cache is
    only a shortcut for files that pass: a file with ids out of range is scanned again to say where."""
    key = {"version": CACHE_VERSION, "dtype": dtype, **sidecar.stat_key(path)}
    saved = sidecar.read(path, CACHE_SUFFIX, key)
    with contextlib.suppress(KeyError, TypeError):
        if saved is not None and saved["min"] >= 0 and saved["max"] < vocab:
            return Scan(path=str(path), dtype=dtype, count=saved["count"], min=saved["min"], max=saved["max"],
                        vocab=vocab)
    result = scan(path, dtype, vocab, progress)
    if result.in_range(vocab):
        sidecar.write(path, CACHE_SUFFIX, key, {"count": result.count, "min": result.min, "max": result.max})
    return result


def uint32_read_as_uint16(path: str | Path, dtype: str, sample: int = 1 << 20) -> bool:
    """uint32 ids (all < 65536) read as uint16 put a zero in every odd slot: in range, but the wrong data."""
    if dtype != "uint16":
        return False
    head = np.asarray(_tokens(path, dtype)[:sample])
    return len(head) >= 64 and not head[1::2].any() and bool(head[0::2].any())


def other_dtype_fits(path: str | Path, dtype: str, vocab: int, sample: int = 1 << 20) -> str | None:
    """The other dtype, if the file reads as valid ids under it (a sample); None otherwise. Suggesting a
    dtype change only then keeps the hint from sending people after the wrong cause."""
    other = "uint32" if dtype == "uint16" else "uint16"
    size = Path(path).stat().st_size
    if size % ITEMSIZE[other] or size == 0:
        return None
    tokens = _tokens(path, other)
    head = np.asarray(tokens[:sample])
    if other == "uint16" and len(head) >= 64 and not head[1::2].any():
        return None  # uint16 view of small uint32 ids: not a uint16 file either
    return other if int(head.max()) < vocab else None

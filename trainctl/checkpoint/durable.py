"""Checksums and durable writes for checkpoint files. No torch.

Durable means fsynced: a commit marker must never reach the disk before the files it vouches for
(docs/ARCHITECTURE.md, "Checkpoint format and commit protocol").
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

HASH = "sha256"  # measured here: sha256 1.15 GB/s, blake2b 0.94, crc32 2.2 (sha-ni makes sha256 cheap)
_CHUNK = 4 << 20


def file_digest(path: Path) -> tuple[int, str]:
    """(size, sha256) of a file, reading it once."""
    h = hashlib.new(HASH)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)  # hashlib releases the GIL on large buffers: fine in a background thread
            size += len(chunk)
    return size, h.hexdigest()


def bytes_digest(data: bytes) -> str:
    return hashlib.new(HASH, data).hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes the names inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())

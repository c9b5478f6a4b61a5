"""Atomic file writes: a temporary file in the same directory, then a rename, so a reader (another rank, a
concurrent `trainctl status`, a restarted job) never sees half a file. No torch."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, text: str, mode: int | None = None, fsync: bool = False) -> None:
    """Replace `path` with `text` in one step; `fsync` also makes it durable before the rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

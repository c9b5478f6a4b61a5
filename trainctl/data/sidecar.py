"""Facts about a data file computed once (a scan of every token, a hash of its content) and cached in a small
JSON file beside it, valid while the file's size, modification time and inode are those recorded. No torch.

A relaunch, or every rank of a job, then reads a few bytes instead of the whole file. The key misses a file
rewritten in place with its old size and mtime restored: a fact that must not outlive such an edit is held to
more than the key (trainctl.data.identity reads a sample of the file at every check).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any


def stat_key(path: str | Path) -> dict[str, int]:
    """What a cached fact is valid for: the file's size, modification time and inode."""
    st = Path(path).stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _cache_path(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def read(path: str | Path, suffix: str, key: dict[str, Any]) -> dict[str, Any] | None:
    """The facts cached beside `path` under `key`; None when there are none, or they are for another key."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads(_cache_path(Path(path), suffix).read_text())
        if saved["key"] == key:
            return dict(saved["facts"])
    return None


def write(path: str | Path, suffix: str, key: dict[str, Any], facts: dict[str, Any]) -> None:
    """Cache `facts` beside `path`; a read-only data directory just means no cache."""
    cache = _cache_path(Path(path), suffix)
    with contextlib.suppress(OSError):
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "facts": facts}))
        os.replace(tmp, cache)  # atomic: ranks caching side by side never read half a cache

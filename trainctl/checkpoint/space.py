"""Disk space for checkpoints: free bytes, the one line of a full disk, the event that carries it. No torch.

The trainer (runtime/checkpoint/storage.py) turns a save that failed with ENOSPC (or EDQUOT) into one line and a
`disk_full` event; the launcher prints that line for the run (launch/diskspace.py, which also holds the
check before training). docs/design/checkpoints.md, "Disk space".
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from trainctl.rundir.runstate import DISK_FULL

DISK_FULL_EVENT = "disk_full"
# What an OSError of a full disk or an exhausted quota says (DCP reports errors as text, one per rank)
_FULL = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), f"[Errno {errno.ENOSPC}]", f"[Errno {errno.EDQUOT}]")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def existing_ancestor(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (a checkpoint directory not created yet lives there)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `path` (or its ancestor)."""
    return shutil.disk_usage(existing_ancestor(path)).free


def dir_bytes(path: Path) -> int:
    """Bytes the files under `path` hold (0 when it is gone)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                continue
    return total


def is_disk_full(text: str) -> bool:
    return any(s in text for s in _FULL)


def disk_full_message(directory: Path, step: int, free: int, needed: int, newest_valid: int | None) -> str:
    """The one line of a save that ran out of space."""
    newest = f"step {newest_valid}" if newest_valid is not None else "none"
    return (f"{DISK_FULL}: saving checkpoint step {step} in {directory} failed: {human_bytes(free)} free, "
            f"{human_bytes(needed)} needed per checkpoint; newest valid checkpoint: {newest} "
            "(free space, then `trainctl resume` continues from it)")

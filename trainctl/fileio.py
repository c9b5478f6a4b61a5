"""Atomic file writes: a temporary file in the same directory, then a rename, so a reader (another rank, a
concurrent `trainctl status`, a restarted job) never sees half a file. No torch.

The file gets the mode `open()` would give it (0666 less the umask), not mkstemp's 0600: others on the
cluster read run directories and token files, and a user who wants them private sets a umask (077).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def umask() -> int:
    """The process's umask: from /proc (Linux), else by setting it and straight back, which is not
    thread-safe (a file another thread creates meanwhile would get mode 0666)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_mode(executable: bool = False) -> int:
    """What `open()` (or, executable, `chmod +x` of it) gives a new file under the current umask."""
    return (0o777 if executable else 0o666) & ~umask()


def write_atomic(path: Path, text: str, executable: bool = False, fsync: bool = False) -> None:
    """Replace `path` with `text` in one step, with the umask's mode (`executable`: +x where the umask allows
    it); `fsync` also makes it durable before the rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, default_mode(executable))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

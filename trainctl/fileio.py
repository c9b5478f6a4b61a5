"""Atomic file writes: a temporary file in the same directory, then a rename, so a reader (another rank, a
concurrent `trainctl status`, a restarted job) never sees half a file. No torch.

The file gets the mode `open()` would give it (0666 less the umask), not mkstemp's 0600: others on the
cluster read run directories and token files, and a user who wants them private sets a umask (077).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
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


WRITABLE_FIX = "choose a writable place, or make it writable"  # said on the same line as the problem


def nearest_existing(path: Path) -> Path:
    """`path`, or the nearest of its parents that exists (what creating `path` writes into)."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def writable_problem(directory: Path) -> str | None:
    """Why nothing can be created in `directory` (or, when it does not exist yet, in the nearest parent it would
    be made in), or None. Tried for real with a temporary file: permission bits say nothing about a read-only
    mount, and root passes every access() check."""
    where = nearest_existing(directory)
    if not where.is_dir():
        return f"{where} is not a directory"
    try:
        fd, tmp = tempfile.mkstemp(prefix=".trainctl-write-check.", dir=where)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return f"cannot write in {where} ({e.strerror or e})"
    return None


def require_writable(directory: Path, what: str) -> None:
    """Refuse (UsageError, exit 2: one line) before any work when `what` (e.g. "run directory runs/x") cannot be
    written."""
    from trainctl.errors import UsageError

    problem = writable_problem(directory)
    if problem:
        raise UsageError(f"{what}: {problem}; {WRITABLE_FIX}")


def os_error_line(e: OSError) -> str:
    """An OSError as one line naming the file: '<path>: Read-only file system'."""
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e}"


@contextlib.contextmanager
def write_errors_as_usage(what: str) -> Iterator[None]:
    """Turn an OSError of the writes inside into one line (UsageError, exit 2): what was being written, the path
    and the reason; for what the check before (require_writable) cannot foresee (a full disk, a lost mount)."""
    from trainctl.errors import UsageError

    try:
        yield
    except OSError as e:
        raise UsageError(f"{what}: {os_error_line(e)}; {WRITABLE_FIX}") from e

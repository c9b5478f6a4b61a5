"""Files written so that no reader sees half of one, and their checksums. No torch.

Atomic writes: a temporary file in the same directory, then a rename, so a reader (another rank, a concurrent
`trainctl status`, a restarted job) never sees half a file. Durable writes are fsynced: a checkpoint's commit
marker must never reach the disk before the files it vouches for (docs/design/checkpoints.md, "Checkpoint format and
commit protocol"). Checksums (`file_digest`) are those of checkpoint files and of the token files a run
trains on.

JSON (`json_text`) is written one way, to files (plan.json) and to `--json` alike: strict RFC 8259. Python's
json module writes a NaN or infinite float as the bare words `NaN` / `Infinity`, which strict parsers (jq,
JavaScript's JSON.parse, Go, serde) reject; here a non-finite number becomes null, and the record that holds
it says what null means there (a NaN loss; a whole run not expected to finish).

The file gets the mode `open()` would give it (0666 less the umask), not mkstemp's 0600: others on the
cluster read run directories and token files, and a user who wants them private sets a umask (077).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO


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
    it). `fsync` makes it durable: the file's data before the rename, then its directory (the new name), so
    that after a crash or a file-system error the path holds the old text or the new, never an empty file (a
    run directory's records: a resume needs them)."""
    import tempfile  # tempfile and hashlib are imported where used: `trainctl --help` loads this module

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
    if fsync:
        fsync_path(path.parent)


# O_NOFOLLOW: a run directory's files are written only as regular files trainctl made there, never through a
# symbolic link that a copy or a hand put in their place (the append would land in the link's target).
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
LINK_REFUSED = "is a symbolic link; trainctl writes only regular files it made there"
LINK_FIX = "replace the link with a regular file (or remove it)"


def open_nofollow(path: Path, flags: int) -> int:
    """os.open(path, flags) with the umask's mode for a new file, refusing a symbolic link at `path` with an
    OSError (ELOOP) whose text says so (`os_error_line` then gives one line naming the file)."""
    try:
        return os.open(path, flags | NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise OSError(errno.ELOOP, f"{LINK_REFUSED}; {LINK_FIX}", str(path)) from None
        raise


def open_append(path: Path) -> BinaryIO:
    """`path` opened to append (and read), created when missing; never through a symbolic link."""
    return os.fdopen(open_nofollow(path, os.O_RDWR | os.O_APPEND | os.O_CREAT), "a+b")


def replace_file(path: Path, data: bytes) -> None:
    """Write `data` under a temporary name beside `path` (made fresh: never a link), then rename it over `path`:
    readers see the old or the new file whole. For small, often rewritten files (heartbeats) that need no
    fsync and no random name (a dead writer's `.tmp` is simply overwritten)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        if os.path.islink(tmp):
            os.unlink(tmp)
    with os.fdopen(open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
        f.write(data)
    os.replace(tmp, path)


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
    import tempfile

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

HASH = "sha256"  # measured here: sha256 1.15 GB/s, blake2b 0.94, crc32 2.2 (sha-ni makes sha256 cheap)
_CHUNK = 4 << 20


def file_digest(path: Path) -> tuple[int, str]:
    """(size, sha256) of a file, reading it once."""
    import hashlib

    h = hashlib.new(HASH)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)  # hashlib releases the GIL on large buffers: fine in a background thread
            size += len(chunk)
    return size, h.hexdigest()


def bytes_digest(data: bytes) -> str:
    import hashlib

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


class NotRegularFile(OSError):
    """`read_capped`'s refusal of what is not a regular file: a FIFO never ends, a device never stops
    (/dev/zero), a directory has no text. `kind` names it in words."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(f"{path} is {kind}, not a regular file")
        self.kind = kind


class TooLarge(OSError):
    """`read_capped`'s refusal of a file longer than its limit (`limit` bytes)."""

    def __init__(self, path: Path, limit: int) -> None:
        super().__init__(f"{path} is larger than {limit} bytes")
        self.limit = limit


def file_kind(mode: int) -> str:
    """What a stat mode is, in words ('a named pipe (FIFO)')."""
    import stat

    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "a regular file" if stat.S_ISREG(mode) else "not a file"


def read_capped(path: Path, limit: int) -> bytes:
    """The bytes of the regular file `path`, refusing (NotRegularFile, TooLarge) before reading more than `limit`
    of them. Opened non-blocking and judged by fstat of what was opened: a FIFO's open would wait for a writer
    for ever, and a file swapped between a stat and the open is still judged by what is read."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, file_kind(mode))
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)  # one byte more tells a file of exactly `limit` from a longer one
    finally:
        os.close(fd)
    if len(data) > limit:
        raise TooLarge(path, limit)
    return data


def finite(value: Any) -> Any:
    """`value` with every NaN/inf float (at any depth) replaced by None; dict keys become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def json_text(value: Any, *, compact: bool = False) -> str:
    """Strict JSON text (module docstring): indented, or `compact` (no spaces) for outputs of millions of
    numbers. Objects json cannot encode (paths) become their string, as `str()` writes them."""
    style: dict[str, Any] = {"separators": (",", ":")} if compact else {"indent": 2}
    try:  # the common case has nothing to replace: skip the copy (plan --json --ranks at 16k GPUs)
        return json.dumps(value, allow_nan=False, default=str, **style)
    except ValueError:
        return json.dumps(finite(value), allow_nan=False, default=str, **style)

"""One job per run directory: the run lock `RUN/run.lock` (docs/design/run-states.md, "Run lock"). No torch.

A local launcher (`trainctl launch`, `trainctl resume`, `trainctl calibrate`) holds the lock for as long as it
runs; a second launcher on the same run directory is refused (exit 2) with one line naming the owner and
how to stop it. The lock file is created with O_CREAT|O_EXCL (atomic on local file systems, NFS v3+ and
Lustre) and holds JSON: host, pid, the pid's start time (/proc/PID/stat field 22, so a recycled pid is not
mistaken for the owner), the boot id, a random token, and the owner's child processes (torchrun and its
ranks, each with its start time) so that a launcher that died while torchrun trains on still counts as
live. The owner refreshes the file's mtime every HEARTBEAT_S (a heartbeat).

A lock is stale, and the next launcher takes it over with a one-line note, when
- same host: the boot id changed (rebooted), or none of the recorded processes exists with its recorded
  start time (crashed, killed);
- another host (a login node that cannot look at the owner's processes): its heartbeat is older than
  STALE_AFTER_S;
- the file is unreadable (a crash between create and write) and older than WRITING_GRACE_S.

Taking over happens under a second exclusive create (run.lock.takeover): the lock is read again, removed only
when it is still the one judged stale, and created anew with O_EXCL.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trainctl.errors import UsageError
from trainctl.hardware.hostname import this_host
from trainctl.launch.procs import descendants
from trainctl.rundir.paths import RunPaths
from trainctl.rundir.runstate import stop_in_flight

HEARTBEAT_S = 10.0  # the owner touches the lock this often
STALE_AFTER_S = 120.0  # another host: a lock not touched for this long has lost its owner
WRITING_GRACE_S = 10.0  # an empty or torn lock file younger than this is still being written
CHILD_POLL_S = 1.0  # how often the owner looks for new child processes (torchrun, ranks) to record
MAX_CHILDREN = 256  # recorded in the lock: torchrun and its ranks, with room to spare
UNKNOWN_START = -1  # a process that exists but whose start time cannot be read (no /proc)


# --- facts about this machine and its processes ---------------------------------------------------------

def proc_start(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (/proc/PID/stat field 22); None when there
    is no such process; UNKNOWN_START when it exists but /proc cannot say (not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None  # Linux, and no such process
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return UNKNOWN_START
    except OSError:
        return UNKNOWN_START
    try:  # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] in ("Z", "X"):  # a zombie (dead, not yet reaped by its parent) or dying: gone
            return None
        return int(fields[19])
    except (ValueError, IndexError):
        return UNKNOWN_START


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


# --- the lock's content and the verdict on it (pure) -----------------------------------------------------

@dataclass(frozen=True)
class Owner:
    """What run.lock records about the launcher that holds it."""

    host: str
    pid: int
    start: int | None  # /proc/PID/stat start time (ticks since boot); None where unknown
    boot_id: str | None
    token: str  # random: tells our own lock from one written after a takeover
    command: str  # launch, resume, calibrate
    since: float  # when it was taken (epoch seconds)
    children: tuple[tuple[int, int | None], ...] = ()  # (pid, start) of torchrun and its ranks

    def to_json(self) -> str:
        return json.dumps({"host": self.host, "pid": self.pid, "start": self.start, "boot_id": self.boot_id,
                           "token": self.token, "command": self.command, "since": self.since,
                           "children": [list(c) for c in self.children]}) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Owner | None:
        """The owner recorded in `text`, or None when it is empty or torn."""
        try:
            d = json.loads(text)
            return cls(host=str(d["host"]), pid=int(d["pid"]), start=_opt_int(d.get("start")),
                       boot_id=d.get("boot_id"), token=str(d.get("token") or ""),
                       command=str(d.get("command") or "launch"), since=float(d.get("since") or 0.0),
                       children=tuple((int(c[0]), _opt_int(c[1])) for c in d.get("children") or []))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return None


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


@dataclass(frozen=True)
class Here:
    """The machine that judges a lock: its host name, boot id and a way to read a process's start time."""

    host: str
    boot_id: str | None
    start_of: Callable[[int], int | None] = field(default=proc_start, compare=False)

    @classmethod
    def now(cls) -> Here:
        return cls(this_host(), boot_id())


@dataclass(frozen=True)
class Verdict:
    live: bool
    why: str  # "pid 123 is running", "pid 123 is gone", "no heartbeat for 900 s", ...


def verdict(owner: Owner | None, age_s: float, here: Here, stale_after_s: float = STALE_AFTER_S) -> Verdict:
    """Whether the lock's owner may still be running. `age_s`: seconds since the lock file was last touched."""
    if owner is None:
        if age_s < WRITING_GRACE_S:
            return Verdict(True, f"the lock file is being written ({age_s:.0f} s old)")
        return Verdict(False, f"the lock file is empty or torn and {age_s:.0f} s old")
    if owner.host != here.host:
        if age_s < stale_after_s:
            return Verdict(True, f"heartbeat {age_s:.0f} s ago")
        return Verdict(False, f"no heartbeat from host {owner.host} for {age_s:.0f} s (> {stale_after_s:.0f} s)")
    if owner.boot_id and here.boot_id and owner.boot_id != here.boot_id:
        return Verdict(False, f"host {owner.host} has rebooted since")
    for what, pid, start in [("pid", owner.pid, owner.start), *(("child pid", p, s) for p, s in owner.children)]:
        now = here.start_of(pid)
        if now is None:
            continue
        if start is None or now in (UNKNOWN_START, start):
            return Verdict(True, f"{what} {pid} is running")
    gone = f"pid {owner.pid} is gone" if here.start_of(owner.pid) is None else \
        f"pid {owner.pid} is now another process (start time differs)"
    return Verdict(False, gone + (f", and so are its {len(owner.children)} child processes" if owner.children else ""))


def describe(owner: Owner | None) -> str:
    if owner is None:
        return "a launcher that is still writing its lock"
    what = f"trainctl {owner.command} (pid {owner.pid} on host {owner.host}"
    torchrun = [p for p, _ in owner.children[:1]]
    if torchrun:
        what += f", torchrun pid {torchrun[0]}"
    if owner.since:
        what += ", since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.since))
    return what + ")"


def refusal(root: Path, owner: Owner | None, v: Verdict, here_host: str) -> str:
    """The one line a second launcher exits with: stop the live job, or, when it was asked to stop already,
    wait for it to end (a second cancel would change nothing)."""
    stopping = stop_in_flight(RunPaths(root))
    if stopping is not None:
        return (f"{root} is still stopping: {stopping} ({describe(owner)}, {v.why}); wait for it to end "
                f"(`trainctl status {root}` says when it has), then run this again")
    where = "" if owner is None or owner.host == here_host else f" on host {owner.host}"
    return (f"{root} is in use by a live job: {describe(owner)}, {v.why}; stop it with "
            f"`trainctl cancel {root}`{where} (or wait for it to end)")


# --- the lock file --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Held:
    """What a lock file holds now: the owner (None: torn), its raw bytes, seconds since its last touch."""

    owner: Owner | None
    raw: bytes
    age_s: float


def read_lock(path: Path) -> Held | None:
    try:
        with open(path, "rb") as f:
            raw = f.read()
            mtime = os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None
    return Held(Owner.from_json(raw.decode("utf-8", errors="replace")), raw, max(0.0, time.time() - mtime))


def check_free(root: Path, here: Here | None = None) -> None:
    """Refuse (UsageError, exit 2) when a live launcher holds the run directory's lock; a stale lock passes
    (the launcher takes it over when it starts)."""
    held = read_lock(RunPaths(root).lock)
    if held is None:
        return
    here = here or Here.now()
    v = verdict(held.owner, held.age_s, here)
    if v.live:
        raise UsageError(refusal(root, held.owner, v, here.host))


class RunLock:
    """A held lock: its heartbeat thread records child processes and touches the file; release() removes it."""

    def __init__(self, path: Path, owner: Owner) -> None:
        self.path, self.owner = path, owner
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False  # the lock was taken over (our owner looked stale to someone): stop touching it

    def start_heartbeat(self) -> RunLock:
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def ours(self) -> bool:
        held = read_lock(self.path)
        return held is not None and held.owner is not None and held.owner.token == self.owner.token

    def _beat(self) -> None:
        touched = time.monotonic()
        while not self._stop.wait(CHILD_POLL_S) and not self.lost:
            try:
                kids = tuple((p, proc_start(p)) for p in descendants(self.owner.pid)[:MAX_CHILDREN])
                kids = tuple(k for k in kids if k[1] is not None)
                changed = {p for p, _ in kids} != {p for p, _ in self.owner.children}
                if not (changed or time.monotonic() - touched >= HEARTBEAT_S):
                    continue
                if not self.ours():
                    self.lost = True
                    break
                if changed:
                    self.owner = replace(self.owner, children=kids)
                    _write_replace(self.path, self.owner.to_json())
                else:
                    os.utime(self.path)  # on NFS: the server's time, so clients' clocks do not matter
                touched = time.monotonic()
            except OSError:
                continue  # a transient error of a network file system: try again at the next beat

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            if self.ours():
                self.path.unlink()


def _write_replace(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _create(path: Path, owner: Owner) -> bool:
    """Create the lock file holding `owner`; False when it already exists. O_EXCL: atomic on NFS v3+."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(owner.to_json())
        f.flush()
        os.fsync(f.fileno())
    return True


def _take_over(path: Path, mutex: Path, seen: bytes) -> bool:
    """Remove the stale lock we read (`seen`); False when another launcher is taking it over or it changed.

    Takeovers are serialised by a second exclusive create (RUN/run.lock.takeover, held for milliseconds):
    under it the lock is read again and removed only when it is still the one judged stale. Nobody else
    removes a lock, and every lock is created with O_EXCL, so of racing launchers exactly one ends up
    creating the new lock (the others then find it live and are refused)."""
    try:
        os.close(os.open(mutex, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        with contextlib.suppress(OSError):
            if time.time() - mutex.stat().st_mtime > WRITING_GRACE_S:
                mutex.unlink()  # left by a launcher that died during its takeover
        time.sleep(0.02)
        return False
    try:
        held = read_lock(path)
        if held is None or held.raw != seen:
            return False
        path.unlink()
        return True
    finally:
        with contextlib.suppress(OSError):
            mutex.unlink()


def acquire(root: Path, command: str, note: Callable[[str], None] | None = None, here: Here | None = None) -> RunLock:
    """Take the run directory's lock for this process (or refuse with UsageError, exit 2) and start its
    heartbeat. A stale lock is taken over and `note` gets one line saying whose it was and why it was stale."""
    path = RunPaths(root).lock
    here = here or Here.now()
    pid = os.getpid()
    owner = Owner(host=here.host, pid=pid, start=proc_start(pid), boot_id=here.boot_id,
                  token=secrets.token_hex(8), command=command, since=time.time())
    took: str | None = None
    for _ in range(50):
        if _create(path, owner):
            if took and note is not None:
                note(took)
            return RunLock(path, owner).start_heartbeat()
        held = read_lock(path)
        if held is None:
            continue  # released between our create and our read
        v = verdict(held.owner, held.age_s, here)
        if v.live:
            raise UsageError(refusal(root, held.owner, v, here.host))
        if _take_over(path, RunPaths(root).lock_takeover, held.raw):
            took = f"took over the stale lock of {describe(held.owner)} on {root}: {v.why}"
    raise UsageError(f"{root}: could not take the run lock {path.name} (other launchers keep taking it)",
                     hint=f"see who holds it: cat {path}")


@contextlib.contextmanager
def hold(root: Path, command: str, note: Callable[[str], None] | None = None) -> Iterator[RunLock]:
    """Hold the run directory's lock for the duration of the block (released however the block ends)."""
    lock = acquire(root, command, note)
    try:
        yield lock
    finally:
        lock.release()

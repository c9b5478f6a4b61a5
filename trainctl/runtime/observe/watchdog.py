"""Hang watchdog: a rank with no step progress for `timeout_s` names the rank that stopped, dumps every Python
stack and exits non-zero.

Why: a hung collective (a dead peer, a deadlocked pipeline, a stuck filesystem) otherwise holds the whole
allocation until the job's time limit. Exiting makes torchrun (max_restarts) or Slurm (requeue) restart
the job from the last checkpoint instead.

Heartbeats: each rank's watchdog thread rewrites RUN/logs/heartbeat-rank<r> ({"step", "progress", "time",
"state", "pid", "host"}) every `heartbeat_every_s` whether or not the rank makes progress: "progress" is when
step `step` ended, "time" when the file was written. When one rank stops, every rank waiting for it in a
collective stops advancing too and its watchdog fires as well; what tells the cause apart is that a stopped
process (SIGSTOP, a frozen node, C code that never lets the thread run) stops rewriting its file. So the
watchdog that fires reads every rank's heartbeat and names the rank whose file went stale first (else
itself) in the `hang` event: `rank` is the hung rank, `detected_by` the rank whose watchdog fired. A stale
rank on this node, started by the same parent (torchrun's agent, slurmstepd), is SIGKILLed: a stopped
process ignores the SIGTERM torchrun sends next, and torchrun would wait 30 s for it.

Timeout: env TRAINCTL_WATCHDOG_S (seconds; 0 or "off" disables) wins over the spec's train.watchdog_s
(default 600 s). The test-only fault `hang=<rank>:<step>` (runtime/train/faults.py) blocks that rank's main thread
forever at the start of that step (its own watchdog fires and dumps it).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainctl.fileio import replace_file
from trainctl.hardware.hostname import this_host
from trainctl.rundir.paths import RunPaths, record_event
from trainctl.runtime.train import faults

DEFAULT_TIMEOUT_S = 600.0
WATCHDOG_ENV = "TRAINCTL_WATCHDOG_S"
HANG_EXIT_CODE = 1  # a failed rank, like any other failure: torchrun/Slurm restart on non-zero


def timeout_from(spec: Any, env: dict[str, str] | None = None) -> float | None:
    """The watchdog timeout in seconds, None when disabled."""
    raw = (os.environ if env is None else env).get(WATCHDOG_ENV)
    if raw is not None and raw.strip():
        if raw.strip().lower() in ("0", "off", "none", "false"):
            return None
        return float(raw)
    train = getattr(spec, "train", None)
    if train is not None and hasattr(train, "watchdog_s"):
        value = train.watchdog_s
        return float(value) if value else None
    return DEFAULT_TIMEOUT_S


def heartbeat_path(paths: RunPaths, rank: int) -> Path:
    return paths.heartbeat(rank)


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """One rank's heartbeat file as read back."""

    rank: int
    step: int  # the last step it completed (as of the write)
    time: float  # wall time the file was written: a running process rewrites it every heartbeat_every_s
    state: str  # "running", "stopped", "hung"
    pid: int
    host: str

    @classmethod
    def read(cls, path: Path) -> Heartbeat | None:
        try:
            d = json.loads(path.read_text())
            return cls(rank=int(d["rank"]), step=int(d["step"]), time=float(d["time"]), state=str(d["state"]),
                       pid=int(d["pid"]), host=str(d.get("host")))
        except (OSError, ValueError, KeyError, TypeError):  # absent (the rank has not started), or not ours
            return None


def hung_rank(beats: list[Heartbeat], me: Heartbeat, now: float, stale_after_s: float) -> Heartbeat:
    """The rank whose progress stopped first, as the watchdog of `me` sees it when it fires: the running rank
    whose file went stale first (its process no longer runs at all), else `me` (every rank is alive: the one
    whose watchdog fires is as likely as any; a stuck rank's own watchdog names itself)."""
    stale = [b for b in beats if b.state == "running" and b.rank != me.rank and now - b.time > stale_after_s]
    if not stale:
        return me
    first = min(stale, key=lambda b: b.time)
    # Every step ends in an all-reduce over every rank (the stop agreement), so the stopped rank completed
    # every step `me` did; its file, rewritten every few seconds, may not show the last of them.
    return dataclasses.replace(first, step=max(first.step, me.step))


class Watchdog:
    """Call `beat(step)` after every step; the daemon thread rewrites the heartbeat file and fires when no beat
    came for `timeout_s`."""

    def __init__(self, paths: RunPaths, rank: int, timeout_s: float, heartbeat_every_s: float | None = None,
                 world_size: int = 1):
        self.paths, self.rank, self.timeout_s, self.world_size = paths, rank, timeout_s, world_size
        self.heartbeat_every_s = heartbeat_every_s if heartbeat_every_s is not None else min(10.0, timeout_s / 4)
        # a live rank's file is at most heartbeat_every_s (plus a poll) old; one not rewritten for half the hang
        # limit belongs to a process that does not run (a stopped rank's is about the whole limit old by then)
        self.stale_after_s = max(2 * self.heartbeat_every_s, timeout_s / 2)
        self.step = 0
        self.last = time.monotonic()
        self.progress = time.time()
        self.last_file = 0.0
        self.host = this_host()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"trainctl-watchdog-rank{rank}", daemon=True)

    def start(self) -> Watchdog:
        self._write_heartbeat("running")
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        self.step = step
        self.last = time.monotonic()
        self.progress = time.time()

    def stop(self, state: str = "stopped") -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()  # its last "running" rewrite must not land after this one
        self._write_heartbeat(state)

    def _loop(self) -> None:
        poll = max(0.02, min(5.0, self.timeout_s / 20))
        while not self._stop.wait(poll):
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
                self._fire(idle)
            if time.monotonic() - self.last_file >= self.heartbeat_every_s:
                self._write_heartbeat("running")

    def _fire(self, idle: float) -> None:
        hung = self._hung_rank()
        killed = hung.rank != self.rank and self._kill_if_sibling(hung)
        msg = (f"trainctl: rank {self.rank}: watchdog: no step progress for {idle:.0f} s (limit "
               f"{self.timeout_s:g} s; last completed step {self.step}); "
               + ("" if hung.rank == self.rank else
                  f"rank {hung.rank} on {hung.host} stopped first (its heartbeat is {time.time() - hung.time:.0f} s "
                  f"old{'; killed it' if killed else ''}); ")
               + f"all Python stacks follow, then exit {HANG_EXIT_CODE} so the launcher can restart the job")
        try:
            print(msg, file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - the exit below must happen whatever the log does
            pass
        try:
            self._write_heartbeat("hung")
            now = time.time()
            record_event(self.paths, "hang", rank=hung.rank, host=hung.host, step=hung.step,
                         idle_s=round(idle, 3), timeout_s=self.timeout_s, detected_by=self.rank,
                         heartbeat_age_s=round(now - hung.time, 3), killed=killed)
        except OSError:
            pass
        os._exit(HANG_EXIT_CODE)  # not sys.exit: the main thread is stuck and would never unwind

    def _hung_rank(self) -> Heartbeat:
        me = Heartbeat(self.rank, self.step, time.time(), "running", os.getpid(), self.host)
        beats = [b for r in range(self.world_size) if (b := Heartbeat.read(heartbeat_path(self.paths, r)))]
        return hung_rank(beats, me, time.time(), self.stale_after_s)

    def _kill_if_sibling(self, hung: Heartbeat) -> bool:
        """SIGKILL the hung rank when it runs on this node under this rank's parent (torchrun's agent, Slurm's
        step daemon): that tells a rank of this job from a process that reuses the pid of an older one."""
        if hung.host != self.host or _parent_of(hung.pid) != os.getppid():
            return False
        try:
            os.kill(hung.pid, signal.SIGKILL)
        except OSError:
            return False
        return True

    def _write_heartbeat(self, state: str) -> None:
        self.last_file = time.monotonic()
        path = heartbeat_path(self.paths, self.rank)
        try:
            path.parent.mkdir(exist_ok=True)  # not its parents: a deleted run directory stays deleted
            replace_file(path, json.dumps({"rank": self.rank, "step": self.step, "progress": self.progress,
                                           "time": time.time(), "state": state, "pid": os.getpid(),
                                           "host": self.host}).encode())  # readers never see a torn file
        except OSError:
            pass


def _parent_of(pid: int) -> int | None:
    """The parent pid of a process on this machine (None: gone, or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 1:].split()[1])  # after "(comm)": state, ppid
    except (OSError, ValueError, IndexError):
        return None


def hang_step(rank: int, env: dict[str, str] | None = None) -> int | None:
    """The step at which the `hang` fault makes this rank hang, if any."""
    raw = (faults.get("hang", env) or "").strip()
    if not raw:
        return None
    r, _, s = raw.partition(":")
    try:
        return int(s) if int(r) == rank else None
    except ValueError as e:
        raise ValueError(f"fault hang={raw!r}: expected <rank>:<step>") from e


def hang_forever() -> None:
    """The test-only hang: block the calling thread for good (the watchdog's stack dump shows it here)."""
    threading.Event().wait()

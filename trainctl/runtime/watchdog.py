"""Hang watchdog: a rank with no step progress for `timeout_s` dumps every Python stack and exits non-zero.

Why: a hung collective (a dead peer, a deadlocked pipeline, a stuck filesystem) otherwise holds the whole
allocation until the job's time limit. Exiting makes torchrun (max_restarts) or Slurm (requeue) restart
the job from the last checkpoint instead. Each rank also keeps a heartbeat file RUN/logs/heartbeat-rank<r>
({"step", "time", "state"}, rewritten at most every few seconds) so a person or a launcher can see which
rank stopped advancing. No torch import.

Timeout: env TRAINCTL_WATCHDOG_S (seconds; 0 or "off" disables) wins over the spec's train.watchdog_s
(default 600 s). The test-only fault `hang=<rank>:<step>` (runtime/faults.py) blocks that rank forever at the
start of that step.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainctl.rundir import RunPaths, record_event
from trainctl.runtime import faults

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


class Watchdog:
    """Call `beat(step)` after every step; the daemon thread fires when no beat came for `timeout_s`."""

    def __init__(self, paths: RunPaths, rank: int, timeout_s: float, heartbeat_every_s: float | None = None):
        self.paths, self.rank, self.timeout_s = paths, rank, timeout_s
        self.heartbeat_every_s = heartbeat_every_s if heartbeat_every_s is not None else min(10.0, timeout_s / 4)
        self.step = 0
        self.last = time.monotonic()
        self.last_file = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"trainctl-watchdog-rank{rank}", daemon=True)

    def start(self) -> Watchdog:
        self._write_heartbeat("running")
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        self.step = step
        self.last = time.monotonic()
        if self.last - self.last_file >= self.heartbeat_every_s:
            self._write_heartbeat("running")

    def stop(self, state: str = "stopped") -> None:
        self._stop.set()
        self._write_heartbeat(state)

    def _loop(self) -> None:
        poll = max(0.02, min(5.0, self.timeout_s / 20))
        while not self._stop.wait(poll):
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        msg = (f"trainctl: rank {self.rank}: watchdog: no step progress for {idle:.0f} s (limit "
               f"{self.timeout_s:g} s; last completed step {self.step}); all Python stacks follow, then exit "
               f"{HANG_EXIT_CODE} so the launcher can restart the job")
        try:
            print(msg, file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - the exit below must happen whatever the log does
            pass
        try:
            self._write_heartbeat("hung")
            record_event(self.paths, "hang", rank=self.rank, host=socket.gethostname(), step=self.step,
                         idle_s=round(idle, 3), timeout_s=self.timeout_s)
        except OSError:
            pass
        os._exit(HANG_EXIT_CODE)  # not sys.exit: the main thread is stuck and would never unwind

    def _write_heartbeat(self, state: str) -> None:
        self.last_file = time.monotonic()
        path = heartbeat_path(self.paths, self.rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"rank": self.rank, "step": self.step, "time": time.time(), "state": state,
                                       "pid": os.getpid()}))
            os.replace(tmp, path)  # readers never see a torn file
        except OSError:
            pass


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

"""Stop requests: SIGTERM / SIGUSR1 / SIGUSR2 -> checkpoint at the next step boundary, then exit 75.

The handler only records the signal (it runs between bytecodes of the main thread, possibly in the middle
of a step). At each step boundary every rank contributes its flag to one tiny all-reduce (MAX), so a
signal delivered to ANY rank (Slurm may signal only the batch step, a user only one pid) stops every
rank after the same step. The same all-reduce carries the "a timed checkpoint is due" flag, whose clock
differs per rank.

The flag is one per process (`STOP`), installed by the rank's entry point before anything else, so a
stop request during start-up (process groups, model build, checkpoint load) is kept, not fatal: the ranks
then stop before their first step. A request made before the handler existed is read from the run directory
instead (`recorded_stop`): the launcher signals only ranks that already handle SIGTERM. A rank
whose parent goes away (torchrun killed, its launcher with it) raises the same flag itself, as SIGHUP
("hang-up: the controlling process died"), so a killed launcher never leaves ranks training on
(docs/design/signals.md, "Signal chain").
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Mapping
from types import FrameType

import torch
import torch.distributed as dist

from trainctl.rundir.paths import RunPaths, read_jsonl
from trainctl.rundir.runstate import attempt_begin, since, stop_requested
from trainctl.runtime.train import faults

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
PARENT_GONE = signal.SIGHUP  # what the parent watch records: the process that started this rank is gone
PARENT_POLL_S = 0.5


class StopFlag:
    """Which stop signal this process received (0 = none)."""

    def __init__(self) -> None:
        self.signum = 0
        self._installed = False

    def install(self) -> StopFlag:
        """Idempotent; the handlers stay until the process exits (os._exit), so a late signal during the
        final save or barrier is recorded, never fatal."""
        if not self._installed:
            for s in STOP_SIGNALS:
                signal.signal(s, self._handle)
            self._installed = True
        return self

    def request(self, signum: int) -> None:
        if not self.signum:
            self.signum = signum

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.request(signum)

    def watch_parent(self) -> None:
        """A daemon thread raising the flag (PARENT_GONE) when this process is re-parented: its parent died."""
        parent = os.getppid()

        def watch() -> None:
            stopped = threading.Event()
            while not stopped.wait(PARENT_POLL_S):
                if os.getppid() != parent:
                    self.request(PARENT_GONE)
                    return

        threading.Thread(target=watch, name="trainctl-parent-watch", daemon=True).start()


STOP = StopFlag()  # the process's one stop flag: entry.main installs it first thing


def recorded_stop(paths: RunPaths, env: Mapping[str, str] = os.environ) -> int:
    """The stop asked for this attempt before this rank could handle a signal, as a signal number (0: none).

    Every stop is recorded in events.jsonl before it is sent, so a rank that reads it once its handler is
    installed misses none and stops before its first step like one that received it:
    - the local launcher's and `trainctl cancel`'s (`stop_requested`, `cancel_requested`: SIGTERM), which
      signal only ranks that already handle SIGTERM;
    - the Slurm batch script's (`signal`, for this job and attempt): Slurm signals only the processes that exist,
      and under torchrun a rank ignores a stop until its handler is installed (the step's wrapper ignores TERM
      and USR1 for torchrun). (docs/design/signals.md, "Signal chain".)"""
    try:
        events = read_jsonl(paths.events)
    except OSError:  # unreadable: no request can be read from it either
        return 0
    if stop_requested(since(events, attempt_begin(events))) is not None:
        return int(signal.SIGTERM)
    job = env.get("SLURM_JOB_ID")
    if not job:
        return 0
    attempt = int(env.get("SLURM_RESTART_COUNT") or 0)
    for e in reversed(events):
        if e.get("event") == "signal" and str(e.get("job_id")) == job and e.get("attempt") == attempt:
            return int(getattr(signal.Signals, f"SIG{e.get('signal')}", 0))
    return 0


def stop_after_step() -> int:
    """The step after which the `stop_after_step` fault stops the run as a signal would (0: never)."""
    return faults.get_int("stop_after_step")


def agree(flags: list[int], device: torch.device) -> list[int]:
    """Element-wise MAX of small integer flags over every rank (one all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flags
    t = torch.tensor(flags, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(x) for x in t.tolist()]


def name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def why(signum: int) -> str:
    """The stop request in words, for events and the console."""
    return "the launcher or torchrun was killed" if signum == PARENT_GONE else name(signum)

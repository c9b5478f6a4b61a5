"""Stop requests: SIGTERM / SIGUSR1 / SIGUSR2 -> checkpoint at the next step boundary, then exit 75.

The handler only records the signal (it runs between bytecodes of the main thread, possibly in the middle
of a step). At each step boundary every rank contributes its flag to one tiny all-reduce (MAX), so a
signal delivered to ANY rank (Slurm may signal only the batch step, a user only one pid) stops every
rank after the same step. The same all-reduce carries the "a timed checkpoint is due" flag, whose clock
differs per rank.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

from trainctl.runtime import faults

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class StopFlag:
    """Which stop signal this process received (0 = none); installed once per trainer process."""

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict[int, object] = {}

    def install(self) -> StopFlag:
        for s in STOP_SIGNALS:
            self._old[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        self._old.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if not self.signum:
            self.signum = signum


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

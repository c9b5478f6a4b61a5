"""Time a rank spends inside tensor-parallel collectives and pipeline receives, for straggler detection.

A slow rank makes its TP peers wait in the next TP collective and the neighbouring pipeline stages wait in
their receives. Without this, those waits look like the peers' own work and a whole TP group or pipeline
looks slow. Subtracting this time (with the gradient sync's) from the step leaves each rank's own work, so
the straggler is named exactly (trainctl/report/stragglers.py).

What is timed:
  - CPU (gloo): the collectives and `Work.wait()` block the host, so a perf_counter pair is exact.
  - GPU (NCCL): the host does not block. A CUDA event pair on the current stream around the call measures
    how long the compute stream stood still, because the stream waits for the collective or the receive.
    The events are read at the end of the step, after the trainer's synchronize.
The cost is two timer reads or two event records per collective. Under train.compile the timer is left out
of the compiled graphs (torch.compiler.disable): it runs as it does eagerly, between them.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class CommWait:
    """Process-wide accumulator: `with COMM: <collective>`; `take()` returns the seconds since the last take."""

    def __init__(self) -> None:
        self.host_s = 0.0
        self.cuda = False
        self._events: list[tuple[Any, Any]] = []
        self._t0 = 0.0
        self._start: Any = None

    def use_cuda(self, on: bool) -> None:
        self.cuda = on

    @torch.compiler.disable
    def __enter__(self) -> CommWait:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    @torch.compiler.disable
    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self.host_s += time.perf_counter() - self._t0

    def take(self) -> float:
        """Seconds accumulated since the last take (on GPU: call after the step's synchronize)."""
        total = self.host_s + sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        self.host_s, self._events = 0.0, []
        return total


COMM = CommWait()
# The pipeline receives' share of COMM (bubble and point-to-point waits): `mfu-report` holds it against the
# plan's bubble + p2p, and COMM minus it against the plan's TP/CP/EP collectives.
PP_WAIT = CommWait()

_hooked = False


def time_pipeline_receives() -> None:
    """Time torch.distributed.pipelining's waits on its batched sends and receives (once per process).

    The schedules call the module-level `_wait_batch_p2p` (torch 2.13), so it is replaced there. If a torch
    version moves it, nothing is hooked and pipeline waits count as work, as they did before."""
    global _hooked
    if _hooked:
        return
    from torch.distributed.pipelining import schedules

    original = getattr(schedules, "_wait_batch_p2p", None)
    if original is None:
        return

    def timed_wait(work: Any) -> Any:
        with COMM, PP_WAIT:
            return original(work)

    schedules._wait_batch_p2p = timed_wait
    _hooked = True

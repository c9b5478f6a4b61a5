"""train.profile: torch.profiler Chrome/Perfetto traces of a window of steps on the selected ranks.

Each selected rank writes RUN/profile/trace-rank<R>-steps<S>-<E>.json (names: trainctl/rundir/paths.py) covering
exactly steps S..E, with CPU activity (+ CUDA kernels on a GPU); the collectives show as `c10d::allreduce_`,
`gloo:all_reduce`, ... (NCCL: `nccl:all_reduce` and its kernels). On a GPU the rank also records the CUDA
caching allocator's history over the same steps and dumps it as memory-rank<R>-steps<S>-<E>.pickle (open it
at pytorch.org/memory_viz). Each step of the window is labelled `train_step#<global step>`; torch's own
`ProfilerStep#<n>` counts the steps of the attempt. A file appears under its final name only once complete.

A resumed attempt profiles what is left of the window; an attempt that stops inside it (a signal, a failure)
writes the steps it finished. Off (no train.profile, or another rank): nothing is imported or run per step.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile, record_function

from trainctl.rundir.paths import RunPaths
from trainctl.spec.models import RunSpec

MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept for the snapshot (torch's own example uses 100k)


class NoProfiler:
    """This rank profiles nothing."""

    def step(self, step: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


class StepProfiler:
    """torch.profiler driven by global step numbers: the schedule warms up on the step before the window when
    this attempt runs it, records steps first..last, and saves at the end of `last`."""

    def __init__(self, paths: RunPaths, rank: int, device: torch.device, first: int, last: int, next_step: int):
        self.paths, self.rank = paths, rank
        self.first, self.last = first, last
        self.next = next_step  # the global step the profiler's next schedule() call is about
        self.recorded: int | None = None  # the last window step finished
        self.cuda = device.type == "cuda"
        self.closed = False
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=activities, schedule=self._action, on_trace_ready=self._save,
                            record_shapes=True)
        self.prof.start()
        self._memory_history_on()

    def _action(self, _attempt_step: int) -> ProfilerAction:
        g = self.next
        if g == self.first - 1:
            return ProfilerAction.WARMUP  # the profiler's own start-up cost lands outside the window
        if self.first <= g < self.last:
            return ProfilerAction.RECORD
        if g == self.last:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one training step (global, 1-based); after it, the schedule moves on."""
        if self.closed:
            yield
            return
        with record_function(f"train_step#{step}") if self.first <= step <= self.last else contextlib.nullcontext():
            yield
        if self.first <= step <= self.last:
            self.recorded = step
        self.next = step + 1
        self.prof.step()  # after `last`: stops tracing and calls _save
        self._memory_history_on()
        if step >= self.last:
            self.close()

    def _memory_history_on(self) -> None:
        if self.cuda and self.next == self.first:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    def _save(self, prof: profile) -> None:
        if self.recorded is None:  # stopped before a step of the window finished
            return
        _replace_into(self.paths.trace(self.rank, self.first, self.recorded), prof.export_chrome_trace)
        if self.cuda:
            _replace_into(self.paths.memory_snapshot(self.rank, self.first, self.recorded),
                          torch.cuda.memory._dump_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)

    def close(self) -> None:
        """End of the window, or of the attempt inside it: what was recorded is saved."""
        if self.closed:
            return
        self.closed = True
        self.prof.stop()  # inside the window this saves the finished steps (_save)
        if self.cuda:
            torch.cuda.memory._record_memory_history(enabled=None)


def _replace_into(path: Path, write: Callable[[str], object]) -> None:
    """Let `write(name)` make the file under a temporary name, then give it its final one."""
    path.parent.mkdir(exist_ok=True)  # RUN/profile; not its parents: a deleted run directory stays deleted
    tmp = path.with_name(f".{path.name}.tmp")
    write(str(tmp))
    os.replace(tmp, path)


def for_rank(spec: RunSpec, paths: RunPaths, rank: int, device: torch.device,
             resumed_step: int) -> StepProfiler | NoProfiler:
    """This rank's profiler for this attempt (`resumed_step`: the checkpoint it resumed from, 0 when fresh)."""
    p = spec.train.profile
    if p is None or rank not in p.ranks or p.last_step <= resumed_step:
        return NoProfiler()
    return StepProfiler(paths, rank, device, max(p.start_step, resumed_step + 1), p.last_step, resumed_step + 1)

"""Per-rank step times for straggler detection, written by every rank to RUN/logs/steptimes-rank<r>.jsonl.

Why a file per rank and not an all_gather every k steps: no collective means no extra sync point in the
step and nothing to block on when a peer is gone (a hung or dead rank is exactly when the numbers matter);
the lines are buffered and written with one write() every `every` steps, measured at a few microseconds
per step (see `trainctl mfu-report`'s straggler section and tests/dist/test_report_runs.py).

Each attempt starts with a header line {"header": true, "rank", "host", "local_rank", "device", "attempt"},
then one line per step {"step", "time", "step_s", "sync_s", "comm_s", "pp_s"}, and (when the loop ends
normally) a footer {"footer": true, "steps", "overhead_s"} with the time spent logging. `sync_s` is the time
this rank spent in the step's gradient synchronisation and final all-reduce, and (ZeRO) in the all-gather of
the updated weights after the optimizer step, `comm_s` the time inside
tensor-parallel collectives and pipeline receives (trainctl.runtime.parallel.comm_wait), `pp_s` the pipeline
receives' part of it; all include waiting for the slowest peer, so busy = step_s - sync_s - comm_s is the
rank's own work and the straggler is the rank with the largest busy time (its peers' extra time shows up
as waiting). No torch import: the trainer passes the device as text.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from trainctl.hardware.hostname import this_host
from trainctl.rundir.paths import RunPaths, append_text
from trainctl.runtime.train import faults

DEFAULT_EVERY = 10


def steptimes_path(paths: RunPaths, rank: int) -> Path:
    return paths.steptimes(rank)


class StepTimeLog:
    """Buffered per-rank step-time log; `record()` is a list append, `flush()` one write()."""

    def __init__(self, paths: RunPaths, rank: int, local_rank: int, device: str, every: int = DEFAULT_EVERY):
        self.path = steptimes_path(paths, rank)
        self.every = max(1, every)
        self.buf: list[str] = [_line({
            "header": True, "rank": rank, "host": this_host(), "local_rank": local_rank,
            "device": device, "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "pid": os.getpid(), "time": time.time()})]
        self.pending = 0
        self.steps = 0
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(exist_ok=True)  # not its parents: a deleted run directory stays deleted
        self.overhead_s = 0.0  # time spent in record()/flush(): what this costs the step

    def record(self, step: int, step_s: float, sync_s: float, comm_s: float = 0.0, pp_s: float = 0.0) -> None:
        t0 = time.perf_counter()
        # an f-string, not json.dumps: 3 us instead of 25 us on a slow core, and this runs every step
        self.buf.append(f'{{"step":{int(step)},"time":{time.time():.4f},"step_s":{step_s:.6f},'
                        f'"sync_s":{sync_s:.6f},"comm_s":{comm_s:.6f},"pp_s":{pp_s:.6f}}}\n')
        self.pending += 1
        self.steps += 1
        if self.pending >= self.every:
            self.flush()
        self.overhead_s += time.perf_counter() - t0

    def close(self) -> None:
        """Flush, with a footer saying what the logging cost this rank (the report shows it)."""
        self.buf.append(_line({"footer": True, "steps": self.steps, "overhead_s": round(self.overhead_s, 6)}))
        self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        data = "".join(self.buf)
        self.buf, self.pending = [], 0
        with contextlib.suppress(OSError):  # diagnostics must never fail the training step
            append_text(self.path, data)


def _line(rec: dict[str, Any]) -> str:
    return json.dumps(rec, separators=(",", ":")) + "\n"


def _per_rank(name: str, rank: int, env: dict[str, str] | None) -> list[float]:
    """The values a `<rank>:<value>[+<rank>:<value>...]` fault gives `rank`."""
    raw = faults.get(name, env) or ""
    out = []
    for item in filter(None, (x.strip() for x in raw.split("+"))):
        r, _, v = item.partition(":")
        try:
            if int(r) == rank:
                out.append(float(v))
        except ValueError as e:
            raise ValueError(f"fault {name}={raw!r}: expected <rank>:<number>[+<rank>:<number>...]") from e
    return out


def slow_seconds(rank: int, env: dict[str, str] | None = None) -> float:
    """Seconds the `slow_rank` fault asks this rank to sleep every step (0 when not named)."""
    return sum(_per_rank("slow_rank", rank, env))


def slow_factor(rank: int, env: dict[str, str] | None = None) -> float:
    """How many times over the `slow_work` fault has this rank do its step's work (1 when not named)."""
    return max(_per_rank("slow_work", rank, env), default=1.0)


def burn_cpu(seconds: float) -> None:
    """Keep one thread busy until this process has used `seconds` more CPU time."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        sum(range(10_000))


class InjectedStraggler:
    """The test-only stragglers on one rank, inside its step before the gradient sync: `slow_rank` sleeps a
    fixed time; `slow_work` burns (factor - 1) x the CPU time of the step's forward and backward after them.
    Only the second stays a straggler on a loaded host: a sleep's share of the step shrinks as the load
    stretches the work, and a rank slowed by the OS (a CPU quota, stopping it part of the time) is made up for
    by the scheduler."""

    def __init__(self, rank: int, env: dict[str, str] | None = None) -> None:
        self.sleep_s, self.factor = slow_seconds(rank, env), slow_factor(rank, env)
        self._cpu0 = 0.0

    def before_work(self) -> None:
        if self.sleep_s > 0:
            time.sleep(self.sleep_s)
        self._cpu0 = time.process_time()

    def after_work(self) -> None:
        if self.factor > 1:
            burn_cpu((self.factor - 1) * (time.process_time() - self._cpu0))

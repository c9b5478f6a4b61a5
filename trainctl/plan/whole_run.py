"""The whole run's wall clock under failures: compute, checkpoint saves, interruptions and restarts. Pure
arithmetic, no torch.

The run is W seconds of compute cut into segments of T seconds, each ended by a save that blocks training for
C seconds. Failures arrive as a Poisson process with mean time M between them (plan/cadence.py's job MTBF),
in every phase: computing, saving and restarting. A failure loses the work since the last completed save and
costs a restart of R seconds (the scheduler's requeue, start-up, the checkpoint load); a failure during the
restart starts the restart over. For one segment of s = T + C seconds, the expected time to get through it is,
exactly for this process (the form J. T. Daly derives in "A higher order estimate of the optimum checkpoint
interval for restart dumps", FGCS 22(3), 2006):

    E[s] = M * exp(R/M) * (exp(s/M) - 1)

Why: the segment's attempts fail a geometric number of times, exp(s/M) - 1 on average, each losing the time
to the failure and then a restart that itself takes (exp(R/M) - 1) * M on average; the lost times and the
one successful attempt sum to (exp(s/M) - 1) * M. The whole run's
expected wall clock is the sum over its segments plus the last save's write. The spread (P10/P50/P90) is in
closed form too, as a normal approximation: the interruptions are a compound Poisson process whose count has
mean and variance the expected number of failures, each costing R plus a uniformly placed share of the
segment it hits; tests/unit/test_whole_run.py checks both against a seeded event simulation of the process.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

Z90 = 1.2815515655446004  # the standard normal's 90th percentile
EXP_MAX = 700.0  # math.exp overflows a float past ~709.78


def _exp(x: float) -> float:
    """exp, infinite past a float's range: a segment hundreds of MTBFs long is never expected to get through."""
    return math.exp(x) if x < EXP_MAX else math.inf


def _expm1(x: float) -> float:
    return math.expm1(x) if x < EXP_MAX else math.inf


@dataclass(frozen=True)
class WholeRun:
    compute_s: float  # steps x step time: the run without saves or failures
    interval_s: float  # compute between saves
    save_block_s: float  # seconds one save blocks training
    last_write_s: float  # the final save's write after the last step
    restart_s: float  # requeue + start-up + checkpoint load
    mtbf_s: float  # the job's mean time between failures

    @property
    def segments(self) -> tuple[int, float]:
        """(full segments, the compute of the last, shorter one; 0 when the interval divides the run)."""
        full = int(self.compute_s // self.interval_s)
        return full, self.compute_s - full * self.interval_s

    def _segment_s(self, compute_s: float) -> float:
        m = self.mtbf_s
        return m * _exp(self.restart_s / m) * _expm1((compute_s + self.save_block_s) / m)

    def _segment_failures(self, compute_s: float) -> float:
        m = self.mtbf_s
        return _exp(self.restart_s / m) * _expm1((compute_s + self.save_block_s) / m)

    @property
    def saves(self) -> int:
        full, rest = self.segments
        return full + (1 if rest > 0 else 0)

    @property
    def expected_wall_s(self) -> float:
        full, rest = self.segments
        wall = full * self._segment_s(self.interval_s) + (self._segment_s(rest) if rest > 0 else 0.0)
        return wall + self.last_write_s

    @property
    def expected_failures(self) -> float:
        full, rest = self.segments
        return full * self._segment_failures(self.interval_s) + (self._segment_failures(rest) if rest > 0 else 0.0)

    @property
    def ettr(self) -> float:
        """Expected effective training time ratio: compute over expected wall clock."""
        return self.compute_s / self.expected_wall_s

    def wall_percentiles_s(self) -> tuple[float, float, float]:
        """(P10, P50, P90) of the wall clock: normal approximation of a compound Poisson failure process."""
        if not math.isfinite(self.expected_wall_s):
            return math.inf, math.inf, math.inf
        span = self.interval_s + self.save_block_s
        second_moment = self.restart_s ** 2 + self.restart_s * span + span ** 2 / 3.0
        sd = math.sqrt(self.expected_failures * second_moment)
        mean = self.expected_wall_s
        return max(self.compute_s, mean - Z90 * sd), mean, mean + Z90 * sd


def optimal_interval_s(run: WholeRun, *, candidates: int = 200) -> float:
    """The save interval that minimises the expected wall clock of the full model (restart cost included),
    searched on a log grid from one hundredth to ten times the Young/Daly interval's scale sqrt(2CM)."""
    scale = math.sqrt(2.0 * max(run.save_block_s, 1e-9) * run.mtbf_s)
    best_s, best_wall = run.interval_s, math.inf
    for i in range(candidates + 1):
        t = min(run.compute_s, scale * 10 ** (-2.0 + 3.0 * i / candidates))
        wall = replace(run, interval_s=t).expected_wall_s
        if wall < best_wall:
            best_s, best_wall = t, wall
    return best_s


def simulate_wall_s(run: WholeRun, rng: random.Random) -> tuple[float, int]:
    """One seeded draw of the same failure process, event by event: (wall clock seconds, failures)."""

    def poisson() -> Iterator[float]:
        t = 0.0
        while True:
            t += rng.expovariate(1.0 / run.mtbf_s)
            yield t

    return replay_wall_s(run, poisson())


def replay_wall_s(run: WholeRun, failure_times: Iterable[float]) -> tuple[float, int]:
    """The run's wall clock had failures struck at these seconds after its first step (ascending), event by
    event as the model has it: a failure loses the segment's work since its save and costs a restart, which a
    failure may itself cut short: (wall clock seconds, failures)."""
    full, rest = run.segments
    lengths = [run.interval_s + run.save_block_s] * full + ([rest + run.save_block_s] if rest > 0 else [])
    times = iter(failure_times)
    wall, failures, due = 0.0, 0, next(times, math.inf)
    for length in lengths:
        while due < wall + length:
            wall, failures, due = due, failures + 1, next(times, math.inf)
            while due < wall + run.restart_s:  # the restart, itself interruptible
                wall, failures, due = due, failures + 1, next(times, math.inf)
            wall += run.restart_s
        wall += length
    return wall + run.last_write_s, failures


def whole_run_summary(*, run: WholeRun, gpus: int, gpu_hour_price: float | None, board_power_w: float | None,
                      restart_parts: dict[str, float]) -> dict[str, object]:
    """The whole-run figures plan prints, each with its formula. `board_power_w`: the accelerator's datasheet
    maximum (hardware/catalog.py), None where none is published."""
    p10, p50, p90 = run.wall_percentiles_s()
    gpu_hours = run.expected_wall_s * gpus / 3600.0
    day = 86400.0
    return {
        "compute_s": run.compute_s, "saves": run.saves, "save_blocking_s": run.saves * run.save_block_s,
        "last_write_s": run.last_write_s, "interval_s": run.interval_s, "mtbf_s": run.mtbf_s,
        "restart_s": run.restart_s, "restart_parts_s": restart_parts,
        "expected_interruptions": run.expected_failures, "ettr": run.ettr,
        "wall_days": {"p10": p10 / day, "p50": p50 / day, "p90": p90 / day, "mean": run.expected_wall_s / day},
        "gpu_hours": gpu_hours, "cost": gpu_hours * gpu_hour_price if gpu_hour_price is not None else None,
        "energy_mwh": gpu_hours * board_power_w / 1e6 if board_power_w is not None else None,
        "optimal_interval_s": optimal_interval_s(run),
        "formulas": {
            "compute_s": "train.steps x predicted step time",
            "restart_s": "estimate.requeue_s + estimate.startup_s + checkpoint bytes per node / "
                         "estimate.checkpoint_read_gbps",
            "wall": "per save interval T with save blocking C, MTBF M, restart R: M exp(R/M) (exp((T+C)/M) - 1), "
                    "summed over the intervals, plus the last save's write (closed form, Poisson failures)",
            "interruptions": "exp(R/M) (exp((T+C)/M) - 1) per interval",
            "spread": "normal approximation of a compound Poisson failure process (closed form, not simulated)",
            "ettr": "compute_s / expected wall clock", "gpu_hours": "expected wall clock x GPUs",
            "cost": "gpu_hours x cluster.gpu_hour_price",
            "energy_mwh": "gpu_hours x the board's datasheet maximum power: an upper bound for the boards alone "
                          "(no host, network or cooling; a board waiting on a restart draws less)",
            "optimal_interval_s": "the interval minimising the expected wall clock of this model; the restart "
                                  "cost does not move it (a constant factor exp(R/M)), so it is Daly's, refined",
        },
    }

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

A time limit (Slurm's cluster.time) ends every attempt that lasts it: the ranks are warned launcher.grace_s
before it, save and stop, and the job requeues itself. Each such stop adds the stop's save, the restart
(requeue, start-up, checkpoint load) and, when the grace is shorter than a save's write, the work since the
last save. An attempt trains for at most the limit less the grace, the start-up and the load, so a run whose
failure-model wall clock is w stops ceil(w / that) - 1 times (an upper bound: a failure's requeue starts a
fresh limit). These stops are planned, not failures, and priced apart from them.

Planned maintenance (cluster.maintenance_hours_per_week, m) is apart from failures: the cluster is down m of
every 168 hours, so the run's calendar time is the running time x 168 / (168 - m), and its GPU-hours count the
GPUs held through the windows (a reserved cluster). A window's own stop (a save and a restart) is not priced.

Not expected to finish: where the expected wall clock exceeds FINISH_FACTOR times the compute (an ETTR below
1 / FINISH_FACTOR), or no attempt can train before its time limit. Past that the expectation grows as
exp(interval / MTBF) and its figures (10^120 days) mean only "never": they are not printed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from trainctl.units import dur

Z90 = 1.2815515655446004  # the standard normal's 90th percentile
EXP_MAX = 700.0  # math.exp overflows a float past ~709.78
FINISH_FACTOR = 100.0  # an expected wall clock above this many times the compute: not expected to finish


def _exp(x: float) -> float:
    """exp, infinite past a float's range: a segment hundreds of MTBFs long is never expected to get through."""
    return math.exp(x) if x < EXP_MAX else math.inf


def _expm1(x: float) -> float:
    return math.expm1(x) if x < EXP_MAX else math.inf


def segment_wall_s(*, compute_s: float, save_block_s: float, restart_s: float, mtbf_s: float) -> float:
    """The expected wall clock to get through `compute_s` of work and the save that ends it (module docstring)."""
    m = mtbf_s
    return m * _exp(restart_s / m) * _expm1((compute_s + save_block_s) / m)


def lost_fraction(*, interval_s: float, save_block_s: float, restart_s: float, mtbf_s: float) -> float:
    """The share of the wall clock lost to saves, redone work and restarts when saving every `interval_s`:
    1 - T / E[segment]. The one measure of loss the plan's interval rows and its ETTR both print."""
    wall = segment_wall_s(compute_s=interval_s, save_block_s=save_block_s, restart_s=restart_s, mtbf_s=mtbf_s)
    return 1.0 - interval_s / wall if wall > 0 else 0.0


@dataclass(frozen=True)
class TimeLimit:
    """Slurm's cluster.time as the whole run meets it (module docstring)."""

    limit_s: float  # cluster.time
    train_s: float  # training an attempt holds: limit less grace, start-up and checkpoint load
    stop_s: float  # what each stop adds: the stop's save write, the restart and any work lost

    def stops(self, wall_s: float) -> int:
        """Requeues at the limit in a run of `wall_s` (failure model); 0 without one."""
        if not math.isfinite(wall_s) or self.train_s <= 0:
            return 0
        return max(0, math.ceil(wall_s / self.train_s) - 1)


@dataclass(frozen=True)
class WholeRun:
    compute_s: float  # steps x step time: the run without saves or failures
    interval_s: float  # compute between saves
    save_block_s: float  # seconds one save blocks training
    last_write_s: float  # the final save's write after the last step
    restart_s: float  # requeue + start-up + checkpoint load
    mtbf_s: float  # the job's mean time between failures
    time_limit: TimeLimit | None = None  # None: attempts end only by failing (no Slurm time limit)
    maintenance_share: float = 0.0  # of the calendar, the cluster down for planned maintenance

    def _calendar(self, running_s: float) -> float:
        """Running time stretched by the planned maintenance windows between it."""
        return running_s / (1.0 - self.maintenance_share)

    @property
    def segments(self) -> tuple[int, float]:
        """(full segments, the compute of the last, shorter one; 0 when the interval divides the run)."""
        full = int(self.compute_s // self.interval_s)
        return full, self.compute_s - full * self.interval_s

    def _segment_s(self, compute_s: float) -> float:
        return segment_wall_s(compute_s=compute_s, save_block_s=self.save_block_s, restart_s=self.restart_s,
                              mtbf_s=self.mtbf_s)

    def _segment_failures(self, compute_s: float) -> float:
        m = self.mtbf_s
        return _exp(self.restart_s / m) * _expm1((compute_s + self.save_block_s) / m)

    @property
    def saves(self) -> int:
        full, rest = self.segments
        return full + (1 if rest > 0 else 0)

    @property
    def failure_wall_s(self) -> float:
        """The expected wall clock of the failure model alone (no time-limit stops)."""
        full, rest = self.segments
        wall = full * self._segment_s(self.interval_s) + (self._segment_s(rest) if rest > 0 else 0.0)
        return wall + self.last_write_s

    def _with_limits(self, wall_s: float) -> float:
        """The running time with the time-limit stops a run of `wall_s` makes, and the maintenance around it."""
        running = wall_s + (self.time_limit.stops(wall_s) * self.time_limit.stop_s if self.time_limit else 0.0)
        return self._calendar(running)

    @property
    def expected_wall_s(self) -> float:
        return self._with_limits(self.failure_wall_s)

    @property
    def maintenance_s(self) -> float:
        """Expected calendar seconds of planned maintenance during the run."""
        wall = self.expected_wall_s
        return wall * self.maintenance_share if math.isfinite(wall) else math.inf

    @property
    def limit_stops(self) -> int:
        """Expected requeues at the time limit."""
        return self.time_limit.stops(self.failure_wall_s) if self.time_limit else 0

    @property
    def finishes(self) -> bool:
        """Whether the run is expected to finish (module docstring: FINISH_FACTOR, a limit leaving no training)."""
        if self.time_limit is not None and self.time_limit.train_s <= 0:
            return False
        return self.expected_wall_s <= FINISH_FACTOR * self.compute_s

    @property
    def expected_failures(self) -> float:
        full, rest = self.segments
        return full * self._segment_failures(self.interval_s) + (self._segment_failures(rest) if rest > 0 else 0.0)

    @property
    def ettr(self) -> float:
        """Expected effective training time ratio: compute over expected wall clock."""
        return self.compute_s / self.expected_wall_s

    def wall_percentiles_s(self) -> tuple[float, float, float]:
        """(P10, P50, P90) of the wall clock: normal approximation of a compound Poisson failure process, each
        with the time-limit stops a run of that length makes."""
        mean = self.failure_wall_s
        if not math.isfinite(mean):
            return math.inf, math.inf, math.inf
        span = self.interval_s + self.save_block_s
        second_moment = self.restart_s ** 2 + self.restart_s * span + span ** 2 / 3.0
        sd = math.sqrt(self.expected_failures * second_moment)
        p10, p50, p90 = max(self.compute_s, mean - Z90 * sd), mean, mean + Z90 * sd
        return self._with_limits(p10), self._with_limits(p50), self._with_limits(p90)


def optimal_interval_s(run: WholeRun, *, candidates: int = 200) -> float:
    """The save interval that minimises the expected wall clock of the full model (restart cost included),
    searched on a log grid from one hundredth to ten times the Young/Daly interval's scale sqrt(2CM)."""
    scale = math.sqrt(2.0 * max(run.save_block_s, 1e-9) * run.mtbf_s)
    best_s, best_wall = run.interval_s, math.inf
    for i in range(candidates + 1):
        t = min(run.compute_s, scale * 10 ** (-2.0 + 3.0 * i / candidates))
        wall = replace(run, interval_s=t).failure_wall_s
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


def why_not_finishing(run: WholeRun, *, saves_scheduled: bool) -> str:
    """Why `run` is not expected to finish, and the fix, in one line."""
    limit = run.time_limit
    if limit is not None and limit.train_s <= 0:
        return (f"cluster.time ({dur(limit.limit_s)}) leaves an attempt no time to train after launcher.grace_s "
                f"and the restart's start-up and checkpoint load: raise cluster.time")
    work = (f"{dur(run.interval_s)} of work between saves" if saves_scheduled
            else f"no saves scheduled (a failure redoes all {dur(run.compute_s)})")
    facts = (f"its expected wall clock is over {FINISH_FACTOR:.0f}x its {dur(run.compute_s)} of compute: {work} "
             f"and a {dur(run.restart_s)} restart against an MTBF of {dur(run.mtbf_s)}")
    best = replace(run, interval_s=optimal_interval_s(run))
    if run.restart_s >= run.mtbf_s or not best.finishes:
        return (f"{facts}; no save interval makes it finish: raise checkpoint.mtbf_hours, or shorten the restart "
                "(estimate.requeue_s, startup_s) or the save")
    fix = "schedule checkpoints" if not saves_scheduled else "save more often"
    return f"{facts}: {fix}, every {dur(best.interval_s)} (checkpoint.every_steps or every_minutes)"


def whole_run_summary(*, run: WholeRun, gpus: float, gpu_hour_price: float | None, board_power_w: float | None,
                      restart_parts: dict[str, float], saves_scheduled: bool,
                      mtbf_source: str = "") -> dict[str, object]:
    """The whole-run figures plan prints, each with its formula; those of a run not expected to finish are None
    (null in JSON), and `not_finishing` says why. `board_power_w`: the accelerator's datasheet maximum
    (hardware/catalog.py), None where none is published."""
    finishes = run.finishes
    p10, p50, p90 = run.wall_percentiles_s() if finishes else (None, None, None)
    wall = run.expected_wall_s if finishes else None
    gpu_hours = wall * gpus / 3600.0 if wall is not None else None
    day = 86400.0
    limit = run.time_limit
    return {
        "compute_s": run.compute_s, "saves": run.saves, "save_blocking_s": run.saves * run.save_block_s,
        "last_write_s": run.last_write_s, "interval_s": run.interval_s, "mtbf_s": run.mtbf_s,
        "mtbf_source": mtbf_source, "restart_s": run.restart_s, "restart_parts_s": restart_parts,
        "maintenance": {"hours_per_week": run.maintenance_share * 168.0,
                        "total_s": run.maintenance_s if finishes else None},
        "finishes": finishes,
        "not_finishing": None if finishes else why_not_finishing(run, saves_scheduled=saves_scheduled),
        "expected_interruptions": run.expected_failures if finishes else None,
        "time_limit": None if limit is None else {
            "limit_s": limit.limit_s, "train_per_attempt_s": limit.train_s, "cost_each_s": limit.stop_s,
            "stops": run.limit_stops if finishes else None,
            "total_s": run.limit_stops * limit.stop_s if finishes else None},
        "ettr": run.ettr if finishes else None,
        "wall_days": {k: v / day if v is not None else None
                      for k, v in (("p10", p10), ("p50", p50), ("p90", p90), ("mean", wall))},
        "gpu_hours": gpu_hours,
        "cost": gpu_hours * gpu_hour_price if gpu_hour_price is not None and gpu_hours is not None else None,
        "energy_mwh": gpu_hours * board_power_w / 1e6 if board_power_w is not None and gpu_hours is not None else None,
        "optimal_interval_s": optimal_interval_s(run),
        "formulas": {
            "null": "a run not expected to finish (finishes false; not_finishing says why) has no wall clock, "
                    f"interruptions, ETTR, GPU-hours, cost or energy: its expected wall clock is over "
                    f"{FINISH_FACTOR:.0f}x its compute, or its time limit leaves no training",
            "compute_s": "train.steps x predicted step time",
            "restart_s": "estimate.requeue_s + estimate.startup_s + checkpoint bytes per node / "
                         "estimate.checkpoint_read_gbps",
            "wall": "per save interval T with save blocking C, MTBF M, restart R: M exp(R/M) (exp((T+C)/M) - 1), "
                    "summed over the intervals, plus the last save's write (closed form, Poisson failures), plus "
                    "the time-limit stops, x 168 / (168 - cluster.maintenance_hours_per_week)",
            "interruptions": "failures only: exp(R/M) (exp((T+C)/M) - 1) per interval",
            "time_limit": "stops = ceil(failure-model wall clock / train_per_attempt_s) - 1, train_per_attempt_s = "
                          "cluster.time - launcher.grace_s - start-up - checkpoint load; each costs the stop's save "
                          "write + requeue + start-up + checkpoint load (+ half an interval of work when the grace "
                          "is shorter than a save's write)",
            "spread": "normal approximation of a compound Poisson failure process (closed form, not simulated)",
            "maintenance": "the cluster down maintenance_hours_per_week of every 168 hours: the running time x "
                           "168 / (168 - hours); a window's own save and restart are not priced",
            "ettr": "compute_s / expected wall clock", "gpu_hours": "expected wall clock x GPUs (held through "
                                                                    "maintenance)",
            "cost": "gpu_hours x cluster.gpu_hour_price",
            "energy_mwh": "gpu_hours x the board's datasheet maximum power: an upper bound for the boards alone "
                          "(no host, network or cooling; a board waiting on a restart draws less)",
            "optimal_interval_s": "the interval minimising the expected wall clock of this model; the restart "
                                  "cost does not move it (a constant factor exp(R/M)), so it is Daly's, refined",
        },
    }

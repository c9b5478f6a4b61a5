"""How often to checkpoint: the Young/Daly interval against the configured one. Pure arithmetic, no torch.

A save blocks training for C seconds; failures arrive at random with mean time M between them (the job's
MTBF); after a failure the work since the last save is redone. Saving every T seconds then loses, as a
fraction of the wall clock, about C/T (saving) + T/(2M) (the half interval redone on average), which is
smallest at Young's T = sqrt(2*C*M) (J. W. Young, "A first order approximation to the optimum checkpoint
interval", CACM 17(9), 1974). Daly's higher-order estimate (J. T. Daly, "A higher order estimate of the
optimum checkpoint interval for restart dumps", FGCS 22(3), 2006, eq. 37) corrects it for C not << M:
T = sqrt(2CM) * (1 + sqrt(C/2M)/3 + (C/2M)/9) - C for C < 2M, else T = M. The interval we advise is Daly's;
the loss we print, at the configured interval and at Daly's, is the whole-run model's (plan/whole_run.py
`lost_fraction`: the share of the wall clock lost to saves, redone work and restarts, 1 - ETTR for a run of
whole intervals), not the first-order sum above, which passes 100% where failures are frequent.

The job's MTBF is `checkpoint.mtbf_hours` when the spec gives it, else a published fleet's per-GPU MTBF
divided by the job's GPUs (plan/failure_rates.py: Llama 3's H100 fleet, OPT-175B's A100 fleet).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainctl.plan.failure_rates import fleet_for
from trainctl.plan.whole_run import FINISH_FACTOR, lost_fraction
from trainctl.units import count, dur

WASTE_WARN = 0.05  # a configured interval losing this much more of the wall clock than Daly's is warned about


def job_mtbf(*, gpus: float, gpu: str, mtbf_hours: float | None, fleet: str | None) -> tuple[float, str]:
    """(the job's MTBF in seconds, where it comes from): checkpoint.mtbf_hours, else the fleet's per-GPU rate."""
    if mtbf_hours is not None:
        return mtbf_hours * 3600.0, f"checkpoint.mtbf_hours {mtbf_hours:g} h"
    chosen = fleet_for(gpu, fleet)
    return chosen.job_mtbf_hours(gpus) * 3600.0, chosen.describe(gpus)


def young_interval(cost_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - cost_s


def expected_loss(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Fraction of the wall clock lost to saving, redoing work after failures and restarting (whole-run model)."""
    return lost_fraction(interval_s=interval_s, save_block_s=cost_s, restart_s=restart_s, mtbf_s=mtbf_s)


def lost_text(loss: float) -> str:
    """An interval's expected loss in words, or the whole run's verdict where it is past finishing (the same
    threshold as plan/whole_run.py's: an ETTR under 1 / FINISH_FACTOR)."""
    if loss > 1.0 - 1.0 / FINISH_FACTOR:
        return f"over {1.0 - 1.0 / FINISH_FACTOR:.0%} expected lost: not expected to finish"
    return f"{100 * loss:.2f}% expected lost"


def configured_interval(every_steps: int | None, every_minutes: float | None,
                        step_time_s: float | None) -> float | None:
    """Seconds between saves as the spec asks for them (the sooner of the two triggers); None if unknown."""
    options = [every_minutes * 60.0] if every_minutes else []
    if every_steps and step_time_s:
        options.append(every_steps * step_time_s)
    return min(options) if options else None


@dataclass(frozen=True)
class Cadence:
    cost_s: float  # seconds one save blocks training
    mtbf_s: float
    mtbf_source: str
    configured_s: float | None
    step_time_s: float | None
    run_s: float | None = None  # the whole run's predicted or measured length, when known
    restart_s: float = 0.0  # what a failure costs besides the redone work (requeue, start-up, load)

    @property
    def optimal_s(self) -> float:
        return daly_interval(self.cost_s, self.mtbf_s)

    @property
    def loss_optimal(self) -> float:
        return expected_loss(self.optimal_s, self.cost_s, self.mtbf_s, self.restart_s)

    @property
    def loss_configured(self) -> float | None:
        if not self.configured_s:
            return None
        return expected_loss(self.configured_s, self.cost_s, self.mtbf_s, self.restart_s)

    @property
    def optimal_steps(self) -> int | None:
        return max(1, round(self.optimal_s / self.step_time_s)) if self.step_time_s else None

    def warning(self) -> str | None:
        """A line when the configured interval loses more than WASTE_WARN of the wall clock beyond Daly's."""
        loss = self.loss_configured
        if self.cost_s <= 0:
            return None
        advice = f"every {dur(self.optimal_s)}" + (f" (~{count(self.optimal_steps, 'step')})"
                                                   if self.optimal_steps else "")
        if loss is None:
            if self.run_s is None or self.run_s <= self.optimal_s:
                return None  # a run shorter than the interval loses little without saves
            return (f"no checkpoints scheduled: a failure loses all the work since the start; with saves "
                    f"blocking {dur(self.cost_s)} and an MTBF of {dur(self.mtbf_s)}, save {advice} "
                    "(checkpoint.every_steps or every_minutes)")
        if loss - self.loss_optimal <= WASTE_WARN:
            return None
        assert self.configured_s is not None
        which = "frequent" if self.configured_s < self.optimal_s else "far apart"
        return (f"checkpoints every {dur(self.configured_s)} are too {which}: expected {loss:.0%} of the wall "
                f"clock lost to saves and redone work, against {self.loss_optimal:.1%} at the Young/Daly "
                f"interval; save {advice}")

    def as_dict(self) -> dict[str, float | str | int | None]:
        return {"cost_s": self.cost_s, "mtbf_s": self.mtbf_s, "mtbf_source": self.mtbf_source,
                "configured_s": self.configured_s, "optimal_s": self.optimal_s, "optimal_steps": self.optimal_steps,
                "young_s": young_interval(self.cost_s, self.mtbf_s), "loss_configured": self.loss_configured,
                "loss_optimal": self.loss_optimal, "restart_s": self.restart_s, "warning": self.warning()}

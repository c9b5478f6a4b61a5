"""On track or not: the rest of a run projected from what it measured so far, and the gap to the plan's
whole-run projection (plan/whole_run.py) with its largest cause. No torch; `status` and `mfu-report` both
show this one projection.

Measured so far (report/goodput.py, report/summary.py): the median steady step time, the checkpoint stalls per
step, the failures (restarts after an attempt that did not end as asked; a user's stop and idle wait are not
failures) per compute hour and what each cost (its restart gap and the steps it replayed). The remaining steps
are priced at those rates:

    remaining = steps left x (step + save stall per step) + failures per compute second x compute left
                x cost per failure

The projected total is the wall clock the run was meant to be running so far (goodput's wall less the user's
idle waits) plus the remaining. The plan's side, for the same total of steps, is its per-step step time and
save blocking, its failure rate (expected interruptions per compute second) and its cost per failure (the
expected wall clock less compute, saves and the last write, per interruption). The gap splits into slower steps,
slower saves, more restarts (priced at the plan's cost per failure) and longer restarts (the projected
failures at the measured cost less the plan's); what is left is "other" (start-up, queueing, shutdown, warm-up
steps), a cause like the others.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

from trainctl.checkpoint.location import committed_step
from trainctl.report.attempts import final_and_replayed, split_attempts
from trainctl.report.goodput import goodput
from trainctl.report.load import RunData
from trainctl.report.summary import summarize
from trainctl.rundir.runstate import attempt_begin, live_outcome, since, stop_requested
from trainctl.units import count, dur, si

# "other": what the plan's whole run does not price (its first start-up, queueing, shutdown, warm-up steps); in
# a short run it can outweigh every priced term, and naming a priced one then would blame the wrong thing
CAUSES = {"steps": "slower steps", "saves": "slower saves", "restarts": "more restarts",
          "restart_length": "longer restarts", "other": "start-up, queueing and shutdown"}


@dataclass(frozen=True)
class Measured:
    steps_done: int
    steps_total: int
    step_s: float  # median steady step time
    elapsed_s: float  # wall clock the run was meant to be running so far (no idle waits for the user)
    productive_s: float  # compute so far: each kept step's time once
    save_stall_s: float  # checkpoint stalls so far, all attempts
    failures: int  # restarts after a failure (not after a stop or finish the user asked for)
    failure_cost_s: float  # their restart gaps plus the steps they replayed
    gpus: int

    @property
    def steps_left(self) -> int:
        return max(0, self.steps_total - self.steps_done)

    @property
    def save_per_step_s(self) -> float:
        return self.save_stall_s / self.steps_done if self.steps_done else 0.0

    @property
    def failures_per_compute_s(self) -> float:
        return self.failures / self.productive_s if self.productive_s > 0 else 0.0

    @property
    def cost_per_failure_s(self) -> float | None:
        return self.failure_cost_s / self.failures if self.failures else None

    @property
    def remaining_s(self) -> float:
        compute_left = self.steps_left * self.step_s
        per_fail = self.cost_per_failure_s or 0.0
        return (compute_left + self.steps_left * self.save_per_step_s
                + self.failures_per_compute_s * compute_left * per_fail)

    @property
    def projected_failures(self) -> float:
        return self.failures + self.failures_per_compute_s * self.steps_left * self.step_s

    @property
    def total_s(self) -> float:
        return self.elapsed_s + self.remaining_s


@dataclass(frozen=True)
class Planned:
    """The plan's whole run, per step (so that it prices any total of steps)."""

    step_s: float
    save_per_step_s: float
    failures_per_compute_s: float
    cost_per_failure_s: float
    last_write_s: float
    time_limits_per_step_s: float = 0.0  # the planned requeues at cluster.time, spread over the steps

    @classmethod
    def from_whole_run(cls, w: dict[str, Any]) -> Planned:
        """The plan's side; the caller has checked that the plan expects the run to finish (w["finishes"])."""
        steps, compute = float(w["steps"]), float(w["compute_s"])
        failures = float(w["expected_interruptions"])
        limits = float(((w.get("time_limit") or {}).get("total_s")) or 0.0)
        lost = w["wall_days"]["mean"] * 86400.0 - compute - w["save_blocking_s"] - w["last_write_s"] - limits
        return cls(step_s=compute / steps, save_per_step_s=w["save_blocking_s"] / steps,
                   failures_per_compute_s=failures / compute if compute else 0.0,
                   cost_per_failure_s=max(0.0, lost / failures) if failures > 0 else float(w["restart_s"]),
                   last_write_s=float(w["last_write_s"]), time_limits_per_step_s=limits / steps)

    def total_s(self, steps: int) -> float:
        compute = steps * self.step_s
        return (compute + steps * (self.save_per_step_s + self.time_limits_per_step_s)
                + self.failures_per_compute_s * compute * self.cost_per_failure_s + self.last_write_s)


def expects_finish(w: dict[str, Any]) -> bool:
    """Whether the plan's whole run has a finite expected total (plan/whole_run.py `finishes`; a plan written
    before that key has an infinite or missing mean instead)."""
    mean = (w.get("wall_days") or {}).get("mean")
    return w.get("finishes", True) is not False and isinstance(mean, (int, float)) and math.isfinite(mean)


def gap(m: Measured, p: Planned) -> dict[str, Any]:
    """Projected total less the plan's, split into its causes (seconds; + = later than planned)."""
    n = m.steps_total
    fails = m.projected_failures
    parts = {"steps": n * (m.step_s - p.step_s), "saves": n * (m.save_per_step_s - p.save_per_step_s),
             "restarts": (fails - p.failures_per_compute_s * n * p.step_s) * p.cost_per_failure_s,
             "restart_length": fails * ((m.cost_per_failure_s or p.cost_per_failure_s) - p.cost_per_failure_s)}
    planned = p.total_s(n)
    total = m.total_s - planned
    parts["other"] = total - sum(parts.values())
    sign = 1.0 if total >= 0 else -1.0
    largest = max(CAUSES, key=lambda k: sign * parts[k])
    return {"planned_total_s": planned, "gap_s": total, "causes_s": parts, "largest_cause": largest,
            "largest": CAUSES[largest], "planned": {
                "step_s": p.step_s, "save_per_step_s": p.save_per_step_s,
                "failures_per_compute_hour": p.failures_per_compute_s * 3600.0,
                "cost_per_failure_s": p.cost_per_failure_s}}


NO_WHOLE_RUN = "the plan has no whole-run projection (no predicted step time: a CPU plan without a calibration profile)"


def project(m: Measured, *, plan_whole_run: dict[str, Any] | None, finished: bool, last_time: float | None,
            tokens_per_step: int | None, tokens_given: bool, basis: str, running: bool = True,
            no_plan_note: str = NO_WHOLE_RUN, lost: int = 0) -> dict[str, Any]:
    """The projection `status --json` and `mfu-report --json` carry under "projection"; `no_plan_note` says why
    there is no gap to the plan when `plan_whole_run` is None. `running`: the latest attempt trains (it has not
    ended, and no stop was asked of it); an ETA is only given then (a stopped run's last step plus what is left
    is a time that will not come). `lost`: steps run past the newest checkpoint of a run that ended without
    saving them (m.steps_done counts the committed ones)."""
    total = m.total_s
    out: dict[str, Any] = {
        "available": True, "basis": basis, "finished": finished,
        "steps": {"done": m.steps_done, "total": m.steps_total, "lost": lost},
        "tokens": ({"done": m.steps_done * tokens_per_step, "total": m.steps_total * tokens_per_step,
                    "given": tokens_given} if tokens_per_step else None),
        "measured": {"step_s": m.step_s, "save_per_step_s": m.save_per_step_s, "failures": m.failures,
                     "failures_per_compute_hour": m.failures_per_compute_s * 3600.0,
                     "cost_per_failure_s": m.cost_per_failure_s, "elapsed_s": m.elapsed_s},
        # "measured" once every step is done; "projected" while steps are left
        "total_is": "measured" if finished or not m.steps_left else "projected",
        "remaining_s": m.remaining_s, "running": running,
        # from now at the latest: a job that waited (a resumed one in Slurm's queue) is not done in the past
        "eta_time": (max(last_time, time.time()) + m.remaining_s) if last_time is not None and running else None,
        "total_s": total, "total_days": total / 86400.0, "gpu_hours": total * m.gpus / 3600.0,
        "failures_total": m.projected_failures,
        "vs_plan": None, "vs_plan_note": None,
    }
    if plan_whole_run is None:
        out["vs_plan_note"] = no_plan_note
    elif not expects_finish(plan_whole_run):  # no planned total to be behind or ahead of
        why = plan_whole_run.get("not_finishing") or "its expected wall clock is infinite"
        out["vs_plan_note"] = f"the plan expects the run not to finish: {why}"
    else:
        out["vs_plan"] = gap(m, Planned.from_whole_run(plan_whole_run))
    return out


def run_projection(run: RunData, summary: dict[str, Any], gp: dict[str, Any], *,
                   training: bool | None = None) -> dict[str, Any]:
    """The projection of one run from its report's summary (report/summary.py) and goodput (report/goodput.py).
    `training`: whether the run trains now, where the caller knows it from the backend (`status`: not while
    Slurm queues it); else from the events: the latest attempt has not ended and no stop was asked of it."""
    spec_train = (run.spec or {}).get("train") or {}
    total = summary.get("steps_target") or spec_train.get("steps")
    step = summary["step_time_s"]["median"]
    if not gp.get("available") or not total or not step:
        return {"available": False, "note": "nothing to project from: no step measured yet"}
    fails = [r for r in gp["restarts"] if r.get("failure")]
    m = Measured(steps_done=summary["steps_completed"], steps_total=int(total), step_s=float(step),
                 elapsed_s=gp["wall_s"] - gp["idle_s"], productive_s=gp["productive_s"],
                 save_stall_s=gp["lost_s"].get("checkpoint_stalls") or 0.0, failures=len(fails),
                 failure_cost_s=sum((r["gap_s"] or 0.0) + r.get("replayed_s", 0.0) for r in fails),
                 gpus=int(summary.get("world_size") or 1))
    times = [float(r["time"]) for r in run.metrics if "time" in r]
    latest = since(run.events, attempt_begin(run.events))
    if live_outcome(latest) is not None or stop_requested(latest) is not None:  # ended, or stopping
        training = False
    lost = 0
    if training is False and gp["final_outcome"] != "finished":
        # steps run past the newest checkpoint of a run that ended without saving them: a resume runs them again
        lost = max(0, m.steps_done - committed_step(run.root))
        m = replace(m, steps_done=m.steps_done - lost)
    attempts = gp["attempts"]
    whole_run = ((run.plan or {}).get("checkpoint") or {}).get("whole_run")
    other_hardware = summary["plan"].get("reason") == "other_hardware"  # a GPU plan, trained on the CPU
    return project(m, plan_whole_run=None if other_hardware else whole_run,
                   no_plan_note=summary["plan"]["note"] if other_hardware else NO_WHOLE_RUN,
                   finished=gp["final_outcome"] == "finished" and m.steps_left == 0,
                   last_time=max(times, default=None), running=training is not False,
                   tokens_per_step=summary.get("tokens_per_step"),
                   tokens_given=spec_train.get("tokens") is not None,
                   basis=f"measured over attempt{'s 0-' if attempts > 1 else ' '}{attempts - 1}", lost=lost)


def projection_of(run: RunData, *, training: bool | None = None) -> dict[str, Any]:
    """The projection of a run directory's records (what `trainctl status` shows); `training` as run_projection."""
    attempts = split_attempts(run)
    final, replayed = final_and_replayed(attempts)
    return run_projection(run, summarize(run, final, attempts), goodput(run, attempts, final, replayed),
                          training=training)


def _when(p: dict[str, Any]) -> str:
    """When the rest will be done: an ETA while the run trains, what is left while it does not."""
    if p["total_is"] == "measured":
        return ""
    if not p["running"]:
        return f"; no ETA while it does not train: {dur(p['remaining_s'])} of it left to run once resumed"
    if p["eta_time"] is None:
        return ""
    return f", ETA {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(p['eta_time']))} (in {dur(p['remaining_s'])})"


def lines(p: dict[str, Any]) -> list[str]:
    """The projection in words, the same lines in `status` and `mfu-report`."""
    if not p.get("available"):
        return [f"projection: {p['note']}"]
    m, word = p["measured"], p["total_is"]
    tok = p["tokens"]
    done = (f"tokens {si(tok['done'])}/{si(tok['total'])}" if tok and tok["given"]
            else f"steps {p['steps']['done']}/{p['steps']['total']}")
    if p["steps"].get("lost"):
        done += f" committed, {p['steps']['lost']} more to run again"
    fails = (f"{count(m['failures'], 'failure')}, {dur(m['cost_per_failure_s'])} lost each" if m["failures"]
             else "no failures so far, none projected")
    out = [f"{done} ({p['basis']}: step {dur(m['step_s'])}, saves {dur(m['save_per_step_s'])}/step, {fails})"]
    out.append(f"{word} total {dur(p['total_s'])} ({p['total_days']:.3g} days, {p['gpu_hours']:.3g} GPU-hours)"
               + _when(p))
    g = p["vs_plan"]
    if g is None:
        out.append(f"vs plan: {p['vs_plan_note']}")
        return out
    c, pl = g["causes_s"], g["planned"]
    why = {"steps": f"step {dur(m['step_s'])} vs planned {dur(pl['step_s'])}",
           "saves": f"saves {dur(m['save_per_step_s'])}/step vs planned {dur(pl['save_per_step_s'])}/step",
           "restarts": f"{p['failures_total']:.3g} failures {word} vs planned "
                       f"{pl['failures_per_compute_hour'] * p['steps']['total'] * pl['step_s'] / 3600:.3g}",
           "restart_length": f"{dur(m['cost_per_failure_s'])} lost per failure vs planned "
                             f"{dur(pl['cost_per_failure_s'])}",
           "other": "time the plan's whole run does not price"}[g["largest_cause"]]
    late = "behind" if g["gap_s"] >= 0 else "ahead of"
    out.append(f"{word} {dur(abs(g['gap_s']))} {late} the plan's {dur(g['planned_total_s'])}; largest cause: "
               f"{g['largest']} ({'+' if c[g['largest_cause']] >= 0 else '-'}{dur(abs(c[g['largest_cause']]))}: "
               f"{why})")
    return out

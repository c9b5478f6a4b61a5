"""`trainctl calibrate --from-run RUN`: a calibration profile refitted from a finished run's own step times.

Every rank records each step's time, its gradient-sync time and its wait inside TP collectives and pipeline
receives (RUN/logs/steptimes-rank<r>.jsonl, trainctl/runtime/observe/stragglers.py). busy = step - sync - wait is
the rank's own work; the planner's hardware FLOPs of that rank per step (its pipeline rank's layers and
ends, divided by tp, for its DP replica's share of the tokens) against busy gives the FLOP/s the planner
should charge, with every overhead the trainer really has (autograd, optimizer, Python) in it. Fitted as
busy = FLOPs / rate over every rank and step but the first of each attempt (warm-up).

The waits cannot be split into link bandwidth and waiting for peers from these figures. With a base profile
(its measured links, and its per-TP compute table re-levelled to the run's rate) one more number is fitted:
the extra latency per collective call (on every link and collective, on top of the base's idle latency)
that makes the planner's step for the run's own layout its measured median step. Without a base the
profile has the compute rate only and the planner prices links by the catalog.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from statistics import median
from typing import Any

from trainctl.errors import UsageError
from trainctl.plan.calibration import profile as prof
from trainctl.plan.calibration.fit import fit_rate
from trainctl.plan.placement import coords
from trainctl.report.load import load_run
from trainctl.rundir.paths import RunPaths
from trainctl.spec import RunSpec, load_spec


def refit(root: Path, base: prof.Profile | None = None) -> dict[str, Any]:
    """The profile of run directory `root` (a UsageError when it has no step times to fit)."""
    from trainctl.launch.calibrate import calibration_spec
    from trainctl.plan.plan import build_plan

    run = load_run(root)
    spec = calibration_spec(load_spec(RunPaths(root).spec))  # priced without any profile it was planned with
    plan = build_plan(spec)
    layout, est = plan.layout, plan.est
    tokens = est.extra["tokens_per_step"] / layout.dp  # one DP replica's tokens per step
    rows = []
    for rank, steps in sorted(run.steptimes.items()):
        flops = est.rank_flops_per_token[coords(rank, layout)[2]] * tokens
        seen: set[int] = set()
        for r in steps.rows:
            if r["attempt"] not in seen:  # the first step of each attempt: warm-up
                seen.add(r["attempt"])
                continue
            busy = float(r["step_s"]) - float(r.get("sync_s") or 0.0) - float(r.get("comm_s") or 0.0)
            rows.append({"rank": rank, "step": r["step"], "step_s": r["step_s"], "sync_s": r.get("sync_s"),
                         "comm_s": r.get("comm_s"), "busy_s": busy, "flops": flops})
    points = [(r["flops"], r["busy_s"]) for r in rows if r["busy_s"] > 0]
    if not points:
        raise UsageError(f"{root}: no step times to fit (each rank needs two steps or more in "
                         f"{RunPaths(root).logs.name}/steptimes-rank<N>.jsonl)",
                         hint="refit from a run that finished a few steps")
    rate, err = fit_rate(points)
    tp = layout.tp
    compute = ({str(t): r * rate / base.compute_rate(tp) for t, r in base.compute.items()} if base
               else {str(tp): rate})
    last = run.metrics[-1] if run.metrics else {}
    header = next((h for s in run.steptimes.values() for h in s.headers), {})
    out = {
        "kind": prof.KIND, "schema": prof.SCHEMA, "source": "run", "run": str(Path(root).resolve()),
        **prof.spec_meta(spec), "precision": prof.run_precision(spec),
        "peak_flops_per_rank": last["peak_tflops_per_gpu"] * 1e12 if last.get("peak_tflops_per_gpu") else None,
        "peak_source": last.get("peak_source"),
        "device": {"type": str(header.get("device", "?")).split(":")[0], "name": spec.cluster.gpu},
        "base_profile": str(base.path) if base else None,
        "raw": {"steps": rows},
        "fits": {"run": {"flops_per_s": rate, "rms_rel_error": err, "points": len(points), "tp": tp},
                 "compute": compute, "links": {}},
    }
    if base is not None:
        measured = median([float(r["step_time_s"]) for r in run.metrics[1:] or run.metrics])
        excess = _latency_for(spec, out, base, measured)
        out["fits"]["run"].update(step_time_s=measured, load_excess_s=excess)
        out["fits"]["links"] = _with_excess(base, excess)
    return out


def _with_excess(base: prof.Profile, excess: float) -> dict[str, Any]:
    """The base's link fits with `excess` seconds per call on top of their idle latency."""
    links = copy.deepcopy(base.data["fits"].get("links", {}))
    for ops in links.values():
        for fit in ops.values():
            idle = fit.get("idle_latency_s", fit["latency_s"])
            fit.update(idle_latency_s=idle, load_excess_s=excess, latency_s=idle + excess)
    return links


def _latency_for(spec: RunSpec, data: dict[str, Any], base: prof.Profile, step_s: float) -> float:
    """The per-call latency excess (>= 0) with which the plan of the run's layout takes `step_s` (bisection:
    the step grows with it)."""
    from trainctl.plan.estimate import Evaluator, assumed_rates
    from trainctl.plan.plan import candidate_from_spec, context_from_spec
    from trainctl.plan.rates import MeasuredRates

    ctx, cand = context_from_spec(spec), candidate_from_spec(spec)

    def step(excess: float) -> float:
        profile = prof.parse(Path("<refit>"), {**data, "fits": {**data["fits"], "links": _with_excess(base, excess)}})
        rates = MeasuredRates(profile, assumed_rates(ctx.hw, ctx.assume), [])
        return Evaluator(replace(ctx, rates=rates)).evaluate(cand).step_time or 0.0

    lo, hi = 0.0, max(step_s, 1e-3)
    if step(lo) >= step_s:
        return 0.0
    while step(hi) < step_s:  # a run with (almost) no collectives: give up beyond 1000x the step
        hi *= 10
        if hi > 1000 * step_s:
            return 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < step_s else (lo, mid)
    return (lo + hi) / 2

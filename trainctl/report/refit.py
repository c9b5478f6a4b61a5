"""`trainctl calibrate --from-run RUN`: a calibration profile refitted from a finished run's own step times.

Every rank records each step's time, its gradient-sync time and its wait inside TP collectives and pipeline
receives (RUN/logs/steptimes-rank<r>.jsonl, trainctl/runtime/observe/stragglers.py). busy = step - sync - wait is
the rank's own work; the planner's hardware FLOPs of that rank per step (its pipeline rank's layers and
ends, divided by tp, for its DP replica's share of the tokens) against busy gives the FLOP/s the planner
should charge, with every overhead the trainer really has (autograd, optimizer, Python) in it. Fitted as
busy = FLOPs / rate over every rank and step but the first of each attempt (warm-up).

The waits cannot be split into link bandwidth and waiting for peers from these figures. With a base profile
(its measured links, and its per-TP compute table re-levelled to the run's rate) the links are refitted per
kind of communication the trainer times apart, each from its own measured median and the planner's figure
for the same span of the run's layout:
  tp  comm_s - pp_s (the waits inside TP collectives)  against the plan's exposed TP time, on the TP link's
      collectives (all-reduce, or reduce-scatter + all-gather under sequence parallelism)
  dp  sync_s (gradient sync + the final all-reduce + ZeRO's weight all-gather) against the plan's exposed DP
      + tied-embedding sync,
      on the ZeRO stage's collectives of the DP link
Each is one number, the extra latency per call on top of the base's idle latency of its collectives that
makes the plan's span the measured one (bisection; 0 when the plan is slower already), fitted in that order:
a collective both use keeps the TP figure and the DP fit moves only the rest (none left: not fitted, said
in fits.run.kinds). The pipeline's receives (pp_s) wait for the previous stage's compute as much as for the
link, and the collectives neither span uses, keep the base's fits as measured. Without a base the profile
has the compute rate only and the planner prices links by the catalog.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from statistics import median
from typing import Any

from trainctl.errors import UsageError
from trainctl.plan import comm
from trainctl.plan.calibration import profile as prof
from trainctl.plan.calibration.fit import fit_rate
from trainctl.plan.placement import coords
from trainctl.plan.rates import PROFILE_LINK, TP_OPS
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
                         "comm_s": r.get("comm_s"), "pp_s": r.get("pp_s"), "busy_s": busy, "flops": flops})
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
        links = copy.deepcopy(base.data["fits"].get("links", {}))
        if base.data["fits"].get("dp_overlap"):  # the hardware's, as measured: the refit prices DP sync with it
            out["fits"]["dp_overlap"] = dict(base.data["fits"]["dp_overlap"])
        out["fits"]["run"].update(step_time_s=measured, kinds=_refit_kinds(spec, out, links, rows))
        out["fits"]["links"] = links
    return out


Row = dict[str, Any]


def _tp_waits(r: Row) -> float:
    return float(r.get("comm_s") or 0.0) - float(r.get("pp_s") or 0.0)


def _dp_sync(r: Row) -> float:
    return float(r.get("sync_s") or 0.0)


# kind -> (the steptimes' figure: its name, its seconds in a row; the plan's seconds of the same span)
SPANS: dict[str, tuple[str, Callable[[Row], float], Callable[[Any], float]]] = {
    "tp": ("comm_s - pp_s", _tp_waits, lambda e: e.tp_exposed_time),
    "dp": ("sync_s", _dp_sync, lambda e: (e.dp_exposed_time or 0.0) + e.embedding_sync_time),
}


def _kind_ops(kind: str, spec: RunSpec, est: Any) -> list[tuple[str, str]]:
    """The (profile link, collective) pairs the plan prices span `kind` with, for the spec's layout."""
    p = spec.parallel
    if kind == "tp":
        ops = [op for op, _ in TP_OPS[bool(p.sequence_parallel and p.tp > 1)]] if p.tp > 1 else []
    else:
        ops = [op for op, _, _ in comm.dp_traffic(1.0, p.zero, spec.dp, 1, 4.0, 4.0)]
    return sorted({(PROFILE_LINK[est.comm_link[kind]], op) for op in ops})


def _refit_kinds(spec: RunSpec, data: dict[str, Any], links: dict[str, Any],
                 rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Refit `links` (the base's, changed in place) per measured span (module docstring); what each fit."""
    from trainctl.plan.estimate import Evaluator, assumed_rates
    from trainctl.plan.plan import candidate_from_spec, context_from_spec
    from trainctl.plan.rates import MeasuredRates

    ctx, cand = context_from_spec(spec), candidate_from_spec(spec)

    def estimate(trial: dict[str, Any]) -> Any:
        profile = prof.parse(Path("<refit>"), {**data, "fits": {**data["fits"], "links": trial}})
        return Evaluator(replace(ctx, rates=MeasuredRates(profile, assumed_rates(ctx.hw, ctx.assume), []))) \
            .evaluate(cand)

    claimed: set[tuple[str, str]] = set()
    out: dict[str, dict[str, Any]] = {}
    for kind, (figure, seconds, span) in SPANS.items():
        pairs = [pair for pair in _kind_ops(kind, spec, estimate(links)) if pair[0] in links
                 and pair[1] in links[pair[0]] and pair not in claimed]
        measured = median([seconds(r) for r in rows]) if rows else 0.0
        entry: dict[str, Any] = {"measured": figure, "measured_s": measured,
                                 "collectives": [f"{link}.{op}" for link, op in pairs]}
        if not pairs or measured <= 0:
            out[kind] = {**entry, "fitted": False,
                         "why": "no collective of its own to refit" if measured > 0 else "not measured in the run"}
            continue

        def planned(excess: float, pairs: list[tuple[str, str]] = pairs, span: Callable[[Any], float] = span) -> float:
            return span(estimate(_with_excess(links, pairs, excess)))

        excess = _bisect(planned, measured)
        links.update(_with_excess(links, pairs, excess))
        claimed.update(pairs)
        out[kind] = {**entry, "fitted": True, "load_excess_s": excess, "planned_s": planned(excess)}
    return out


def _with_excess(links: dict[str, Any], pairs: list[tuple[str, str]], excess: float) -> dict[str, Any]:
    """`links` with `excess` seconds per call on top of the idle latency of the collectives `pairs`."""
    links = copy.deepcopy(links)
    for link, op in pairs:
        fit = links[link][op]
        idle = fit.get("idle_latency_s", fit["latency_s"])
        fit.update(idle_latency_s=idle, load_excess_s=excess, latency_s=idle + excess)
    return links


def _bisect(planned: Callable[[float], float], measured: float) -> float:
    """The per-call excess (>= 0) with which `planned` (growing with it) is `measured`."""
    lo, hi = 0.0, max(measured, 1e-3)
    if planned(lo) >= measured:
        return 0.0
    while planned(hi) < measured:  # a span (almost) without calls: give up beyond 1000x the measured
        hi *= 10
        if hi > 1000 * measured:
            return 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if planned(mid) < measured else (lo, mid)
    return (lo + hi) / 2

"""`trainctl calibrate --from-run RUN`: a calibration profile refitted to a finished run's own step times.

Every rank records each step's time, its gradient-sync time and its wait inside TP collectives and pipeline
receives (RUN/logs/steptimes-rank<r>.jsonl, trainctl/runtime/observe/stragglers.py). mfu-report splits the
median step into the same parts (report/breakdown.py measured_components: compute, TP/CP/EP collectives,
pipeline waits, gradient sync, data wait) and holds the plan's parts against them (report/step_vs_plan.py).
The refit fits the profile to those measured parts, through the planner itself, so the plan of the run's spec
priced with it predicts the run: each figure below is solved (bisection) so that the planner's part equals the
run's measured part, in this order, each with the figures before it in place:
  compute   the FLOP/s rate (the base's per-TP table re-levelled, or one rate at the run's tp), against the
            measured compute; the base's work outside the layers (fits.fixed: the ends, the optimizer step)
            is kept, priced in the same part, so the rate holds only the layers
  tp        the TP/CP/EP collectives part, on the TP link's collectives (all-reduce, or reduce-scatter +
            all-gather under sequence parallelism)
  pp        the pipeline waits (bubble + point-to-point, less the drain), on the pipeline link's send/recv:
            the waits the schedule's bubble does not explain (unbalanced stages, a slow neighbour) are
            priced as waiting per hop
  dp        the gradient sync (exposed DP + tied-embedding sync + the pipeline's drain), on the ZeRO stage's
            collectives of the DP link and the tied embedding's all-reduce
Each collective figure is one number, the extra latency per call on top of the base's idle latency of its
collectives (0 when the plan is longer already); a collective an earlier kind fitted keeps that figure (none
left: not fitted, said in fits.run.kinds). The collectives no kind uses keep the base's fits as measured.
Without a base the profile has the compute rate only and the planner prices links by the catalog.
fits.run also records the rate fitted per rank and step (busy = step - sync - comm against that rank's FLOPs)
and its scatter, which says how steady the run's compute was.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainctl.errors import UsageError
from trainctl.plan import comm
from trainctl.plan.calibration import profile as prof
from trainctl.plan.calibration.fit import fit_rate
from trainctl.plan.estimate import Estimate, Evaluator, assumed_rates
from trainctl.plan.placement import coords
from trainctl.plan.plan import breakdown_of, build_plan, candidate_from_spec, context_from_spec
from trainctl.plan.rates import EMBEDDING_OPS, PP_OPS, PROFILE_LINK, TP_OPS, rates_of
from trainctl.report import last_layout
from trainctl.report.breakdown import measured_components
from trainctl.report.load import load_run
from trainctl.report.step_vs_plan import component_seconds
from trainctl.rundir.paths import RunPaths
from trainctl.spec import RunSpec, load_spec


def refit(root: Path, base: prof.Profile | None = None) -> dict[str, Any]:
    """The profile of run directory `root` (a UsageError when it has no step times to fit)."""
    from trainctl.launch.calibrate import calibration_spec

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
    measured = measured_components(*last_layout(run))
    if not points or measured is None:
        raise UsageError(f"{root}: no step times to fit (each rank needs two steps or more in "
                         f"{RunPaths(root).logs.name}/steptimes-rank<N>.jsonl)",
                         hint="refit from a run that finished a few steps")
    per_step_rate, scatter = fit_rate(points)
    tp = layout.tp
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
        "fits": {"run": {"points": len(points), "tp": tp, "per_step_flops_per_s": per_step_rate,
                         "per_step_rms_rel_error": scatter, "step_time_s": measured["step_time_s"]},
                 "compute": {str(tp): per_step_rate}, "links": {}},
    }
    fits = out["fits"]
    if base is not None:
        fits["links"] = copy.deepcopy(base.data["fits"].get("links", {}))
        for kept in ("fixed", "dp_overlap"):  # the hardware's, as measured: the refit prices with them
            if base.data["fits"].get(kept):
                fits[kept] = copy.deepcopy(base.data["fits"][kept])
    planner = _Planner(spec, out)
    shape = {str(t): r / base.compute_rate(tp) for t, r in base.compute.items()} if base else {str(tp): 1.0}
    rate, planned = _fit_rate(planner, shape, measured["components_s"]["compute"], per_step_rate)
    fits["compute"] = {t: x * rate for t, x in shape.items()}
    fits["run"].update(flops_per_s=rate, rms_rel_error=_rms_rel(points, rate),
                       compute={"measured": "compute", "measured_s": measured["components_s"]["compute"],
                                "planned_s": planned})
    if base is not None:
        fits["run"]["kinds"] = _refit_kinds(planner, measured["components_s"])
    return out


Row = dict[str, Any]


class _Planner:
    """The planner's parts of the run's step (report/step_vs_plan.py COMPONENTS) priced with trial fits: the
    profile being built, as `mfu-report --calibration` would price the run with it."""

    def __init__(self, spec: RunSpec, data: dict[str, Any]) -> None:
        self.spec, self.data = spec, data
        self.ctx, self.cand = context_from_spec(spec), candidate_from_spec(spec)
        self.fallback = assumed_rates(self.ctx.hw, self.ctx.assume)

    def estimate(self, **fits: Any) -> Estimate:
        """The estimate with the profile's fits, `fits` put in their place (compute=..., links=...)."""
        profile = prof.parse(Path("<refit>"), {**self.data, "fits": {**self.data["fits"], **fits}})
        return Evaluator(replace(self.ctx, rates=rates_of(profile, self.spec, self.fallback))).evaluate(self.cand)

    def parts(self, **fits: Any) -> dict[str, float]:
        est = self.estimate(**fits)
        return component_seconds(breakdown_of(est) or {}, est.extra["pipeline_drain_time"])


COMPUTE = "compute"
# kind -> the measured part (step_vs_plan.COMPONENTS) its collectives' latency is fitted to
KINDS = {"tp": "collectives (TP, CP, EP)", "pp": "pipeline bubble + point-to-point",
         "dp": "DP gradient sync (exposed)"}


def _fit_rate(planner: _Planner, shape: dict[str, float], measured_s: float, guess: float) -> tuple[float, float]:
    """The rate at the run's tp (the others in `shape`'s proportion) with which the planner's compute part is the
    measured one, and that part; `guess` where the measured part is no positive time."""
    def planned(seconds_per_flop: float) -> float:
        return planner.parts(compute={t: x / seconds_per_flop for t, x in shape.items()})[COMPUTE]

    x = _solve(planned, measured_s, 1 / guess) if measured_s > 0 else None
    if x is None:  # no rate makes it: the work outside the layers alone is longer than the measured compute
        x = 1 / guess
    return 1 / x, planned(x)


def _rms_rel(points: list[tuple[float, float]], rate: float) -> float:
    """The scatter of the per-rank, per-step busy times about the fitted rate (relative to each)."""
    return math.sqrt(sum(((f / rate - t) / t) ** 2 for f, t in points) / len(points))


def _kind_ops(kind: str, spec: RunSpec, est: Any) -> list[tuple[str, str]]:
    """The (profile link, collective) pairs the plan prices span `kind` with, for the spec's layout."""
    p = spec.parallel
    if kind == "tp":
        ops = [(est.comm_link["tp"], op) for op, _ in TP_OPS[bool(p.sequence_parallel and p.tp > 1)]] \
            if p.tp > 1 else []
    elif kind == "pp":
        ops = [(est.comm_link["pp"], op) for op, _ in PP_OPS] if p.pp > 1 else []
    else:
        ops = [(est.comm_link["dp"], op) for op, _, _ in comm.dp_traffic(1.0, p.zero, spec.dp, 1, 4.0, 4.0)]
        if est.embedding_sync_time:  # the tied embedding's all-reduce between the first and last stage
            ops += [(est.comm_link["embedding"], op) for op, _ in EMBEDDING_OPS]
    return sorted({(PROFILE_LINK[link], op) for link, op in ops})


def _refit_kinds(planner: _Planner, measured: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    """Refit the profile's links (planner.data's, changed in place) per measured part (module docstring);
    what each fit."""
    links = planner.data["fits"]["links"]
    claimed: set[tuple[str, str]] = set()
    out: dict[str, dict[str, Any]] = {}
    for kind, part in KINDS.items():
        pairs = [pair for pair in _kind_ops(kind, planner.spec, planner.estimate()) if pair[0] in links
                 and pair[1] in links[pair[0]] and pair not in claimed]
        seconds = measured.get(part) or 0.0
        entry: dict[str, Any] = {"measured": part, "measured_s": seconds,
                                 "collectives": [f"{link}.{op}" for link, op in pairs]}
        if not pairs or seconds <= 0:
            out[kind] = {**entry, "fitted": False,
                         "why": "no collective of its own to refit" if seconds > 0 else "not measured in the run"}
            continue

        def planned(excess: float, pairs: list[tuple[str, str]] = pairs, part: str = part) -> float:
            return planner.parts(links=_with_excess(links, pairs, excess))[part]

        excess = _bisect(planned, seconds)
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


def _solve(planned: Callable[[float], float], measured: float, guess: float) -> float | None:
    """The x > 0 with which `planned` (growing with x) is `measured`: bracketed by halving and doubling from
    `guess`, then bisected (on a log scale: x spans orders of magnitude); None where no x within 2^40 of the
    guess brackets it."""
    lo = hi = guess
    for _ in range(40):
        if planned(lo) <= measured:
            break
        lo /= 2
    for _ in range(40):
        if planned(hi) >= measured:
            break
        hi *= 2
    if not planned(lo) <= measured <= planned(hi):
        return None
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if planned(mid) < measured else (lo, mid)
    return math.sqrt(lo * hi)

"""report layer: `trainctl mfu-report` reads run directories (no torch) and explains the run's efficiency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainctl.launch import exclusions
from trainctl.report.attempts import final_and_replayed, split_attempts
from trainctl.report.breakdown import time_breakdown
from trainctl.report.cadence import measured_cadence
from trainctl.report.divergence import divergence
from trainctl.report.divergence import warnings as divergence_warnings
from trainctl.report.goodput import goodput
from trainctl.report.layouts import Segment, kept_in, segments, view
from trainctl.report.load import RunData, load_run
from trainctl.report.memory import memory_vs_plan
from trainctl.report.nodes import node_segments
from trainctl.report.profile import profile_files
from trainctl.report.projection import run_projection
from trainctl.report.routing import routing
from trainctl.report.routing import warnings as routing_warnings
from trainctl.report.scaling import scaling
from trainctl.report.step_vs_plan import step_vs_plan
from trainctl.report.stragglers import stragglers
from trainctl.report.summary import steady_steps, summarize
from trainctl.report.timeline import timeline
from trainctl.rundir.paths import RunPaths


def _held_against_plan(run: RunData, seg: Segment, final: list[dict[str, Any]]) -> dict[str, Any]:
    """One layout's attempts against their own plan: step time and memory, predicted vs measured."""
    part = view(run, seg)
    steady = steady_steps(kept_in(seg, final), seg.attempts)
    return {"attempts": seg.label, "layout": seg.describe(), "overrides": seg.layout.overrides,
            "step_vs_plan": step_vs_plan(part, steady), "memory": memory_vs_plan(part)}


def last_layout(run: RunData) -> tuple[RunData, list[dict[str, Any]]]:
    """The run as its last layout's attempts saw it, and their steady steps: what the step statistics, the time
    breakdown and the plan comparison are of (and what `calibrate --from-run` fits)."""
    attempts = split_attempts(run)
    final, _ = final_and_replayed(attempts)
    segs = segments(run, attempts)
    return view(run, segs[-1]), steady_steps(kept_in(segs[-1], final), segs[-1].attempts)


def analyze(run: RunData) -> dict[str, Any]:
    """Every section of the report for one run, as plain JSON-able data. The step statistics, the time
    breakdown and the plan comparison cover the attempts of the last layout ("covers"); a run resumed with
    another layout has each earlier layout's attempts held against their own plan in "layouts"."""
    attempts = split_attempts(run)
    final, replayed = final_and_replayed(attempts)
    segs = segments(run, attempts)
    current = view(run, segs[-1])
    summary = summarize(current, kept_in(segs[-1], final), segs[-1].attempts)
    gp = goodput(run, attempts, final, replayed)
    steady = steady_steps(kept_in(segs[-1], final), segs[-1].attempts)
    startup = (gp.get("lost_s") or {}).get("startup")
    warnings = list(run.skipped)  # unreadable lines of metrics.jsonl / events.jsonl: what the report did not see
    if summary["mfu_bug"]:
        warnings.append(summary["mfu_bug"]["message"])
    div = divergence(run, final)  # skipped steps, rollbacks, divergence, loss spikes
    warnings += divergence_warnings(div)
    planned_moe = ((run.plan or {}).get("moe") or {}).get("load_imbalance_allowance")
    moe = routing(steady, final, planned_moe)  # mixture of experts: imbalance, dropped tokens, all-to-all share
    warnings += routing_warnings(moe)
    steps = ((run.spec or {}).get("train") or {}).get("steps")
    cadence = measured_cadence(run, summary["step_time_s"]["median"], steps)
    if cadence.get("warning"):
        warnings.append(cadence["warning"])
    vs_plan = step_vs_plan(current, steady)
    spikes = {s["step"] for s in div["loss_spikes"]}
    final_ids = {id(r) for r in final}
    return {
        "run": str(run.root), "name": run.name, "label": run.name,  # label: what the report calls it (build_report)
        "covers": segs[-1].label if len(segs) > 1 else f"all {len(attempts)} attempts" if len(attempts) > 1
        else "attempt 0",  # which attempts the step statistics, breakdown and plan comparison are of
        "layout": segs[-1].describe(),
        "layouts": [_held_against_plan(run, s, final) for s in segs] if len(segs) > 1 else [],
        "summary": summary,
        "time_breakdown": time_breakdown(current, steady, summary["step_time_s"]["median"], startup),
        "step_vs_plan": vs_plan,
        "prediction": vs_plan["prediction"],  # the plan's step and its parts (None: no time prediction)
        "measured": vs_plan["measured"],  # the same parts as the ranks measured them
        "goodput": gp,
        "projection": run_projection(run, summary, gp),  # the rest projected from what was measured, vs the plan
        "timeline": timeline(run, attempts, final, gp),
        "nodes": node_segments(run, attempts, gp.get("begin_time")),  # elastic: node count and throughput
        # nodes later jobs of the run keep out of (preflight, repeated first causes): node -> reason, source
        "excluded_nodes": exclusions.read(RunPaths(run.root)),
        "checkpoint_cadence": cadence,
        "stragglers": stragglers(current),
        "memory": memory_vs_plan(current),
        "series": [{"step": r["step"], "attempt": a.index, "loss": r.get("loss"), "mfu": r.get("mfu"),
                    "step_time_s": r.get("step_time_s"), "skipped": bool(r.get("skipped")),
                    "kept": id(r) in final_ids,
                    "spike": r["step"] in spikes and id(r) in final_ids} for a in attempts for r in a.records],
        "divergence": div,
        "routing": moe,
        "profile": profile_files(run),  # train.profile's files
        "warnings": warnings,
    }


def build_report(runs: list[Path], calibration: Path | None = None) -> dict[str, Any]:
    """The report of each run; with `calibration`, each run's plan priced again with that profile; with
    several runs of one model at different GPU counts, their scaling efficiency."""
    data = [load_run(p, calibration) for p in runs]
    reports = [analyze(d) for d in data]
    _label(reports)
    return {"runs": reports, "scaling": scaling(data, reports) if len(data) > 1 else []}


def _label(reports: list[dict[str, Any]]) -> None:
    """Runs of one spec share its name: each line of the report then says which run by its directory's name
    beside it, or by the whole path where those collide too."""
    if len({r["name"] for r in reports}) == len(reports):
        return
    dirs = [Path(r["run"]).name for r in reports]
    for r, d in zip(reports, dirs, strict=True):
        r["label"] = f"{r['name']} ({d})" if len(set(dirs)) == len(dirs) else r["run"]


__all__ = ["analyze", "build_report", "last_layout", "load_run"]

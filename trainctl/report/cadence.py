"""The measured checkpoint cadence of a finished run: what a save really cost, how often the spec saved, and
the Young/Daly interval for those costs (the formulas are the planner's, plan/cadence.py)."""

from __future__ import annotations

from typing import Any

from trainctl.plan.cadence import Cadence, configured_interval, job_mtbf
from trainctl.report.attempts import median
from trainctl.report.breakdown import checkpoint_blocks
from trainctl.report.load import RunData


def save_durations(run: RunData) -> list[float]:
    """Seconds from the end of a saved step to its checkpoint's commit (blocking part + background write)."""
    out = []
    for e in run.events_of("checkpoint_committed"):
        ends = [float(m["time"]) for m in run.metrics
                if m.get("step") == e.get("step") and "time" in m and float(m["time"]) <= float(e.get("time", 0))]
        if ends:
            out.append(float(e["time"]) - max(ends))
    return out


def measured_cadence(run: RunData, step_time_s: float | None, steps: int | None) -> dict[str, Any]:
    blocks = checkpoint_blocks(run)
    if not blocks:
        return {"available": False, "note": "no checkpoint save measured (metrics ckpt_block_s)"}
    spec = run.spec or {}
    ck, cluster = spec.get("checkpoint") or {}, spec.get("cluster") or {}
    mtbf, source = job_mtbf(gpus=int(cluster.get("nodes") or 1) * int(cluster.get("gpus_per_node") or 8),
                            gpu=str(cluster.get("gpu") or "h100-sxm"), mtbf_hours=ck.get("mtbf_hours"),
                            fleet=ck.get("failure_fleet"))
    cost = float(median(blocks) or 0.0)
    planned = ((run.plan or {}).get("checkpoint") or {}).get("whole_run") or {}
    cadence = Cadence(cost, mtbf, source,
                      configured_interval(ck.get("every_steps"), ck.get("every_minutes"), step_time_s),
                      step_time_s, run_s=step_time_s * steps if step_time_s and steps else None,
                      restart_s=float(planned.get("restart_s") or 0.0))  # the plan's restart; 0 without one
    return {"available": True, "saves": len(blocks), "save_s": median(save_durations(run)), **cadence.as_dict()}

"""Predicted vs measured memory per pipeline rank and component: the plan's `memory.per_pp_rank` beside the
trainer's measured `memory` line in metrics.jsonl (docs/design/memory.md, "Memory model")."""

from __future__ import annotations

from typing import Any

from trainctl.report.load import RunData

# (plan field, measured field): the components both sides have
COMPONENTS = (("weights", "weights"), ("gradients", "gradients"), ("optimizer", "optimizer"),
              ("activations", "activations_peak"))


def memory_vs_plan(run: RunData) -> dict[str, Any]:
    measured = next((m["memory"] for m in reversed(run.metrics) if isinstance(m.get("memory"), dict)), None)
    planned = ((run.plan or {}).get("memory") or {}).get("per_pp_rank")
    layout = (run.plan or {}).get("layout") or {}
    if measured is None:
        return {"available": False, "note": "no measured memory in metrics.jsonl (the run logged fewer than "
                                            "two steps, or an older trainer wrote it)"}
    if not planned or not layout.get("tp") or not layout.get("dp"):
        return {"available": False, "note": "no plan beside the run to compare the measured memory with"}
    per_stage = len(measured["per_rank"]) // len(planned) or 1  # Megatron rank order: pp varies slowest
    rows = []
    for want in planned:
        r = want["pp_rank"]
        ranks = measured["per_rank"][r * per_stage:(r + 1) * per_stage]
        for plan_key, got_key in COMPONENTS:
            got = max((x.get(got_key) or 0) for x in ranks) if ranks else None
            pred = want.get(plan_key)
            err = (got - pred) / pred if got is not None and pred else None
            rows.append({"pp_rank": r, "component": plan_key, "predicted_bytes": pred, "measured_bytes": got,
                         "error": err})
    worst = max((x for x in rows if x["error"] is not None), key=lambda x: abs(x["error"]), default=None)
    note = None
    if worst is not None:
        side = "more" if worst["error"] > 0 else "less"
        note = (f"largest gap: pipeline rank {worst['pp_rank']} {worst['component']} measured "
                f"{abs(worst['error']):.1%} {side} than planned")
    return {"available": True, "rows": rows, "largest_gap": note}

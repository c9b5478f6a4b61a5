"""Mixture-of-experts routing over a run, for `mfu-report`: load imbalance (tokens of the busiest expert over
the mean, worst MoE layer, per step), tokens per expert, the balance and z losses, dropped tokens, and the
share of the step spent in the expert-parallel all-to-all. From the `moe` record of each step in
metrics.jsonl (trainctl/runtime/model/moe.py, MoEStats). Pure functions over RunData."""

from __future__ import annotations

from typing import Any

from trainctl.report.attempts import median


def routing(steady: list[dict[str, Any]], final: list[dict[str, Any]], planned: float | None) -> dict[str, Any]:
    """The routing section: `steady` steps for the medians, `final` (every step's last run) for the trends;
    `planned`: the load-imbalance allowance the run's plan priced (its plan.json; None without one)."""
    rows = [r for r in final if r.get("moe")]
    if not rows:
        return {"available": False, "note": "a dense model (no MoE routing recorded)"}
    calm = [r for r in steady if r.get("moe")] or rows
    imb = [float(r["moe"]["imbalance"]) for r in calm]
    share = [float(r["moe"]["a2a_s"]) / float(r["step_time_s"]) for r in calm if r.get("step_time_s")]
    first, last = rows[0]["moe"], rows[-1]["moe"]
    return {
        "available": True,
        "imbalance": {"median": median(imb), "max": max(imb), "first": first["imbalance"],
                      "last": last["imbalance"], "planned": planned},
        "tokens_per_expert": {"min": min(r["moe"]["tokens_per_expert"]["min"] for r in calm),
                              "max": max(r["moe"]["tokens_per_expert"]["max"] for r in calm),
                              "mean": median([r["moe"]["tokens_per_expert"]["mean"] for r in calm])},
        "aux_loss": {"first": first["aux_loss"], "last": last["aux_loss"]},
        "z_loss": {"first": first["z_loss"], "last": last["z_loss"]},
        "dropped": sum(int(r["moe"]["dropped"]) for r in rows),
        "a2a_s": median([float(r["moe"]["a2a_s"]) for r in calm]),
        "a2a_share": median(share),
        "series": [{"step": r["step"], "imbalance": r["moe"]["imbalance"], "aux_loss": r["moe"]["aux_loss"]}
                   for r in rows],
    }


def warnings(d: dict[str, Any]) -> list[str]:
    if not d.get("available"):
        return []
    i = d["imbalance"]
    if i["median"] is not None and i["planned"] is not None and i["median"] > i["planned"]:
        return [f"routing imbalance {i['median']:.2f} (busiest expert over the mean, median step) is above the "
                f"planner's allowance of {i['planned']:.2f}: the busiest EP rank sets the pace of the experts, "
                "so the plan's step time is optimistic; `--set estimate.moe_imbalance="
                f"{i['median']:.2f}` plans with what this run measured (a larger model.moe.aux_loss_coeff "
                "balances harder)"]
    return []

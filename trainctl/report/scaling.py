"""Scaling efficiency between runs of the same model at different GPU counts (`mfu-report RUN_A RUN_B`).

Efficiency = the speed-up over the smaller run divided by the growth in GPUs, i.e. (tokens/s per GPU of the
larger run) / (tokens/s per GPU of the smaller). It reads the same for strong scaling (the global batch kept: time to
a fixed amount of work) and weak scaling (the per-GPU batch kept); the report says which one the pair is.
Below 80%, the usual bar of scaling studies (e.g. Narayanan et al., SC'21, report weak-scaling efficiency
for Megatron-LM at that level and above), it is a warning.
"""

from __future__ import annotations

from typing import Any

from trainctl.report.load import RunData

WARN_BELOW = 0.80


def _kind(base: dict[str, Any], other: dict[str, Any]) -> str:
    if base["tokens_per_step"] == other["tokens_per_step"]:
        return "strong"
    if base["tokens_per_step"] * other["world_size"] == other["tokens_per_step"] * base["world_size"]:
        return "weak"
    return "mixed"


def scaling(data: list[RunData], reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each later run against the first one of the same model with another world size, the smaller of the two
    as the baseline whichever was named first (a smaller run against a larger one would read as a speed-up)."""
    out = []
    first_data, first = data[0], reports[0]
    model = (first_data.spec or {}).get("model")
    for d, r in zip(data[1:], reports[1:], strict=True):
        s, f = r["summary"], first["summary"]
        if model is None or (d.spec or {}).get("model") != model or s["world_size"] == f["world_size"]:
            continue
        if not (s["tokens_per_s_per_gpu"] and f["tokens_per_s_per_gpu"] and s["tokens_per_step"]
                and f["tokens_per_step"]):
            continue
        (base_name, base, base_data), (name, run, run_data) = sorted(
            [(first["label"], f, first_data), (r["label"], s, d)], key=lambda x: x[1]["world_size"])
        eff = run["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
        kind = _kind(base, run)
        unit = "ranks" if ((run_data.spec or {}).get("cluster") or {}).get("gpu") == "cpu" else "GPUs"
        per = "rank" if unit == "ranks" else "GPU"
        line = (f"{name} on {run['world_size']} {unit} against {base_name} on {base['world_size']}: "
                f"{kind} scaling efficiency {eff:.0%} (tokens/s per {per} {run['tokens_per_s_per_gpu']:,.0f} vs "
                f"{base['tokens_per_s_per_gpu']:,.0f})")
        out.append({"run": name, "baseline": base_name, "gpus": run["world_size"],
                    "baseline_gpus": base["world_size"], "kind": kind, "efficiency": eff, "line": line,
                    "warning": eff < WARN_BELOW})
    return out

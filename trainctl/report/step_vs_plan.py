"""Predicted vs measured step time per component: the plan's `prediction.breakdown_s` beside what the ranks
measured in their steps (RUN/logs/steptimes-rank<r>.jsonl, written by trainctl/runtime/observe/stragglers.py, and
`data_wait_s` in metrics.jsonl).

A rank's step splits into what it waited for and its own work:
  - collectives inside the step: comm_s - pp_s (TP, CP and EP collectives, waiting for peers included)
  - pipeline waits: pp_s (receives: the bubble, point-to-point transfers, a slower neighbouring stage)
  - DP gradient sync: sync_s (gradient reduction and the step's final all-reduce, waiting included: with
    pipeline stages, the pipeline's drain, which the later stages wait out there after their last pass)
  - data-loader wait: data_wait_s (rank 0's; every rank reads the same way)
  - compute: the rest of the step, this rank's own forward, backward and optimizer work.
Each is the median over the steps of every start the report covers after each start's first (warm-up),
averaged over the ranks, and held against the plan's matching terms (the planner's parts sum to its step).
Checkpoint saves block outside the step (metrics `ckpt_block_s`) and are shown per save, against the plan's
zero.
"""

from __future__ import annotations

from typing import Any

from trainctl.plan.rates import calibration_text
from trainctl.report.breakdown import checkpoint_blocks, measured_components
from trainctl.report.load import RunData
from trainctl.report.summary import other_hardware
from trainctl.units import dur

# component -> the planner's breakdown_s parts that predict it (plan/plan.py Plan.breakdown)
COMPONENTS: dict[str, tuple[str, ...]] = {
    # the host step and the optimizer step run between the ranks' syncs; FSDP2's gathers inside forward/backward
    "compute": ("compute", "offload copies", "offload CPU step", "optimizer step", "FSDP2 units"),
    "collectives (TP, CP, EP)": ("TP exposed", "CP K/V exchange", "MoE all-to-all"),
    "pipeline bubble + point-to-point": ("pipeline bubble", "PP point-to-point"),
    "DP gradient sync (exposed)": ("DP exposed", "tied-embedding sync"),
    "data-loader wait": (),
}
MEASURED_AS = {  # how each measured part is had from the ranks' figures: timed itself, or derived from others
    "compute": "derived: step - sync - comm - data",
    "collectives (TP, CP, EP)": "derived: comm - pp",
    "pipeline bubble + point-to-point": "measured: pipeline receives (pp)",
    "DP gradient sync (exposed)": "measured: sync",
    "data-loader wait": "measured: rank 0's data wait",
}
WHY = {  # what a gap in each component usually means, in plain words
    "compute": "the kernels ran at a different FLOP/s than the profile's or the catalog's rate x "
               "compute_efficiency (recalibrate: `trainctl calibrate SPEC`, or `--from-run` this run)",
    "collectives (TP, CP, EP)": "the TP/CP/EP collectives, waiting for slower peers included, took a different "
                                "time than the link rate predicts (latency of small messages, contention)",
    "pipeline bubble + point-to-point": "the pipeline ranks waited a different time for each other than the "
                                        "schedule's bubble predicts (unbalanced stages, a slow rank, p2p latency)",
    "DP gradient sync (exposed)": "less of the gradient reduction hid behind backward than dp_overlap assumes, "
                                  "or a slow rank kept the others waiting in it (with pipeline stages: the last "
                                  "micro-batch's backward took a different time to reach the first stage)",
    "data-loader wait": "the data loader did not keep up (the plan assumes it always does)",
}

# the compute gap of a step the plan found host-bound: the kernels' rate is not what set it
HOST_BOUND = ("the plan found the layers host-bound ({floor} of its step is the GPU waiting for the host to issue "
              "their kernels, from the profile's dispatch floor), so the host's pace set this step, and it moves "
              "with the host's other work; a larger parallel.micro_batch or train.compile: true gives each kernel "
              "more work")


def component_seconds(breakdown: dict[str, float], drain_s: float) -> dict[str, float]:
    """A predicted step's parts (the planner's breakdown_s) grouped as the ranks measure them (COMPONENTS)."""
    components = {c: sum(breakdown.get(k) or 0.0 for k in keys) for c, keys in COMPONENTS.items()}
    # a rank's sync holds the pipeline's drain: the later stages wait in it for the first to finish its backward
    components["pipeline bubble + point-to-point"] -= drain_s
    components["DP gradient sync (exposed)"] += drain_s
    return components


def predicted_components(run: RunData) -> tuple[dict[str, Any] | None, str | None]:
    """The plan's step and its parts grouped as COMPONENTS, or (None, why there is none)."""
    plan = run.plan or {}
    if not plan:
        return None, "no plan.json in the run directory"
    mismatch = other_hardware(run)
    if mismatch:
        return None, mismatch
    pred = plan.get("prediction") or {}
    parts = pred.get("breakdown_s")
    if pred.get("step_time_s") is None or parts is None:
        return None, ("the plan has no step-time prediction (no catalog peak for this accelerator and no "
                      "calibration profile: `trainctl calibrate SPEC`, then `mfu-report --calibration "
                      "PROFILE`, or launch with cluster.calibration)")
    components = component_seconds(parts, pred.get("pipeline_drain_s") or 0.0)
    return {"step_time_s": pred["step_time_s"], "components_s": components,
            "outside_layers": pred.get("outside_layers"), "dispatch_s": pred.get("dispatch_s") or 0.0}, None


def step_vs_plan(run: RunData, steady: list[dict[str, Any]]) -> dict[str, Any]:
    """Predicted and measured step, per component, the step's error and the largest gap in plain words."""
    measured = measured_components(run, steady)
    predicted, why_not = predicted_components(run)
    ck = checkpoint_blocks(run)
    rows = []
    for c in COMPONENTS:
        p = predicted["components_s"][c] if predicted else None
        m = measured["components_s"][c] if measured else None
        rows.append({"component": c, "predicted_s": p, "measured_s": m, "measured_as": MEASURED_AS[c],
                     "error_s": m - p if m is not None and p is not None else None})
    out: dict[str, Any] = {
        "rows": rows,
        "checkpoint_block_s_per_save": sum(ck) / len(ck) if ck else None, "checkpoint_saves": len(ck),
        "prediction": predicted, "measured": measured, "no_prediction": why_not,
        "priced_with": calibration_text((run.plan or {}).get("calibration") or {}) if predicted else None,
        "step_error": None, "largest_gap": None,
    }
    if predicted is None or measured is None or not predicted["step_time_s"]:
        return out
    p_step, m_step = predicted["step_time_s"], measured["step_time_s"]
    out["step_error"] = m_step / p_step - 1
    worst = max((r for r in rows if r["error_s"] is not None), key=lambda r: abs(r["error_s"]), default=None)
    if worst is not None and worst["error_s"]:
        gap = m_step - p_step
        share = f"; {abs(worst['error_s'] / gap):.0%} of the step's gap" if abs(gap) > 1e-12 else ""
        more = "longer" if worst["error_s"] > 0 else "shorter"
        rel = (f" ({worst['measured_s'] / worst['predicted_s'] - 1:+.0%})" if worst["predicted_s"] else "")
        why = WHY[worst["component"]]
        if worst["component"] == "compute" and predicted["dispatch_s"] > 0:
            why = HOST_BOUND.format(floor=dur(predicted["dispatch_s"]))
        out["largest_gap"] = (f"{worst['component']} took {dur(abs(worst['error_s']))} {more} than predicted"
                              f"{rel}{share}: {why}")
    return out

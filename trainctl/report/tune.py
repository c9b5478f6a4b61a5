"""`trainctl tune`'s result: each layout's predicted figures (the plan's, from TUNE/tune.json) against what its
run measured, their ranks in both orders, and the spec of the measured fastest. No torch.

Measured figures are the run's own (metrics.jsonl) as `mfu-report` summarises them: medians over the steady
steps, the first step of each attempt left out as warm-up (report/summary.py). Only a run that completed is
ranked: a layout whose run failed (out of memory, a crash) is a row saying so. Runs are ranked by measured
step time (the same tokens per step for every layout, so tokens/s ranks them the same way).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from trainctl.errors import TrainctlError
from trainctl.rundir import tune_record as tr
from trainctl.rundir.runstate import CANCELLED, COMPLETED, PENDING, RUNNING, STARTING, STOPPED, STOPPING

# states of a run that has not ended its measuring: the tune is not finished (stopped, or still going)
UNFINISHED = (PENDING, STARTING, RUNNING, STOPPING, STOPPED, CANCELLED)


def measure(root: Path) -> dict[str, Any]:
    """The tune's table: one row per layout, in the plan's order. `finished`: every run ended (completed or
    failed); `best`: the measured fastest completed layout's row (None if none completed)."""
    from trainctl.launch.status import run_status
    from trainctl.report import analyze
    from trainctl.report.load import load_run

    record = tr.read_record(root)
    rows: list[dict[str, Any]] = []
    for layout in record.layouts:
        row: dict[str, Any] = {"dir": layout.dir, "layout": layout.describe, "short": short(layout),
                               "predicted_rank": layout.predicted_rank,
                               "predicted": layout.predicted, "measured": None, "measured_rank": None}
        try:
            st = run_status(root / layout.dir)
            row.update(state=st.state, reason=st.reason, steps=st.steps_done)
        except TrainctlError as e:
            row.update(state="UNKNOWN", reason=str(e).splitlines()[0], steps=0)
        if row["state"] == COMPLETED:
            try:
                s = analyze(load_run(root / layout.dir))["summary"]
                row["measured"] = {"step_time_s": s["step_time_s"]["median"], "tokens_per_s": s["tokens_per_s"],
                                   "mfu": None if s["mfu"] is None else s["mfu"]["median"],
                                   "steady_steps": s["steps_in_stats"]}
            except TrainctlError as e:
                row["reason"] = str(e).splitlines()[0]
        rows.append(row)
    timed = sorted((r for r in rows if r["measured"] and r["measured"]["step_time_s"]),
                   key=lambda r: (r["measured"]["step_time_s"], r["predicted_rank"]))
    for rank, r in enumerate(timed, 1):
        r["measured_rank"] = rank
    return {"tune": str(root.absolute()), "spec": record.spec, "sets": record.sets, "steps": record.steps,
            "peak_known": record.peak_known, "out": record.out,
            "finished": not any(r["state"] in UNFINISHED for r in rows),
            "rows": rows, "best": timed[0] if timed else None}


def short(layout: tr.TunedLayout) -> str:
    """A layout in few characters for the table: tp/cp/pp/dp as `plan --auto` prints them, then what differs
    from the plain 1F1B ZeRO-0 layout (ZeRO stage, micro-batch, schedule and chunks, recompute, offload, ep)."""
    p = layout.parallel
    sched = {"interleaved": "il", "zero-bubble": "zb"}.get(p["schedule"], p["schedule"])
    chunks = f" v{p['virtual_stages']}" if p["virtual_stages"] > 1 and p["schedule"] != "zbv" else ""
    return (f"{p['tp']}{'sp' if p['sequence_parallel'] else ''}/{p['cp']}/{p['pp']}/{p['dp']}"
            + (f" ep{p['ep']}" if p["ep"] > 1 else "") + f" z{p['zero']}" + (" off" if p["offload"] != "none" else "")
            + f" mb{p['micro_batch']} {sched}{chunks}" + ("" if layout.recompute == "none" else f" {layout.recompute}"))


def best_spec_text(root: Path, result: dict[str, Any]) -> str:
    """The tuned spec (its file, with its --set overrides) with the measured fastest layout: its `parallel`
    keys and train.recompute replaced, every other line as the spec says; a header says it was measured, and
    where. Validated before it is returned (SpecError otherwise)."""
    from trainctl.spec.loader import apply_overrides, parse_yaml, read_spec_text, validate_spec

    record = tr.read_record(root)
    best = result["best"]
    layout = next(x for x in record.layouts if x.dir == best["dir"])
    data = apply_overrides(parse_yaml(read_spec_text(record.spec), record.spec), record.sets, record.spec)
    given = data.get("parallel") if isinstance(data.get("parallel"), dict) else {}
    layout_keys = ("tp", "cp", "pp", "dp", "ep", "zero", "offload", "micro_batch", "sequence_parallel", "schedule",
                   "virtual_stages")
    data["parallel"] = {**given, **{k: layout.parallel[k] for k in (*given, *layout_keys) if k in layout.parallel}}
    data["train"] = {**(data.get("train") or {}), "recompute": layout.recompute}
    validate_spec(data, f"{record.spec} with the measured best layout")
    m = best["measured"]
    header = [
        f"# Layout measured by `trainctl tune` on {time.strftime('%Y-%m-%d %H:%M %Z')}: the fastest of the "
        f"{len(record.layouts)} best layouts",
        f"# `plan --auto` ranked, each run for {record.steps} steps in {root.absolute()}",
        f"# ({best['dir']}, plan rank {best['predicted_rank']}; the table: {root.absolute() / tr.RESULT}).",
        f"# Measured: median step {m['step_time_s']:.4g} s, {m['tokens_per_s']:,.0f} tokens/s over "
        f"{m['steady_steps']} steady steps (the first step of each attempt left out).",
        f"# The spec {record.spec}",
        *(f"#   --set {s}" for s in record.sets),
        "# with its parallel.* and train.recompute replaced by the measured best's.",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(data, sort_keys=False)


def write_result(root: Path, result: dict[str, Any]) -> None:
    import json

    from trainctl.fileio import write_atomic

    write_atomic(root / tr.RESULT, json.dumps(result, indent=2) + "\n")

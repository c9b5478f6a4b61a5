"""Where the time of a median step went, as the ranks measured it: compute, the collectives and pipeline waits
inside the step, the DP gradient sync, the data-loader wait (each a part of the measured step, so they add
up to it), checkpoint blocking per save (outside the step) and start-up. The plan's pipeline bubble and
exposed communication are shown beside them, labelled as predicted: a prediction is never subtracted from a
measurement (a calibrated plan's 390 ms of communication taken from a 370 ms measured step left "-17 ms of
compute"). Part by part against the plan: report/step_vs_plan.py."""

from __future__ import annotations

from typing import Any

from trainctl.report.attempts import median
from trainctl.report.load import RunData
from trainctl.report.summary import other_hardware

# the measured parts of a step, as measured_components names them -> the breakdown's row name
MEASURED_ROWS = {
    "compute": "compute (measured: the step minus the waits below)",
    "collectives (TP, CP, EP)": "TP/CP/EP collectives + wait (measured)",
    "pipeline bubble + point-to-point": "pipeline waits: bubble + point-to-point (measured)",
    "DP gradient sync (exposed)": "gradient sync + wait (measured)",
    "data-loader wait": "data-loader wait (measured)",
}


def _frac(x: float | None, step: float | None) -> float | None:
    return x / step if x is not None and step else None


def data_wait(steady: list[dict[str, Any]]) -> float | None:
    """Median data-loader wait of a step (metrics `data_wait_s`, rank 0's; inside the step)."""
    return median([float(r["data_wait_s"]) for r in steady if r.get("data_wait_s") is not None])


def checkpoint_blocks(run: RunData) -> list[float]:
    """Seconds each blocking checkpoint save held the ranks (metrics `ckpt_block_s`; outside the step)."""
    return [float(r["ckpt_block_s"]) for r in run.metrics if r.get("ckpt_block_s")]


def _steady_rows(run: RunData) -> dict[int, list[dict[str, Any]]]:
    """Each rank's step rows of every start the run (or the segment of it: report/layouts.py) holds, without
    each start's first step (warm-up) when three or more remain: the rule of the summary's steps
    (summary.steady_steps), so both medians are of the same steps."""
    out = {}
    for rank, rs in run.steptimes.items():
        starts = sorted({r["attempt"] for r in rs.rows})
        by_start = [[r for r in rs.rows if r["attempt"] == a] for a in starts]
        steady = [r for rows in by_start for r in rows[1:]]
        rows = steady if len(steady) >= 3 else rs.rows
        if rows:
            out[rank] = rows
    return out


def measured_components(run: RunData, steady: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Seconds per part of a median step, mean over ranks, all measured (they add up to the measured step);
    None without per-rank step times."""
    rows = _steady_rows(run)
    if not rows:
        return None
    data = data_wait(steady) or 0.0
    has_pp = all("pp_s" in r for rs in rows.values() for r in rs)

    def mean_over_ranks(field: str) -> float:
        meds = [median([float(r.get(field) or 0.0) for r in rs]) or 0.0 for rs in rows.values()]
        return sum(meds) / len(meds)

    step, sync, comm = mean_over_ranks("step_s"), mean_over_ranks("sync_s"), mean_over_ranks("comm_s")
    pp = mean_over_ranks("pp_s") if has_pp else None
    parts = {
        # medians of the parts need not add up to the median step exactly: a few microseconds either way
        "compute": max(0.0, step - sync - comm - data),
        "collectives (TP, CP, EP)": comm - (pp or 0.0) if has_pp else comm,
        "pipeline bubble + point-to-point": pp,
        "DP gradient sync (exposed)": sync,
        "data-loader wait": data,
    }
    return {"step_time_s": step, "components_s": parts, "ranks": len(rows),
            "note": None if has_pp else "collectives and pipeline waits are one figure in this run (no pp_s: "
                                        "written by an older trainctl); compute is still separated"}


def _predicted(run: RunData) -> list[dict[str, Any]]:
    """The plan's pipeline bubble and exposed communication, in the plan's own seconds (never subtracted)."""
    plan = run.plan or {}
    if not plan:
        return []
    pred = plan.get("prediction") or {}
    pipe = plan.get("pipeline") or {}
    comm = (plan.get("communication") or {}).get("per_kind") or {}
    planned_step = pred.get("step_time_s")
    items: list[dict[str, Any]] = []
    mismatch = other_hardware(run)  # the plan's times are another machine's (report/summary.py)
    bubble = pipe.get("bubble_fraction") if ((plan.get("layout") or {}).get("pp") or 1) > 1 else None
    if bubble is not None and not mismatch:
        items.append({"name": "pipeline bubble (predicted)", "kind": "predicted", "fraction": bubble,
                      "seconds": bubble * planned_step if planned_step else None,
                      "source": "plan: (p-1)/(v*m+p-1) of the planned step"})
    if mismatch:
        exposed = None
        src = (f"not comparable: planned for {(plan.get('hardware') or {}).get('gpu')}, ran on the CPU")
    elif pred.get("dp_exposed_s") is not None:
        exposed = sum(pred.get(k) or 0.0 for k in ("tp_exposed_s", "p2p_s", "dp_exposed_s", "embedding_sync_s"))
        src = "plan: TP (not overlapped) + pipeline p2p + exposed DP + tied-embedding sync"
    elif comm:  # no compute estimate (CPU): the DP overlap is unknown, so count all of it (an upper bound)
        exposed = sum((comm.get(k) or {}).get("seconds") or 0.0 for k in comm)
        src = "plan: all communication at the catalog link rate, an upper bound (no overlap estimate without a peak)"
    else:
        return items
    items.append({"name": "exposed communication (predicted)", "kind": "predicted", "seconds": exposed,
                  "fraction": _frac(exposed, planned_step), "source": src})
    return items


def time_breakdown(run: RunData, steady: list[dict[str, Any]], step: float | None,
                   startup_s: float | None) -> dict[str, Any]:
    measured = measured_components(run, steady)
    items: list[dict[str, Any]] = []
    if measured is not None:
        step = measured["step_time_s"]  # the parts are the ranks' own: held against their own step
        for part, seconds in measured["components_s"].items():
            if seconds is None or (part == "pipeline bubble + point-to-point" and not seconds):
                continue
            items.append({"name": MEASURED_ROWS[part], "kind": "measured", "seconds": seconds,
                          "fraction": _frac(seconds, step), "source": "per-rank step times, mean over "
                          f"{measured['ranks']} ranks"})
    else:  # no per-rank step times (an older trainctl): only the data wait is known inside the step
        data = data_wait(steady)
        rest = step - (data or 0.0) if step else None
        items += [{"name": MEASURED_ROWS["data-loader wait"], "kind": "measured", "seconds": data,
                   "fraction": _frac(data, step), "source": "metrics data_wait_s" if data is not None
                   else "not recorded"},
                  {"name": "compute and the rest (measured: the step minus the data wait)", "kind": "measured",
                   "seconds": rest, "fraction": _frac(rest, step), "source": "no per-rank step times"}]
    a2a = median([float(r["moe"]["a2a_s"]) for r in steady if r.get("moe")])
    if a2a is not None:
        items.append({"name": "EP all-to-all (measured)", "kind": "measured", "source": "metrics moe.a2a_s: "
                      "dispatch and combine, forward and backward, mean over ranks, including waiting for peers "
                      "(a part of the collectives above)", "seconds": a2a, "fraction": _frac(a2a, step)})
    ck = checkpoint_blocks(run)
    items.append({"name": "checkpoint blocking (measured)", "kind": "measured",
                  "source": (f"metrics ckpt_block_s, {len(ck)} saves, {sum(ck):.3f} s in all" if ck
                             else "no blocking save recorded"),
                  "seconds": (sum(ck) / len(ck)) if ck else (0.0 if _has(run, "ckpt_block_s") else None),
                  "fraction": None, "per": "save"})
    items += _predicted(run)
    return {"step_time_s": step, "items": items, "startup_s": startup_s,
            "ranks": measured["ranks"] if measured else None}


def _has(run: RunData, key: str) -> bool:
    return any(key in r for r in run.metrics)

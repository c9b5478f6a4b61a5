"""Where the time of a median step went: the plan's estimated pipeline bubble and exposed communication next
to what was measured (data-loader wait, gradient-sync wait, checkpoint blocking), plus start-up time."""

from __future__ import annotations

from typing import Any

from trainctl.report.attempts import median
from trainctl.report.load import RunData
from trainctl.report.summary import other_hardware


def _frac(x: float | None, step: float | None) -> float | None:
    return x / step if x is not None and step else None


def data_wait(steady: list[dict[str, Any]]) -> float | None:
    """Median data-loader wait of a step (metrics `data_wait_s`, rank 0's; inside the step)."""
    return median([float(r["data_wait_s"]) for r in steady if r.get("data_wait_s") is not None])


def checkpoint_blocks(run: RunData) -> list[float]:
    """Seconds each blocking checkpoint save held the ranks (metrics `ckpt_block_s`; outside the step)."""
    return [float(r["ckpt_block_s"]) for r in run.metrics if r.get("ckpt_block_s")]


def time_breakdown(run: RunData, steady: list[dict[str, Any]], step: float | None,
                   startup_s: float | None) -> dict[str, Any]:
    plan = run.plan or {}
    pred = plan.get("prediction") or {}
    pipe = plan.get("pipeline") or {}
    layout = plan.get("layout") or {}
    comm = (plan.get("communication") or {}).get("per_kind") or {}
    items: list[dict[str, Any]] = []

    bubble_frac = pipe.get("bubble_fraction") if (layout.get("pp") or 1) > 1 else 0.0
    if bubble_frac is not None:
        est = bubble_frac * step if step else None
        items.append({"name": "pipeline bubble", "source": "plan: (p-1)/(v*m+p-1) of the measured step",
                      "seconds": est, "fraction": bubble_frac})

    if other_hardware(run):  # the plan's link times are another machine's (report/summary.py)
        exposed = None
        src = f"not comparable: planned for {(plan.get('hardware') or {}).get('gpu')}, ran on the CPU"
    elif pred.get("dp_exposed_s") is not None:
        exposed = sum(pred.get(k) or 0.0 for k in ("tp_exposed_s", "p2p_s", "dp_exposed_s", "embedding_sync_s"))
        src = "plan: TP (not overlapped) + pipeline p2p + exposed DP + tied-embedding sync"
    elif comm:  # no compute estimate (CPU): the DP overlap is unknown, so count all of it (an upper bound)
        exposed = sum((comm.get(k) or {}).get("seconds") or 0.0 for k in comm)
        src = "plan: all communication at the catalog link rate (no overlap estimate without a peak)"
    else:
        exposed = None
        src = "no plan"
    items.append({"name": "exposed communication", "source": src, "seconds": exposed,
                  "fraction": _frac(exposed, step)})

    sync = _rank0_sync(run)
    if sync is not None:
        items.append({"name": "gradient sync + wait (measured)", "source": "rank 0: DP sync and final all-reduce, "
                      "including waiting for peers", "seconds": sync, "fraction": _frac(sync, step)})
    a2a = median([float(r["moe"]["a2a_s"]) for r in steady if r.get("moe")])
    if a2a is not None:
        items.append({"name": "EP all-to-all (measured)", "source": "metrics moe.a2a_s: dispatch and combine, "
                      "forward and backward, mean over ranks, including waiting for peers", "seconds": a2a,
                      "fraction": _frac(a2a, step)})
    data = data_wait(steady)
    items.append({"name": "data-loader wait (measured)", "source": "metrics data_wait_s" if data is not None else
                  "not recorded", "seconds": data, "fraction": _frac(data, step)})
    ck = checkpoint_blocks(run)
    items.append({"name": "checkpoint blocking (measured)", "source": (f"metrics ckpt_block_s, {len(ck)} saves, "
                  f"{sum(ck):.3f} s in all" if ck else "no blocking save recorded"),
                  "seconds": (sum(ck) / len(ck)) if ck else (0.0 if _has(run, "ckpt_block_s") else None),
                  "fraction": None, "per": "save"})
    known = sum(i["seconds"] or 0.0 for i in items if i.get("per") != "save" and "measured" not in i["name"])
    known += data or 0.0
    rest = step - known if step else None
    items.append({"name": "compute and the rest", "source": "measured step minus the above (plan terms + data)",
                  "seconds": rest, "fraction": _frac(rest, step)})
    return {"step_time_s": step, "items": items, "startup_s": startup_s}


def _has(run: RunData, key: str) -> bool:
    return any(key in r for r in run.metrics)


def _rank0_sync(run: RunData) -> float | None:
    rs = run.steptimes.get(0)
    if not rs or not rs.rows:
        return None
    return median([float(r.get("sync_s") or 0.0) for r in rs.rows[1:] or rs.rows])

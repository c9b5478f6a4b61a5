"""Stragglers: ranks whose own step work is persistently above the median rank's of their pipeline stage, from
the per-rank step times every rank writes (trainctl/runtime/observe/stragglers.py); the comparison itself is
trainctl/rundir/steptimes.py's, which the exclusion of straggling nodes also uses.

A rank's busy time is step_s - sync_s - comm_s: its step minus the time it spent in the gradient sync and
final all-reduce, in tensor-parallel collectives and in pipeline receives, where it waits for slower peers.
In a synchronous job every step is gated by the slowest rank, so a straggler's cost per step is its busy
time minus that of the next-slowest rank: what the step would have saved had it kept up. Runs written
before comm_s was recorded cannot separate TP/PP waits; their flagged ranks are grouped by DP replica.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from trainctl.report.attempts import median
from trainctl.report.load import RunData
from trainctl.rundir.paths import LOGS, STEPTIMES
from trainctl.rundir.steptimes import ABS_THRESHOLD_S, PERSISTENT, REL_THRESHOLD, busy_s, compare_in_stage

GROUP_NOTE = ("slow together: one data-parallel replica whose TP/PP peers wait for its slowest rank inside "
              "TP/PP collectives, which this run's step times do not separate (no comm_s: written by an older "
              "trainctl); the straggler is one of these ranks")


def where(run: RunData, rank: int) -> dict[str, Any]:
    """Node and GPU of a rank: RUN/placement.json (what the ranks reported at start-up), else the rank's own
    step-time header (host, local rank, device), else the plan's placement."""
    out: dict[str, Any] = {"rank": rank}
    rs = run.steptimes.get(rank)
    if rs and rs.headers:
        h = rs.headers[-1]
        out.update(host=h.get("host"), local_rank=h.get("local_rank"), device=h.get("device"))
    placed = next((p for p in run.placement if p.get("rank") == rank), None)
    if placed:
        node = placed.get("node")
        if isinstance(node, str):  # placement.json: the node name the rank reported
            out["host"] = node
        elif node is not None:
            out.setdefault("host", f"node {node}")
        gpu = placed.get("gpu", placed.get("local_gpu"))
        if gpu is not None:
            out["gpu"] = gpu
        out.setdefault("local_rank", placed.get("local_rank"))
        out["coords"] = {k: placed[k] for k in ("tp", "dp", "pp") if k in placed}
    return out


def describe(loc: dict[str, Any]) -> str:
    bits = [f"rank {loc['rank']}"]
    if loc.get("host"):
        bits.append(f"on {loc['host']}")
    dev = loc.get("device") or ""
    if dev.startswith("cuda"):
        gpu = loc.get("gpu")
        bits.append(f"GPU {gpu if gpu is not None else dev.partition(':')[2]}")
    elif loc.get("local_rank") is not None:
        bits.append(f"local rank {loc['local_rank']} ({dev or 'cpu'})")
    if loc.get("coords"):
        bits.append("(" + " ".join(f"{k}{v}" for k, v in loc["coords"].items()) + ")")
    return " ".join(bits)


def _groups(flagged: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Flagged ranks of one DP replica (same dp coordinate) form one group: with TP/PP a slow rank makes its
    TP and pipeline peers wait inside the forward/backward, so they all look busy."""
    by: dict[Any, list[dict[str, Any]]] = {}
    for p in flagged:
        dp = (p.get("coords") or {}).get("dp")
        by.setdefault(("dp", dp) if dp is not None else ("rank", p["rank"]), []).append(p)
    return list(by.values())


def stragglers(run: RunData) -> dict[str, Any]:
    if not run.steptimes:
        return {"available": False, "note": f"no per-rank step times (RUN/{LOGS}/{STEPTIMES.format(rank='*')})"}
    # (attempt, step) -> rank -> busy seconds
    busy: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    comm_known = True  # every row says how long the rank waited in TP/PP communication
    for rank, rs in run.steptimes.items():
        for row in rs.rows:
            comm_known = comm_known and "comm_s" in row
            busy[(row["attempt"], row["step"])][rank] = busy_s(row)
    ranks = sorted(run.steptimes)
    firsts = {min(k for k in busy if k[0] == a) for a in {k[0] for k in busy}}  # warm-up step of each attempt
    steps = [k for k, v in busy.items() if len(v) == len(ranks) and len(ranks) > 1 and k not in firsts]
    if not steps:
        return {"available": False, "note": "fewer than two ranks with step times for the same steps"}
    stage_of = {r: int((where(run, r).get("coords") or {}).get("pp") or 0) for r in ranks}
    cmp = compare_in_stage({k: busy[k] for k in steps}, stage_of)
    above, excess, medians = cmp.above, cmp.excess, cmp.medians
    per_rank = [{**where(run, r), "busy_median_s": median([busy[k][r] for k in steps]),
                 "excess_median_s": median(excess[r]), "steps_above": above.get(r, 0),
                 "fraction_above": above.get(r, 0) / len(steps)} for r in ranks]
    flagged = [p for p in per_rank if p["fraction_above"] >= PERSISTENT]
    slow_ids = {p["rank"] for p in flagged}
    others = [r for r in ranks if r not in slow_ids]
    total_steps = sum(float(x["step_s"]) for x in run.steptimes[ranks[0]].rows)
    groups = []
    for members in (_groups(flagged) if not comm_known else [[p] for p in flagged]):
        ids = sorted(p["rank"] for p in members)
        # What the steps would have saved had this group kept up with the ranks that are not slow.
        cost = 0.0
        for k in steps:
            ref = max(busy[k][r] for r in others) if others else (median(list(busy[k].values())) or 0.0)
            cost += max(0.0, max(busy[k][r] for r in ids) - ref)
        slowest = max(members, key=lambda p: p["busy_median_s"])
        groups.append({**slowest, "ranks": ids, "where": "; ".join(describe(p) for p in members),
                       "cost_s": cost, "cost_fraction": cost / total_steps if total_steps else None,
                       "note": None if len(members) == 1 else GROUP_NOTE})
    groups.sort(key=lambda g: -g["cost_s"])
    feet = [f for rs in run.steptimes.values() for f in rs.footers if f.get("steps")]
    return {
        "logging_overhead_s_per_step": (max(f["overhead_s"] / f["steps"] for f in feet) if feet else None),
        "available": True, "ranks": len(ranks), "steps_sampled": len(steps),
        "median_busy_s": median(medians),
        "stragglers": groups,
        "per_rank": per_rank,
        "criterion": (f"busy time (step - gradient sync - TP/PP communication waits) more than {REL_THRESHOLD:.0%} and "
                      f"{ABS_THRESHOLD_S * 1e3:.0f} ms above the median rank of its pipeline stage in at least "
                      f"{PERSISTENT:.0%} of steps"),
    }

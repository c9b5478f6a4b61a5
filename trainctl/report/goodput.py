"""Goodput: productive step time / wall time of the whole run across restarts, resumes and requeues, with
the lost time attributed (queueing, start-up, restarts, replayed steps, checkpoint stalls, shutdown).

Productive time counts each step once, at its last occurrence: a step that appears twice in metrics.jsonl
was run again by a later attempt (after a failure the job resumes from the last checkpoint), so its earlier
run is lost work ("replayed"). The restart gap of an attempt runs from the previous attempt's last logged
step to this attempt's first step: the failed partial step, failure detection, teardown, re-spawn, init
and checkpoint load.
"""

from __future__ import annotations

from typing import Any

from trainctl.report.attempts import Attempt, log_weight
from trainctl.report.load import RunData
from trainctl.rundir import EVENTS

QUEUE_EVENTS = ("submit", "submitted", "requeue", "requeued")
RUN_EVENTS = ("launch", "start", "job_start")


def _t(records: list[dict[str, Any]], key: str, weight: int) -> float:
    return sum(float(r.get(key) or 0.0) for r in records) * (weight if key == "step_time_s" else 1)


def queue_intervals(run: RunData) -> list[tuple[float, float]]:
    """(submitted, started) for each submit/requeue event followed by a launch/start event: time in the queue."""
    out = []
    for q in run.events_of(*QUEUE_EVENTS):
        nxt = next((e for e in run.events_of(*RUN_EVENTS) if e.get("time", 0) >= q.get("time", 0)), None)
        if nxt is not None:
            out.append((float(q["time"]), float(nxt["time"])))
    return out


def _queueing(run: RunData) -> tuple[float, bool]:
    """Seconds queued in all; known only if recorded."""
    spans = queue_intervals(run)
    return sum(b - a for a, b in spans), bool(spans)


def describe_cause(prev: Attempt) -> str:
    hangs: dict[Any, dict[str, Any]] = {}  # the first of each hung rank's: each rank that waited may name it
    for e in prev.end_events:
        if e.get("event") == "hang":
            hangs.setdefault(e.get("rank"), e)
    if hangs:
        return "; ".join(f"rank {h.get('rank')} hung after step {h.get('step')} (watchdog: no progress for "
                         f"{h.get('idle_s', 0):.0f} s)" for h in hangs.values())
    fails = [e for e in prev.end_events if e.get("event") == "failure"]
    if fails:
        by_error: dict[str, list[str]] = {}
        for f in fails:
            by_error.setdefault(str(f.get("error", "unknown error")), []).append(str(f.get("rank", "?")))
        return "; ".join(f"rank {', '.join(ranks)} failed: {err}" for err, ranks in by_error.items())
    pre = [e for e in prev.end_events if e.get("event") in ("preempted", "preemption", "cancelled")]
    if pre:
        return f"{pre[0]['event']}" + (f": {pre[0].get('reason')}" if pre[0].get("reason") else "")
    if prev.outcome == "finished":
        return "resumed after the previous attempt finished (more steps)"
    return "interrupted with no failure recorded (killed, preempted or the node went away)"


def goodput(run: RunData, attempts: list[Attempt], final: list[dict[str, Any]],
            replayed: list[dict[str, Any]]) -> dict[str, Any]:
    w = log_weight(run)
    times = [e["time"] for e in run.events if "time" in e] + [float(m["time"]) for m in run.metrics if "time" in m]
    if not times:
        return {"available": False, "note": f"no timestamps in {EVENTS}"}
    begin = min(t for t in [attempts[0].begin_t, *times] if t is not None)
    end = max(times)
    wall = end - begin
    productive = _t(final, "step_time_s", w)
    queue, queue_known = _queueing(run)
    lost: dict[str, float | None] = {"queueing": queue if queue_known else None, "startup": None,
                                     "restarts": 0.0, "replayed_steps": _t(replayed, "step_time_s", w),
                                     "checkpoint_stalls": _t(run.metrics, "ckpt_block_s", 1), "shutdown": None}
    restarts: list[dict[str, Any]] = []
    prev_end: float | None = None
    for a in attempts:
        fb = a.first_step_begin()
        if a.index == 0 and fb is not None:
            lost["startup"] = max(0.0, fb - begin - (queue if queue_known else 0.0))
        if a.index > 0:
            gap = (fb - prev_end) if fb is not None and prev_end is not None else None
            if gap is not None:
                lost["restarts"] = (lost["restarts"] or 0.0) + gap
            replay = [r for r in a.records if any(r["step"] == x["step"] for x in replayed)]
            cause = describe_cause(attempts[a.index - 1])
            lo, hi = attempts[a.index - 1].start_t or float("-inf"), a.start_t or float("inf")
            resized = [e for e in run.events_of("elastic_resize") if lo < float(e.get("time", lo)) <= hi]
            if resized:  # an elastic run went on with the nodes left (report/nodes.py)
                cause = f"{resized[-1].get('message')}, after: {cause}"
            restarts.append({"attempt": a.index, "cause": cause,
                             "resumed_at_step": a.records[0]["step"] - 1 if a.records else None,
                             "gap_s": gap, "replayed_steps": len(replay)})
        prev_end = a.last_step_end() or prev_end
    if prev_end is not None:
        lost["shutdown"] = max(0.0, end - prev_end)
    accounted = productive + sum(v for v in lost.values() if v)
    lost["other"] = max(0.0, wall - accounted)
    last = attempts[-1]
    return {
        "available": True, "begin_time": begin, "wall_s": wall, "productive_s": productive,
        "goodput": productive / wall if wall > 0 else None,
        "lost_s": lost, "attempts": len(attempts), "restarts": restarts, "final_outcome": last.outcome,
        "note": ("productive = each step's time once (its last run); lost = everything else on the wall clock "
                 "from the first launch to the last event"),
    }

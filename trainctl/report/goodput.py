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
from trainctl.rundir.paths import EVENTS
from trainctl.rundir.runstate import SECONDARY, outcome

QUEUE_EVENTS = ("submit", "submitted", "requeue", "requeued")
# the job left the queue: the local launcher's start, the Slurm batch script's first line (slurm_start), or the
# trainer's start where neither is recorded; start-up runs from there to the first step
RUN_EVENTS = ("launch", "slurm_start", "start", "job_start")
# what `trainctl resume` writes before its attempt begins: the user's resume, which ends an idle wait
RESUME_EVENTS = ("resume_requested", "spec_changed", "checkpoint_abandoned", "data_changed", "resume", "submit")
USER_ENDED = ("finished", "stopped", "cancelled")  # outcomes the user wanted: the wait after them is not lost


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


def idle_wait(prev: Attempt) -> tuple[float, float] | None:
    """(ended, resumed): the run waited for its user between an attempt that ended as asked (every step done,
    or stopped/cancelled on request) and the `trainctl resume` that began the next. Not lost to a failure."""
    if prev.outcome not in USER_ENDED:
        return None
    t0 = prev.start_t if prev.start_t is not None else float("-inf")
    resumed = min((float(e["time"]) for e in prev.events if e.get("event") in RESUME_EVENTS
                   and float(e.get("time", t0)) > t0), default=None)
    if resumed is None:
        return None
    ended = max((float(e["time"]) for e in prev.events if "time" in e and float(e["time"]) < resumed), default=None)
    return (ended, resumed) if ended is not None and resumed > ended else None


def waits_before_start(run: RunData, begin: float, first: float) -> list[tuple[float, float]]:
    """(ended, resumed) for each launch the user stopped or cancelled before any trainer started, and the
    `trainctl resume` that followed: the run waited for its user, as idle_wait says of a started attempt."""
    out: list[tuple[float, float]] = []
    asked, last = False, None
    for e in sorted((e for e in run.events if "time" in e and begin <= float(e["time"]) < first),
                    key=lambda e: float(e["time"])):
        if e.get("event") in ("stop_requested", "cancel_requested"):
            asked = True
        elif e.get("event") in RESUME_EVENTS and asked and last is not None:
            out.append((last, float(e["time"])))
            asked = False
        last = float(e["time"])
    return out


def _overlap(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)


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
        # a rank that only lost its peer ("connection reset by peer") did not fail of itself: said so, and after
        # the ranks that did (runstate's first cause: the one whose error was not another's consequence)
        lost = {err: bool(SECONDARY.search(err)) for err in by_error}
        return "; ".join(f"rank {', '.join(by_error[err])} {'lost a peer' if lost[err] else 'failed'}: {err}"
                         for err in sorted(by_error, key=lambda err: lost[err]))
    if prev.asked_to_stop is not None:  # Ctrl-C, SIGTERM to the launcher, `trainctl cancel`: runstate's words;
        ended = outcome(prev.events)  # the ranks' "preempted" event only names the SIGTERM they got
        return ended.reason if ended is not None else "stopped on request"
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
    idle_s = 0.0
    queued = queue_intervals(run)
    for a in attempts:
        fb = a.first_step_begin()
        if a.index == 0 and fb is not None:
            waits = waits_before_start(run, begin, fb)
            idle_s += sum(b - a for a, b in waits)
            lost["startup"] = max(0.0, fb - begin - _overlap(queued, begin, fb) - sum(b - a for a, b in waits))
        if a.index > 0:
            wait = idle_wait(attempts[a.index - 1])
            idle = wait[1] - wait[0] if wait else 0.0
            idle_s += idle
            gap = (fb - prev_end) if fb is not None and prev_end is not None else None
            if gap is not None:  # the restart itself: the gap without the user's wait and the queue
                gap -= idle + _overlap(queued, prev_end, fb)
                lost["restarts"] = (lost["restarts"] or 0.0) + gap
            replay = [r for r in a.records if any(r["step"] == x["step"] for x in replayed)]
            cause = describe_cause(attempts[a.index - 1])
            lo, hi = attempts[a.index - 1].start_t or float("-inf"), a.start_t or float("inf")
            resized = [e for e in run.events_of("elastic_resize") if lo < float(e.get("time", lo)) <= hi]
            if resized:  # an elastic run went on with the nodes left (report/nodes.py)
                cause = f"{resized[-1].get('message')}, after: {cause}"
            failed = attempts[a.index - 1].outcome not in USER_ENDED  # a stop or finish the user asked for is not
            restarts.append({"attempt": a.index, "cause": cause, "failure": failed,
                             "resumed_at_step": a.records[0]["step"] - 1 if a.records else None,
                             "gap_s": gap, "replayed_steps": len(replay), "replayed_s": _t(replay, "step_time_s", w),
                             "idle_s": idle, "idle": wait})
        prev_end = a.last_step_end() or prev_end
    if prev_end is not None:
        lost["shutdown"] = max(0.0, end - prev_end)
    accounted = productive + idle_s + sum(v for v in lost.values() if v)
    lost["other"] = max(0.0, wall - accounted)
    last = attempts[-1]
    meant = wall - idle_s  # the time the run was meant to be running
    return {
        "available": True, "begin_time": begin, "wall_s": wall, "productive_s": productive,
        "idle_s": idle_s,  # waiting for the user's resume after a finished or stopped attempt: not lost
        "goodput": productive / meant if meant > 0 else None,
        "lost_s": lost, "attempts": len(attempts), "restarts": restarts, "final_outcome": last.outcome,
        "note": ("productive = each step's time once (its last run); lost = everything else on the wall clock "
                 "from the first launch to the last event, except the idle waits for a resume after a finished or "
                 "stopped attempt (goodput = productive / (wall - idle))"),
    }

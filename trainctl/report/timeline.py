"""The run on the wall clock: what each second from the first launch to the last event was spent on.

Segments, in seconds since the run began (goodput's `begin_time`), one list for the whole run across its
attempts: queueing (submit/requeue -> start), start-up (launch -> first step), restart (the previous
attempt's last step -> this attempt's first: failure detection, re-spawn, init, checkpoint load), idle (a
finished or stopped attempt waiting for its user's resume: not lost), each logged step as productive (its
last run) or replayed (run again by a later attempt), checkpoint stalls (blocking saves; a metrics line's
`ckpt_block_s` is the blocking since the previous line, so it sits just before the step it is logged with)
and shutdown (last step -> last event). Time in none of them (the interval between logged steps when
train.log_every > 1, teardown of a failed attempt) is left blank. The kinds are goodput's, so the picture
and the table add up to the same seconds.
"""

from __future__ import annotations

from typing import Any

from trainctl.report.attempts import Attempt, log_weight
from trainctl.report.goodput import queue_intervals
from trainctl.report.load import RunData

# drawing order and names; the plot's legend follows it
KINDS = ("productive", "replayed", "checkpoint", "startup", "restart", "queueing", "shutdown", "idle")


def _span(kind: str, start: float, end: float, attempt: int, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "start": start, "end": end, "attempt": attempt, **extra}


def timeline(run: RunData, attempts: list[Attempt], final: list[dict[str, Any]],
             gp: dict[str, Any]) -> dict[str, Any]:
    if not gp.get("available"):
        return {"available": False, "note": gp.get("note")}
    t0 = float(gp["begin_time"])
    w = log_weight(run)
    kept = {id(r) for r in final}
    spans: list[dict[str, Any]] = [_span("queueing", a - t0, b - t0, -1) for a, b in queue_intervals(run)]
    queued_until = max((s["end"] for s in spans), default=0.0)
    prev_end: float | None = None
    waits = {x["attempt"]: x["idle"] for x in gp.get("restarts", []) if x.get("idle")}
    for a in attempts:
        first = a.first_step_begin()
        if first is not None:
            if a.index == 0:
                spans.append(_span("startup", min(queued_until, first - t0), first - t0, 0))
            elif prev_end is not None:
                wait = waits.get(a.index)
                if wait:  # the run waited for its user's resume: idle, not a restart (report/goodput.py)
                    spans.append(_span("restart", prev_end - t0, wait[0] - t0, a.index))
                    spans.append(_span("idle", wait[0] - t0, wait[1] - t0, a.index))
                    spans.append(_span("restart", wait[1] - t0, first - t0, a.index))
                else:
                    spans.append(_span("restart", prev_end - t0, first - t0, a.index))
        for r in a.records:
            if "time" not in r:
                continue
            end = float(r["time"]) - t0
            begin = end - float(r.get("step_time_s") or 0.0) * w
            spans.append(_span("productive" if id(r) in kept else "replayed", begin, end, a.index, step=r["step"]))
            stall = float(r.get("ckpt_block_s") or 0.0)
            if stall > 0:
                spans.append(_span("checkpoint", begin - stall, begin, a.index, step=r["step"]))
        prev_end = a.last_step_end() or prev_end
    wall = float(gp["wall_s"])
    if prev_end is not None and prev_end - t0 < wall:
        spans.append(_span("shutdown", prev_end - t0, wall, attempts[-1].index))
    restarts = []
    for x in gp.get("restarts", []):
        first = attempts[x["attempt"]].first_step_begin()
        restarts.append({"attempt": x["attempt"], "at_s": None if first is None else first - t0, "cause": x["cause"]})
    totals = {k: sum(s["end"] - s["start"] for s in spans if s["kind"] == k) for k in KINDS}
    return {"available": True, "wall_s": wall, "spans": spans, "restarts": restarts, "seconds_by_kind": totals}

"""Split a run into attempts (one per trainer start: torchrun restarts, resumes, requeues) and find the
replayed steps. Pure functions over RunData."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from trainctl.report.load import RunData
from trainctl.rundir.runstate import stop_requested

BEGIN_EVENTS = ("launch", "submit", "submitted", "resume", "requeue", "requeued")
END_EVENTS = ("finish", "failure", "hang", "preempted", "preemption", "launcher_exit", "cancelled")


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


@dataclass
class Attempt:
    index: int
    start_t: float | None  # the trainer's "start" event (rank 0, after process-group init)
    begin_t: float | None = None  # launch/resume/submit event, else the previous attempt's end
    records: list[dict[str, Any]] = field(default_factory=list)
    end_events: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # every event from its start to the next start

    @property
    def asked_to_stop(self) -> dict[str, Any] | None:
        """The user's stop (Ctrl-C or SIGTERM at the launcher: stop_requested; `trainctl cancel`:
        cancel_requested). The ranks then record the SIGTERM they got as "preempted", which it was not."""
        return stop_requested(self.events)

    @property
    def outcome(self) -> str:
        kinds = {e.get("event") for e in self.end_events}
        asked = self.asked_to_stop
        if asked is not None and not kinds & {"hang", "failure"}:
            return "cancelled" if asked.get("event") == "cancel_requested" else "stopped"
        for k in ("hang", "failure", "preempted", "preemption", "cancelled"):
            if k in kinds:
                return "hang" if k == "hang" else ("failed" if k == "failure" else k)
        if "finish" in kinds:
            return "finished"
        return "interrupted" if self.end_events or self.records else "unknown"

    @property
    def end_t(self) -> float | None:
        times = [e["time"] for e in self.end_events if e.get("event") != "launcher_exit" and "time" in e]
        if times:
            return max(times)
        if self.records and "time" in self.records[-1]:
            return float(self.records[-1]["time"])
        return None

    def first_step_begin(self) -> float | None:
        """When the first step of this attempt began: its end time minus its duration."""
        if not self.records:
            return None
        r = self.records[0]
        if "time" in r:
            return float(r["time"]) - float(r["step_time_s"])
        finish = next((e["time"] for e in self.end_events if e.get("event") == "finish"), None)
        if finish is not None:  # old metrics without "time": the steps ran back to back before "finish"
            return float(finish) - sum(float(x["step_time_s"]) for x in self.records)
        return None

    def last_step_end(self) -> float | None:
        if self.records and "time" in self.records[-1]:
            return float(self.records[-1]["time"])
        finish = next((e["time"] for e in self.end_events if e.get("event") == "finish"), None)
        return float(finish) if finish is not None and self.records else None


def split_attempts(run: RunData) -> list[Attempt]:
    starts = sorted(e["time"] for e in run.events_of("start") if "time" in e)
    attempts = [Attempt(i, t) for i, t in enumerate(starts)] or [Attempt(0, None)]
    timed = bool(run.metrics) and all("time" in m for m in run.metrics)
    if timed and starts:
        for m in run.metrics:
            began = float(m["time"]) - float(m.get("step_time_s", 0.0))
            idx = max(0, sum(1 for t in starts if t <= began + 1e-6) - 1)
            attempts[idx].records.append(m)
    else:  # no timestamps: a step number that does not increase starts the next attempt
        idx, prev = 0, None
        for m in run.metrics:
            if prev is not None and m["step"] <= prev:
                idx += 1
                if idx >= len(attempts):
                    attempts.append(Attempt(idx, None))
            attempts[idx].records.append(m)
            prev = m["step"]
    bounds = [a.start_t for a in attempts]
    for a in attempts:
        lo = a.start_t if a.start_t is not None else float("-inf")
        nxt = next((b for b in bounds[a.index + 1:] if b is not None), float("inf"))
        a.end_events = [e for e in run.events_of(*END_EVENTS) if lo <= e.get("time", lo) < nxt]
        a.events = [e for e in run.events if lo <= e.get("time", lo) < nxt]
        prev_start = bounds[a.index - 1] if a.index > 0 and bounds[a.index - 1] is not None else float("-inf")
        hi = a.start_t if a.start_t is not None else float("inf")
        begins = [e["time"] for e in run.events_of(*BEGIN_EVENTS) if prev_start < e.get("time", hi) <= hi]
        if begins:
            a.begin_t = min(begins) if a.index == 0 else max(begins)
        elif a.index > 0:
            a.begin_t = attempts[a.index - 1].end_t
    # what the user asked of an attempt belongs to it from its launch or resume on, not only from the trainer's
    # start: a Ctrl-C while the ranks were still starting stopped that attempt, it did not fail
    opened = [min(t for t in (a.begin_t, a.start_t) if t is not None) if a.start_t is not None else None
              for a in attempts]
    for a in attempts:
        if a.start_t is None or opened[a.index] is None:
            continue
        nxt = next((t for t in opened[a.index + 1:] if t is not None), float("inf"))
        a.events = [e for e in run.events if opened[a.index] <= e.get("time", opened[a.index]) < nxt]
    return attempts


def log_weight(run: RunData) -> int:
    """Steps each metrics line stands for (train.log_every)."""
    train = (run.spec or {}).get("train") or {}
    return max(1, int(train.get("log_every", 1) or 1))


def final_and_replayed(attempts: list[Attempt]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the last occurrence of every step, the earlier occurrences that a later attempt ran again)."""
    last_seen: dict[int, tuple[int, int]] = {}
    flat = [(a.index, i, r) for a in attempts for i, r in enumerate(a.records)]
    for a_idx, i, r in flat:
        last_seen[r["step"]] = (a_idx, i)
    final, replayed = [], []
    for a_idx, i, r in flat:
        (final if last_seen[r["step"]] == (a_idx, i) else replayed).append(r)
    final.sort(key=lambda r: r["step"])
    return final, replayed

"""Per-rank step times (RUN/logs/steptimes-rank<N>.jsonl, written by trainctl/runtime/observe/stragglers.py): reading
them, a rank's own work in a step, which ranks do the same work, and which nodes are persistent stragglers.
No torch. The report's straggler section (report/stragglers.py) and the exclusion record (launch/exclusions.py)
both judge from here (docs/design/launch.md, "Preflight and node exclusion").

Ranks are compared only with ranks of the same pipeline stage: a stage's work differs by design (the last one
carries the LM head and the loss, the first the embedding), so a pipeline's last stage is not a straggler.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainctl.rundir.paths import RunPaths, read_jsonl

PERSISTENT = 0.75  # above the threshold in at least 3 of 4 sampled steps: noise is not persistent
REL_THRESHOLD = 0.10  # the report: 10% above the median rank's busy time of its stage ...
ABS_THRESHOLD_S = 0.005  # ... and at least 5 ms (timer and scheduler noise on a loaded host)
EXCLUDE_MARGIN = 0.5  # exclusion: busy 1.5x its stage's ranks on the other nodes (a clear margin) ...
MIN_STEPS = 5  # ... in PERSISTENT of at least this many steps of the run's last start


@dataclass
class RankSteps:
    """One rank's step-time file: headers (one per start of the rank) and step rows."""

    rank: int
    headers: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)  # each with "attempt": the index of its header
    footers: list[dict[str, Any]] = field(default_factory=list)  # {"steps", "overhead_s"} per clean end


def read(paths: RunPaths) -> dict[int, RankSteps]:
    """Every rank's step-time file of the run, by rank."""
    out: dict[int, RankSteps] = {}
    for rank, f in paths.steptimes_by_rank().items():
        rs = RankSteps(rank)
        attempt = 0
        for rec in read_jsonl(f):
            if rec.get("header"):
                rs.headers.append(rec)
                attempt = len(rs.headers) - 1  # per file: the n-th start of this rank
            elif rec.get("footer"):
                rs.footers.append(rec)
            elif "step" in rec and "step_s" in rec:
                rs.rows.append({**rec, "attempt": attempt})
        out[rank] = rs
    return out


def busy_s(row: Mapping[str, Any]) -> float:
    """A rank's own work in a step: the step minus its waits in the gradient sync and in TP/PP communication,
    where it waits for slower peers."""
    return float(row["step_s"]) - float(row.get("sync_s") or 0.0) - float(row.get("comm_s") or 0.0)


@dataclass(frozen=True)
class StageComparison:
    """Each rank's busy time against the median of its pipeline stage's ranks, per sampled step."""

    steps: int
    above: dict[int, int]  # rank -> steps more than the threshold above its stage's median
    excess: dict[int, list[float]]  # rank -> busy - its stage's median, per step
    medians: list[float]  # each step's median over the stage medians' ranks


def compare_in_stage(busy: Mapping[Any, Mapping[int, float]], stage_of: Mapping[int, int],
                     rel: float = REL_THRESHOLD, abs_s: float = ABS_THRESHOLD_S) -> StageComparison:
    """The report's view: per step, each rank against the median of its stage (itself included); a stage of
    one rank has nothing to compare with."""
    above: dict[int, int] = defaultdict(int)
    excess: dict[int, list[float]] = defaultdict(list)
    medians = []
    for row in busy.values():
        by_stage: dict[int, list[int]] = defaultdict(list)
        for r in row:
            by_stage[stage_of.get(r, 0)].append(r)
        medians.append(statistics.median(list(row.values())))
        for members in by_stage.values():
            med = statistics.median([row[r] for r in members])
            for r in members:
                excess[r].append(row[r] - med if len(members) > 1 else 0.0)
                if len(members) > 1 and row[r] - med > max(rel * med, abs_s):
                    above[r] += 1
    return StageComparison(len(busy), dict(above), dict(excess), medians)


@dataclass(frozen=True)
class SlowRank:
    """A rank busier than its stage's ranks on other nodes by the margin in most steps of a start."""

    rank: int
    node: str
    stage: int
    steps_above: int
    steps: int
    ratio: float  # median over steps of busy / the median of its peers

    def reason(self, margin: float) -> str:
        return (f"persistent straggler: rank {self.rank} (pipeline stage {self.stage}) worked {self.ratio:.1f}x "
                f"as long as its stage's ranks on other nodes, more than {1 + margin:.1f}x in {self.steps_above} "
                f"of {self.steps} steps of the run's last start")


def slow_ranks(busy: Mapping[int, Mapping[int, float]], where: Mapping[int, tuple[str, int]],
               margin: float = EXCLUDE_MARGIN, min_steps: int = MIN_STEPS) -> list[SlowRank]:
    """Ranks of one start whose busy time (step -> rank -> seconds) exceeds the median of their peers, the
    ranks of the same pipeline stage on *other* nodes (`where`: rank -> (node, stage)), by `margin` and 5 ms in
    PERSISTENT of at least `min_steps` steps. A node's own ranks are not its peers: a slow node slows them all."""
    out = []
    ranks = sorted(r for r in where if all(r in row for row in busy.values()))
    for r in ranks:
        node, stage = where[r]
        peers = [p for p in ranks if where[p][1] == stage and where[p][0] != node]
        if not peers or len(busy) < min_steps:
            continue
        above, ratios = 0, []
        for row in busy.values():
            ref = statistics.median([row[p] for p in peers])
            ratios.append(row[r] / ref if ref > 0 else float("inf"))
            if row[r] - ref > max(margin * ref, ABS_THRESHOLD_S):
                above += 1
        if above >= PERSISTENT * len(busy):
            out.append(SlowRank(rank=r, node=node, stage=stage, steps_above=above, steps=len(busy),
                                ratio=statistics.median(ratios)))
    return out


def last_start(events: list[dict[str, Any]], steptimes: Mapping[int, RankSteps]
               ) -> tuple[dict[int, dict[int, float]], dict[int, tuple[str, int]]]:
    """The busy times (step -> rank -> seconds, the start's warm-up step left out) and where each rank ran
    (rank -> (node, pipeline stage)) of the run's last trainer start, from its `placement` event. A rank's rows
    belong to it when its newest header is younger than the start before (headers are written after the
    placement is proven, and a rank of a bigger earlier world has none)."""
    placements = [e for e in events if e.get("event") == "placement" and e.get("ranks")]
    if not placements:
        return {}, {}
    last = placements[-1]
    since = float(placements[-2].get("time", 0.0)) if len(placements) > 1 else float("-inf")
    stages = last.get("pp")
    if not isinstance(stages, list) or len(stages) != len(last["ranks"]):
        stages = [0] * len(last["ranks"])  # older runs recorded no stage: one stage
    where = {r: (str(x[0]), int(stages[r])) for r, x in enumerate(last["ranks"])}
    busy: dict[int, dict[int, float]] = defaultdict(dict)
    for r in where:
        rs = steptimes.get(r)
        if rs is None or not rs.headers or float(rs.headers[-1].get("time", 0.0)) <= since:
            continue
        newest = len(rs.headers) - 1
        for row in rs.rows:
            if row["attempt"] == newest:
                busy[int(row["step"])][r] = busy_s(row)
    if busy:
        del busy[min(busy)]  # warm-up
    complete = {s: row for s, row in busy.items() if len(row) == len(where)}
    return complete, where


def straggler_nodes(paths: RunPaths, margin: float = EXCLUDE_MARGIN) -> dict[str, str]:
    """Nodes a persistent straggler of the run's last start ran on -> the reason (its slowest such rank)."""
    busy, where = last_start(read_jsonl(paths.events), read(paths))
    out: dict[str, SlowRank] = {}
    for s in slow_ranks(busy, where, margin):
        if s.node not in out or s.ratio > out[s.node].ratio:
            out[s.node] = s
    return {n: s.reason(margin) for n, s in out.items()}

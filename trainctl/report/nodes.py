"""Node count and throughput over time: one segment per attempt (each trainer start), from its `start` event's
world (an elastic run continues on fewer nodes after losing some: docs/design/launch.md, "Elastic node ranges").
Shown when the run is elastic or its world changed between attempts."""

from __future__ import annotations

from typing import Any

from trainctl.report.attempts import Attempt, median
from trainctl.report.load import RunData


def node_segments(run: RunData, attempts: list[Attempt], t0: float | None) -> dict[str, Any]:
    cluster = (run.spec or {}).get("cluster") or {}
    per_node = int(cluster.get("gpus_per_node") or 1)
    starts = {float(e["time"]): e for e in run.events_of("start") if "time" in e}
    segments = []
    for a in attempts:
        start = starts.get(a.start_t) if a.start_t is not None else None
        if start is None or not isinstance(start.get("world_size"), int):
            continue
        world = start["world_size"]
        rates = [float(r["tokens_per_s"]) for r in a.records if r.get("tokens_per_s")]
        segments.append({
            "attempt": a.index, "nodes": start.get("nodes") or world // per_node, "world_size": world,
            "dp": start.get("dp"), "micro_batches": start.get("micro_batches"),
            "from_s": None if t0 is None else float(start["time"]) - t0,
            "to_s": None if t0 is None or a.end_t is None else a.end_t - t0,
            "steps": [a.records[0]["step"], a.records[-1]["step"]] if a.records else None,
            "tokens_per_s": median(rates),
        })
    elastic = cluster.get("min_nodes") is not None and cluster["min_nodes"] < int(cluster.get("nodes") or 1)
    changed = len({s["world_size"] for s in segments}) > 1
    return {"available": bool(segments) and (elastic or changed), "segments": segments,
            "resizes": [{k: v for k, v in e.items() if k != "pid"} for e in run.events_of("elastic_resize")]}

"""Nodes kept out of a run's jobs (RUN/excluded_nodes.json), and why: named bad by `launch --preflight`, the
first cause of two failed trainer starts (a crash, a hang, a kill), or a persistent straggler of the last start
(trainctl/rundir/steptimes.py; cluster.exclude_stragglers, never leaving the partition fewer than cluster.nodes
nodes). No torch.

The record feeds Slurm's `--exclude` of every later submission (`trainctl resume`), and the batch script
asks `python -m trainctl.launch.exclusions RUN_DIR` at the start of each attempt and before it requeues itself
(it prints the spec's cluster.exclude and the record's nodes, comma-separated, after adding the nodes the
failures since name): a requeued job's excluded nodes are then updated while it waits (docs/design/launch.md,
"Preflight and node exclusion").
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainctl.fileio import write_atomic
from trainctl.rundir.paths import RunPaths, read_jsonl
from trainctl.rundir.runstate import LOST_PEER, first_cause
from trainctl.rundir.steptimes import straggler_nodes

if TYPE_CHECKING:
    from trainctl.spec.models import RunSpec

CRASHES = 2  # trainer starts whose first cause was on a node before the node is excluded
PREFLIGHT, FAILURES, STRAGGLERS = "preflight", "failures", "stragglers"  # sources of an exclusion


def read(paths: RunPaths) -> dict[str, dict[str, Any]]:
    """node -> {"reason", "source", "time"}; {} without a record (or an unreadable one: nothing excluded)."""
    try:
        data = json.loads(paths.excluded_nodes.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    nodes = data.get("nodes") if isinstance(data, dict) else None
    return {str(k): v for k, v in nodes.items()} if isinstance(nodes, dict) else {}


def add(paths: RunPaths, reasons: dict[str, str], source: str) -> list[str]:
    """Record nodes with their reasons (a node already there keeps its first reason); the nodes added."""
    held = read(paths)
    new = [n for n in reasons if n not in held]
    if not new:
        return []
    for n in new:
        held[n] = {"reason": reasons[n], "source": source, "time": round(time.time(), 3)}
    write_atomic(paths.excluded_nodes, json.dumps({"nodes": held}, indent=1) + "\n")
    return new


def merged(spec_exclude: str | None, nodes: list[str]) -> str | None:
    """The value of sbatch's --exclude: the spec's cluster.exclude and these nodes."""
    parts = [p for p in (spec_exclude or "").split(",") if p]
    return ",".join(parts + [n for n in nodes if n not in parts]) or None


def crash_nodes(events: list[dict[str, Any]], crashes: int = CRASHES) -> dict[str, str]:
    """Nodes where the first cause of at least `crashes` trainer starts happened -> a reason. A trainer start
    is the events from one `placement` (every start records where its ranks run) to the next; the cause's
    rank is placed on its node by that placement (the recorded host is the machine's name, which two Slurm
    nodes of one host share). A peer's "connection closed" is an echo, not a cause."""
    starts: list[list[dict[str, Any]]] = []
    for e in events:
        if e.get("event") == "placement":
            starts.append([])
        if starts:
            starts[-1].append(e)
    seen: dict[str, list[str]] = defaultdict(list)
    for segment in starts:
        cause = first_cause(segment)
        if cause is None or cause.rank is None or cause.kind == LOST_PEER:
            continue
        ranks = segment[0].get("ranks") or []
        node = ranks[cause.rank][0] if cause.rank < len(ranks) else cause.host
        if node:
            seen[str(node)].append(cause.line())
    return {n: f"{len(lines)} trainer starts failed there first; the last: {lines[-1]}"
            for n, lines in seen.items() if len(lines) >= crashes}


def update(paths: RunPaths, spec: RunSpec | None = None, say: Callable[[str], None] | None = None) -> list[str]:
    """Add the nodes the run's failures name to its record, and with `spec` (cluster.exclude_stragglers) its
    persistent stragglers when the partition keeps enough nodes without them (else `say` why not); every
    excluded node."""
    say = say or _quiet
    add(paths, crash_nodes(read_jsonl(paths.events)), FAILURES)
    if spec is not None and spec.cluster.exclude_stragglers:
        try:
            slow = {n: why for n, why in straggler_nodes(paths).items() if n not in read(paths)}
        except (ValueError, TypeError, KeyError) as e:  # a damaged step-time line must not lose the record
            say(f"persistent stragglers not judged: {type(e).__name__}: {e}")
            slow = {}
        if slow:
            from trainctl.errors import TrainctlError
            from trainctl.launch.slurm.cluster import query_sinfo, too_few_left

            try:
                short = too_few_left(spec, query_sinfo(), [*read(paths), *slow])
            except TrainctlError as e:  # no sinfo: do not shrink the run's choice of nodes blindly
                short = str(e)
            if short is None:
                for n in add(paths, slow, STRAGGLERS):
                    say(f"excluding {n} from the run's next jobs: {slow[n]}")
            else:
                for n, why in slow.items():
                    say(f"not excluding {n} ({why}): {short}; lower cluster.nodes (trainctl resume "
                        "--set cluster.nodes=N) to run without it")
    return list(read(paths))


def _quiet(_line: str) -> None:
    pass


def main(argv: list[str] | None = None) -> int:
    """`python -m trainctl.launch.exclusions RUN_DIR`: update the record, print sbatch's --exclude value."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m trainctl.launch.exclusions RUN_DIR", file=sys.stderr)
        return 2
    paths = RunPaths(Path(args[0]))
    from trainctl.spec import load_spec

    spec = load_spec(paths.spec)
    print(merged(spec.cluster.exclude, update(paths, spec, lambda line: print(line, file=sys.stderr))) or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())

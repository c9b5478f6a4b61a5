"""Persistent straggler nodes from synthetic step-time files (trainctl/rundir/steptimes.py): ranks are held against the
ranks of their own pipeline stage on other nodes, so a pipeline's last stage (LM head, loss) is never a
straggler; noise and short starts are not persistent; the report's comparison is per stage too."""

from __future__ import annotations

import json
from pathlib import Path

from trainctl.launch import exclusions
from trainctl.launch.slurm.cluster import NodeInfo, too_few_left
from trainctl.rundir import steptimes
from trainctl.rundir.paths import RunPaths
from trainctl.rundir.steptimes import compare_in_stage, straggler_nodes
from trainctl.spec import load_spec

STEPS = 9
SPEC = """name: t
model: {{preset: tiny}}
train: {{global_batch: 2, steps: 2}}
cluster: {{nodes: 2, gpus_per_node: 1, gpu: cpu{extra}}}
launcher: {{backend: slurm}}
"""


def write_run(root: Path, nodes: list[str], stages: list[int], busy, steps: int = STEPS,
              earlier: list[str] | None = None) -> RunPaths:
    """A run whose last start put rank r on nodes[r] in pipeline stage stages[r]; busy(rank, step) -> seconds
    of its own work (the step's sync wait is the rest of a 1 s step). `earlier`: a start before it, on these
    nodes, whose step times every rank of it wrote first."""
    paths = RunPaths(root)
    paths.logs.mkdir(parents=True)
    events, lines = [], {}
    t = 100.0
    for where in [earlier, nodes] if earlier else [nodes]:
        events.append({"time": t, "event": "placement", "nodes": sorted(set(where)),
                       "ranks": [[n, 0] for n in where], "pp": stages if where is nodes else [0] * len(where)})
        for r in range(len(where)):
            lines.setdefault(r, []).append({"header": True, "rank": r, "host": "h", "time": t + 1})
            for s in range(1, steps + 1):
                b = busy(r, s) if where is nodes else 0.1  # the earlier start: every rank alike
                lines[r].append({"step": s, "time": t + 1 + s, "step_s": 1.0, "sync_s": 1.0 - b, "comm_s": 0.0})
        t += 100.0
    paths.events.write_text("".join(json.dumps(e) + "\n" for e in events))
    for r, rows in lines.items():
        paths.steptimes(r).write_text("".join(json.dumps(x) + "\n" for x in rows))
    return paths


def test_slow_node_of_a_data_parallel_run_is_named(tmp_path: Path) -> None:
    paths = write_run(tmp_path, ["n1", "n2"], [0, 0], lambda r, s: 0.2 if r else 0.1)
    slow = straggler_nodes(paths)
    assert list(slow) == ["n2"]
    assert slow["n2"].startswith("persistent straggler: rank 1 (pipeline stage 0) worked 2.0x as long as its "
                                 "stage's ranks on other nodes")
    assert f"in {STEPS - 1} of {STEPS - 1} steps" in slow["n2"]  # the warm-up step is not sampled


def test_pipeline_last_stage_is_slower_by_design_and_not_flagged(tmp_path: Path) -> None:
    """PP 2 x DP 2 on four one-GPU nodes: stage 1 (LM head) works 1.8x as long as stage 0 on every node."""
    paths = write_run(tmp_path, ["n1", "n2", "n3", "n4"], [0, 0, 1, 1], lambda r, s: 0.18 if r >= 2 else 0.1)
    assert straggler_nodes(paths) == {}
    # the same layout with one last-stage rank slower than its stage peer is named, and only that node
    paths = write_run(tmp_path / "b", ["n1", "n2", "n3", "n4"], [0, 0, 1, 1],
                      lambda r, s: {0: 0.1, 1: 0.1, 2: 0.18, 3: 0.4}[r])
    assert list(straggler_nodes(paths)) == ["n4"]


def test_a_stage_on_one_node_has_no_peers(tmp_path: Path) -> None:
    """PP 2 with each stage on its own node: the stages do different work, so nothing is compared."""
    paths = write_run(tmp_path, ["n1", "n1", "n2", "n2"], [0, 0, 1, 1], lambda r, s: 0.5 if r >= 2 else 0.1)
    assert straggler_nodes(paths) == {}


def test_noise_and_short_starts_are_not_persistent(tmp_path: Path) -> None:
    half = write_run(tmp_path / "half", ["n1", "n2"], [0, 0], lambda r, s: 0.3 if r and s % 2 else 0.1)
    assert straggler_nodes(half) == {}  # slow in half the steps
    short = write_run(tmp_path / "short", ["n1", "n2"], [0, 0], lambda r, s: 0.3 if r else 0.1, steps=4)
    assert straggler_nodes(short) == {}  # 3 sampled steps
    small = write_run(tmp_path / "small", ["n1", "n2"], [0, 0], lambda r, s: 0.13 if r else 0.1)
    assert straggler_nodes(small) == {}  # 1.3x: within the margin


def test_only_the_last_start_counts(tmp_path: Path) -> None:
    """The last start (after an elastic shrink, or a resume elsewhere) is judged on its own ranks and steps: an
    earlier start's rows of a rank are not mixed in."""
    paths = write_run(tmp_path, ["n1", "n3"], [0, 0], lambda r, s: 0.3 if r else 0.1, earlier=["n1", "n2"])
    busy, where = steptimes.last_start(json_lines(paths.events), steptimes.read(paths))
    assert where == {0: ("n1", 0), 1: ("n3", 0)} and sorted(busy) == list(range(2, STEPS + 1))
    assert list(straggler_nodes(paths)) == ["n3"]


def json_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_report_compares_within_a_stage() -> None:
    """The report's per-rank view: the last stage (ranks 2, 3) is slower by design and not above its median;
    rank 3, slower than its stage peer, is."""
    busy = {s: {0: 0.1, 1: 0.1, 2: 0.18, 3: 0.18} for s in range(8)}
    assert compare_in_stage(busy, {0: 0, 1: 0, 2: 1, 3: 1}).above == {}
    busy = {s: {0: 0.1, 1: 0.1, 2: 0.18, 3: 0.3} for s in range(8)}
    assert compare_in_stage(busy, {0: 0, 1: 0, 2: 1, 3: 1}).above == {3: 8}


def node(name: str, state: str = "idle", partition: str = "debug") -> NodeInfo:
    return NodeInfo(partition=partition, default=partition == "debug", available="up", max_time_min=None,
                    node=name, state=state, gpus=4, cpus=8)


def test_never_exclude_below_the_node_count(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(extra=""))
    s = load_spec(spec)
    nodes = [node("n1"), node("n2"), node("n3"), node("n3", partition="short")]
    assert too_few_left(s, nodes, ["n2"]) is None  # n1 and n3 remain
    assert too_few_left(s, [*nodes[:2], node("n3", "down")], ["n2"]) == (
        "partition 'debug' would keep 1 usable node(s) without n2, and cluster.nodes = 2")
    s1 = load_spec(spec, ["cluster.nodes=1"])
    assert too_few_left(s1, nodes[:2], ["n2"]) is None


def test_exclude_stragglers_off_records_nothing(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "run", ["n1", "n2"], [0, 0], lambda r, s: 0.4 if r else 0.1)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(extra=", exclude_stragglers: false"))
    assert exclusions.update(paths, load_spec(spec)) == [] and not paths.excluded_nodes.exists()

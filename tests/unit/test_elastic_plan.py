"""Elastic node ranges without processes: the spec rules of cluster.min_nodes, the layout on fewer nodes
(plan/elastic.py), the plan's note and warning, the Slurm step it renders, and a run's state across a
torchrun restart. The run itself: tests/dist/test_elastic.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from cli_utils import trainctl
from paths import REPO
from spec_utils import one_problem, spec_with

from trainctl.launch.slurm import render
from trainctl.plan.elastic import CannotShrink, for_world, resize_event, shrink_options
from trainctl.plan.plan import build_plan
from trainctl.rundir.runstate import COMPLETED, FAILED, live_outcome, outcome
from trainctl.spec import RunSpec

TINY = REPO / "trainctl" / "spec" / "tiny-cpu.yaml"
# tp2 x pp2 on 4 nodes x 4 ranks: dp 4, global batch 16 = micro-batch 2 x 2 micro-batches x dp 4
ELASTIC = {"cluster.nodes": "4", "cluster.gpus_per_node": "4", "cluster.min_nodes": "2", "launcher.backend": "slurm",
           "launcher.max_restarts": "3", "parallel.dp": "auto"}


def elastic_spec(**over: str) -> RunSpec:
    return spec_with(TINY, ELASTIC, over)


@pytest.mark.parametrize(("value", "words"), [
    ("5", "cluster.min_nodes = 5: more than cluster.nodes = 4"),
    ("0", "cluster.min_nodes = 0: fewer than one node"),
])
def test_min_nodes_out_of_range_is_one_line(value: str, words: str) -> None:
    line = one_problem(TINY.read_text(), *[f"{k}={v}" for k, v in {**ELASTIC, "cluster.min_nodes": value}.items()])
    assert words in line and "give 1..4" in line


def test_elastic_needs_torchrun_mode_and_restarts() -> None:
    over = [f"{k}={v}" for k, v in ELASTIC.items()]
    assert "launcher.mode: torchrun" in one_problem(TINY.read_text(), *over, "launcher.mode=srun")
    assert "launcher.max_restarts" in one_problem(TINY.read_text(), *over, "launcher.max_restarts=0")


def test_plan_exits_2_with_one_line() -> None:
    r = trainctl("plan", str(TINY), "--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=4",
                 "--set", "launcher.backend=slurm", "--set", "cluster.min_nodes=3")
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "cluster.min_nodes = 3" in r.stderr


def test_fewer_nodes_keep_the_global_batch_with_more_micro_batches() -> None:
    s = elastic_spec()
    assert (s.dp, s.micro_batches) == (4, 2)
    small = for_world(s, 8)  # two nodes left
    assert (small.cluster.nodes, small.dp, small.micro_batches) == (2, 2, 4)
    assert small.train.global_batch == s.train.global_batch == small.dp * small.micro_batches * 2
    assert (small.parallel.tp, small.parallel.pp) == (2, 2) and small.backend == "slurm"
    assert for_world(s, 16) is s  # its own size: the spec as it is


def test_a_layout_that_cannot_shrink_stops_naming_why() -> None:
    s = elastic_spec()
    with pytest.raises(CannotShrink) as e:
        for_world(s, 12)  # 3 nodes: dp 3, and 16 sequences do not split into micro-batch 2 x dp 3
    assert "cannot continue on 3 of cluster.nodes = 4 nodes" in e.value.message
    assert "train.global_batch = 16" in e.value.message
    s2 = elastic_spec(**{"cluster.gpus_per_node": "2", "cluster.nodes": "4", "cluster.min_nodes": "1"})
    with pytest.raises(CannotShrink, match="tp\\*pp = 4 does not divide its 2 ranks"):
        for_world(s2, 2)


def test_plan_names_the_smallest_layout_and_the_node_counts_it_cannot_use() -> None:
    s = elastic_spec()
    assert [(o.nodes, o.dp, o.micro_batches, o.why_not is None) for o in shrink_options(s)] == [
        (2, 2, 4, True), (3, None, None, False), (4, 4, 2, True)]
    j = build_plan(s).to_json()
    assert j["elastic"]["summary"].startswith("may shrink to 2 nodes (dp 2 x 4 micro-batches")
    assert "cannot run on 3 node(s)" in j["elastic"]["summary"]
    warned = [w for w in j["warnings"] if w["code"] == "ELASTIC_CANNOT_SHRINK"]
    assert len(warned) == 1 and "shrinks to 3 node(s)" in warned[0]["message"]
    assert "elastic" not in build_plan(elastic_spec(**{"cluster.min_nodes": "4"})).to_json()


def test_resize_event_compares_with_the_previous_start() -> None:
    s = elastic_spec()
    small = for_world(s, 8)
    e = resize_event(s, small, [])
    assert e is not None and (e["previous_nodes"], e["nodes"], e["previous_micro_batches"], e["micro_batches"]) == (
        4, 2, 2, 4)
    assert "4 -> 2 nodes" in e["message"] and "global batch 16 kept" in e["message"]
    assert resize_event(s, small, [{"event": "start", "world_size": 8, "dp": 2}]) is None  # a restart at 2 nodes
    assert resize_event(s, s, [{"event": "start", "world_size": 8, "dp": 2}])["nodes"] == 4  # grown back


def test_slurm_step_is_elastic(tmp_path: Path) -> None:
    elastic = render.plan_slurm(elastic_spec(), tmp_path / "e", python="/p/python")
    step = " ".join(elastic.rendered.step)
    assert "--nnodes=2:4" in step and "--kill-on-bad-exit=0" in step and "--no-kill" in step
    assert "--max-restarts=3" in step and "#SBATCH --no-kill" in elastic.script
    # the lost node's task exits non-zero; the job of a run that finished every step still exits 0
    assert "if this_attempt finish; then rc=0; fi" in elastic.script
    (tmp_path / "e.sh").write_text(elastic.script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "e.sh")]).returncode == 0
    launch = render.plan_slurm(elastic_spec(**{"cluster.min_nodes": "4"}), tmp_path / "f", python="/p/python")
    fixed = " ".join(launch.rendered.step)
    assert "--nnodes=$SLURM_NNODES" in fixed and "--kill-on-bad-exit=1" in fixed and "--no-kill" not in fixed
    assert "--no-kill" not in launch.script and "then rc=0" not in launch.script


def test_a_torchrun_restart_supersedes_the_failure_before_it() -> None:
    lost = {"event": "failure", "time": 2.0, "rank": 1, "error": "RuntimeError: Connection closed by peer"}
    events = [{"event": "start", "time": 1.0}, lost]
    assert live_outcome(events).state == FAILED
    restarted = [*events, {"event": "start", "time": 3.0}]
    assert live_outcome(restarted) is None  # running again
    assert outcome([*restarted, {"event": "finish", "time": 4.0, "steps": 6}]).state == COMPLETED

"""`trainctl preflight` and `trainctl launch --preflight` on the real local Slurm cluster, with node n2 made
slow for real (its job processes stopped 90% of the time, tests/e2e/slow_node.py): a healthy
cluster passes; a slow n2 is named with its matmul rate and the job runs on n1 alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import slurm_fixtures
from cli_utils import trainctl
from slow_node import slow_node
from slurm_fixtures import SlurmCluster, step_exited

from trainctl.rundir.paths import RunPaths, read_jsonl

pytestmark = pytest.mark.slow

SPEC = """name: preflight-e2e
model: {preset: tiny}
parallel: {micro_batch: 1}
train: {global_batch: 1, steps: 2, lr: 1.0e-3, precision: fp32, seed: 1}
data: {synthetic: true}
checkpoint: {every_steps: 2, keep_last: 1}
cluster: {nodes: 1, gpus_per_node: 1, gpu: cpu}
launcher: {backend: slurm, mode: srun}
"""
# The two "nodes" share two cores with whatever else runs on this machine: a healthy pair measured as far
# apart as 0.52x (the other test worker compiling with inductor meanwhile). 0.4 sits below that; the default
# (0.8) is for real fleets. A ratio is judged bad only when it stays under the threshold after allowing for the
# peers' measured spread, which reached 39% in CI: n2 held to 20% of the time measured 0.31x there, inside it.
# Held to 10% it measured 0.32x once too (a fresh-clone CI on a slower host, n1's own windows spread 56%, n2's
# 32.5%: 0.4 / 1.325 = 0.30x needed), so n2 is held to 5%: half that rate again, under the threshold by more than
# any spread measured here.
SLOW_FRACTION = 0.05
LOOSE = ["--min-matmul-ratio", "0.4"]

def test_healthy_cluster_passes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    r = trainctl("preflight", str(spec), "--nodes", "2", *LOOSE, "--json", "--run-dir", str(tmp_path / "pf"))
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and out["bad_nodes"] == [] and [n["node"] for n in out["nodes"]] == ["n1", "n2"]
    assert all(n["memory_bytes"] > 0 and n["free_bytes"] > 0 for n in out["nodes"])
    assert out["measured"]["inter_node"][0]["bytes_per_s"] > 0
    assert "preflight: [6/6]" in r.stderr  # progress while it ran


def test_slow_node_is_named_and_the_launch_runs_without_it(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    spec, run = tmp_path / "spec.yaml", tmp_path / "run"
    spec.write_text(SPEC)
    with slow_node("n2", SLOW_FRACTION):
        r = trainctl("launch", str(spec), "--preflight", "--preflight-nodes", "2", *LOOSE, "--run-dir", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bad node n2: rank" in r.stdout and "matmul" in r.stdout and "bad node n1" not in r.stdout, r.stdout
    assert "excluding n2" in r.stdout, r.stdout
    paths = RunPaths(run)
    record = json.loads(paths.excluded_nodes.read_text())["nodes"]
    assert list(record) == ["n2"] and record["n2"]["source"] == "preflight"
    job = json.loads(paths.job.read_text())
    assert "--exclude=n2" in job["slurm"]["options"]
    slurm_fixtures.wait_for(lambda: step_exited(paths), "the job to end", 120, 0.5)
    starts = [e for e in read_jsonl(paths.events) if e["event"] == "slurm_start"]
    assert [e["nodes"] for e in starts] == ["n1"]
    assert any(e["event"] == "finish" for e in read_jsonl(paths.events))
    report = trainctl("mfu-report", str(run))  # the run's report says which node its later jobs keep out of
    assert report.returncode == 0 and "n2 excluded from later jobs (preflight): rank" in " ".join(
        report.stdout.split()), report.stdout + report.stderr
    listed = json.loads(trainctl("mfu-report", str(run), "--json").stdout)["runs"][0]
    assert listed["excluded_nodes"]["n2"]["source"] == "preflight"

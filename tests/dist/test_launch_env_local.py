"""launcher.setup on the local backend: a failing line stops the run before torchrun, with one line naming it
(docs/design/launch.md, "Containers and environment"). That the lines, launcher.python and launcher.nccl reach
every rank of a real launch is checked with the credentials' launch (tests/dist/test_launch_secrets.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_utils import trainctl
from paths import REPO

from trainctl.rundir.paths import read_jsonl

pytestmark = pytest.mark.slow

DP2 = ["--set", "parallel.tp=1", "--set", "parallel.pp=1", "--set", "parallel.dp=2", "--set", "cluster.gpus_per_node=2",
       "--set", "parallel.sequence_parallel=false", "--set", "train.global_batch=4", "--set", "train.steps=2"]


def test_a_failing_setup_line_stops_the_local_run_naming_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = trainctl("launch", "--run-dir", str(run), *DP2, "--set", 'launcher.setup=["true", "(exit 4)", "touch never"]')
    assert r.returncode == 1, r.stdout + r.stderr
    assert "run failed: setup failed: launcher.setup[1] exited with status 4 on " in r.stdout, r.stdout
    assert not (REPO / "never").exists() and not (run / "metrics.jsonl").exists()
    assert [e["event"] for e in read_jsonl(run / "events.jsonl")] == ["launch", "setup_failed", "launcher_exit"]
    # mfu-report has no step to report: one line naming why (runstate's cause), exit 1, no tables of dashes
    r = trainctl("mfu-report", str(run))
    assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
    (error,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert error == (f"error: {run}: no step ran, nothing to report: setup failed: launcher.setup[1] exited with "
                     "status 4 on " + error.split(" on ")[-1]), error
    assert error.endswith("; the trainer did not start") and "Traceback" not in r.stderr

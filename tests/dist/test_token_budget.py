"""A run given a token budget (train.tokens) instead of train.steps, launched, reported and resumed through the
real CLI (2 CPU ranks, DP=2, 4 steps): the frozen spec holds both, every rank reads it, and `status` and
`mfu-report` work on it. The same run is planned with a failure rate its whole run cannot outlive
(checkpoint.mtbf_hours 1e-5: an MTBF of 36 ms), priced (cluster.peak_tflops gives the CPU a step time in
seconds): the plan expects it not to finish, plan.json says so in strict JSON, and the reports say the plan
expects no finish instead of crashing on an infinite number of failures times a zero cost."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from cli_utils import trainctl
from json_utils import strict_loads
from paths import REPO

from trainctl.rundir.paths import read_jsonl
from trainctl.runtime.train import faults

pytestmark = pytest.mark.slow

TINY = REPO / "recipes" / "tiny-cpu.yaml"
BATCH_TOKENS = 16 * 64  # the recipe's global_batch x the tiny preset's seq_len
SETS = ["parallel.tp=1", "parallel.pp=1", "cluster.gpus_per_node=2", "train.warmup=1", "checkpoint.every_steps=2",
        f"train.tokens={4 * BATCH_TOKENS}",  # replaces the recipe's train.steps, as a data source's --set does
        "cluster.peak_tflops=0.05", "checkpoint.mtbf_hours=0.00001"]
CLEAN = {faults.ENV: None, "TRAINCTL_WATCHDOG_S": None, "COLUMNS": "200"}


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return trainctl(*args, env=CLEAN, timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """Launched for 4 steps' tokens, then resumed with a larger budget to 6 steps."""
    path = tmp_path_factory.mktemp("tokens") / "run"
    p = cli("launch", str(TINY), *[x for s in SETS for x in ("--set", s)], "--run-dir", str(path))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (path.parent / "launch.out").write_text(p.stdout)
    (path.parent / "spec-after-launch.yaml").write_text((path / "spec.yaml").read_text())
    (path.parent / "status-after-launch.json").write_text(cli("status", str(path), "--json").stdout)
    p = cli("resume", str(path), "--set", f"train.tokens={6 * BATCH_TOKENS}")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return path


def test_a_token_budget_launches_and_resumes_to_its_steps(run: Path) -> None:
    frozen = yaml.safe_load((run.parent / "spec-after-launch.yaml").read_text())["train"]
    assert (frozen["tokens"], frozen["steps"]) == (4 * BATCH_TOKENS, 4)  # both: readers of the file see steps
    assert "step 4/4" in (run.parent / "launch.out").read_text()
    first = json.loads((run.parent / "status-after-launch.json").read_text())
    assert first["steps_done"] == 4 and first["state"] == "COMPLETED"
    steps = [m["step"] for m in read_jsonl(run / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]  # resumed from step 4 to the 6 steps of the larger budget
    resumed = yaml.safe_load((run / "spec.yaml").read_text())["train"]
    assert (resumed["tokens"], resumed["steps"]) == (6 * BATCH_TOKENS, 6)


def test_status_and_mfu_report_of_a_run_its_plan_expects_not_to_finish(run: Path) -> None:
    plan_text = (run / "plan.json").read_text()
    whole = strict_loads(plan_text)["checkpoint"]["whole_run"]  # null, never the bare word Infinity
    assert whole["finishes"] is False and whole["wall_days"]["mean"] is None and whole["gpu_hours"] is None
    assert "MTBF of 36.0 ms" in whole["not_finishing"]
    for command in (("status", str(run)), ("mfu-report", str(run))):
        out = cli(*command)
        assert out.returncode == 0, out.stdout + out.stderr
        text = " ".join(out.stdout.split())
        assert "vs plan: the plan expects the run not to finish: its expected wall clock is over 100x" in text
        js = cli(*command, "--json")
        assert js.returncode == 0, js.stderr
        data = strict_loads(js.stdout)
        projection = data["projection"] if command[0] == "status" else data["runs"][0]["projection"]
        assert projection["vs_plan"] is None and projection["tokens"] == {
            "done": 6 * BATCH_TOKENS, "total": 6 * BATCH_TOKENS, "given": True}

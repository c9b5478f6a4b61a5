"""`trainctl sweep`: a 2x2 sweep of the tiny CPU recipe (1 rank, few steps), locally (one run after another) and
on the local Slurm cluster (one job array). Each survives a cancel of one run and of the whole sweep, resumes
to the end, and `mfu-report SWEEP` compares the four runs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import slurm_fixtures
from cli_utils import TRAINCTL, trainctl
from paths import REPO
from slurm_fixtures import SlurmCluster

from trainctl.rundir.paths import read_jsonl

pytestmark = pytest.mark.slow

STEPS = 10
ONE_RANK = ["--set", "parallel.tp=1", "--set", "parallel.pp=1", "--set", "parallel.dp=1",
            "--set", "cluster.gpus_per_node=1", "--set", "train.global_batch=4",
            "--set", "parallel.sequence_parallel=false", "--set", f"train.steps={STEPS}",
            "--set", "checkpoint.every_steps=2"]
GRID = ["--grid", "train.lr=1e-3,3e-3", "--grid", "train.seed=1,2"]
VALUES = [("1e-3", "1"), ("1e-3", "2"), ("3e-3", "1"), ("3e-3", "2")]
SLOW = {"TRAINCTL_FAULTS": "slow_rank=0:1.5"}  # >= 1.5 s a step: time to cancel a run mid-way


def wait_for(pred, what: str, timeout: float = 240):
    return slurm_fixtures.wait_for(pred, what, timeout, 0.5)


def sweep_status(sweep: Path) -> dict:
    r = trainctl("status", str(sweep), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def states(sweep: Path) -> list[str]:
    return [run["state"] for run in sweep_status(sweep)["runs"]]


def has_steps(run: Path) -> bool:
    return (run / "metrics.jsonl").is_file() and len(read_jsonl(run / "metrics.jsonl")) >= 1


def final_losses(sweep: Path) -> list[float]:
    return [read_jsonl(sweep / f"run-{i}" / "metrics.jsonl")[-1]["loss"] for i in range(4)]


def check_resumed_to_the_end(sweep: Path, stopped: list[int]) -> None:
    """Every run completed every step; the stopped ones did so in a second trainer start (from their checkpoint),
    the others in one."""
    st = sweep_status(sweep)
    assert [r["state"] for r in st["runs"]] == ["COMPLETED"] * 4, st
    assert [(r["values"]["train.lr"], r["values"]["train.seed"]) for r in st["runs"]] == VALUES
    for i, run in enumerate(st["runs"]):
        assert read_jsonl(sweep / run["dir"] / "metrics.jsonl")[-1]["step"] == STEPS
        assert run["steps_done"] == STEPS
        assert run["starts"] == (2 if i in stopped else 1), (i, run)


def check_report(sweep: Path) -> None:
    r = trainctl("mfu-report", str(sweep), "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    (sw,) = report["sweeps"]
    rows = sw["comparison"]
    assert [row["dir"] for row in rows] == [f"run-{i}" for i in range(4)]
    assert [row["final_loss"] for row in rows] == pytest.approx(final_losses(sweep))  # each run's own last step
    for row in rows:
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] <= 1 and 0 < row["goodput"] <= 1
    assert sorted(r["label"] for r in report["runs"]) == [
        f"run-{i} train.lr={lr} train.seed={seed}" for i, (lr, seed) in enumerate(VALUES)]
    text = trainctl("mfu-report", str(sweep))
    assert text.returncode == 0 and "Sweep" in text.stdout and "final loss" in text.stdout, text.stderr


def test_local_sweep_cancel_resume_report(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen([*TRAINCTL, "sweep", *ONE_RANK, *GRID, "--sweep-dir", str(sweep)], cwd=REPO,
                            env={**os.environ, **SLOW}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: has_steps(sweep / "run-0"), "run-0's first step")
        one = trainctl("cancel", str(sweep / "run-0"))  # one run: the sweep goes on with the next
        assert one.returncode == 0, one.stderr
        wait_for(lambda: has_steps(sweep / "run-1"), "run-1's first step")
        whole = trainctl("cancel", str(sweep))
        assert whole.returncode == 0 and "run-1: " in whole.stdout, whole.stdout + whole.stderr
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, out  # stopped, resumable
    assert "not started run-2: the sweep was cancelled" in out and "not started run-3" in out, out
    assert states(sweep) == ["CANCELLED", "CANCELLED", "PENDING", "PENDING"]
    r = trainctl("resume", str(sweep), timeout=600)  # at full speed now
    assert r.returncode == 0, r.stdout + r.stderr
    check_resumed_to_the_end(sweep, stopped=[0, 1])
    check_report(sweep)
    again = trainctl("resume", str(sweep))
    assert again.returncode == 0 and "nothing to resume" in again.stdout


def test_slurm_sweep_is_one_job_array(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    r = trainctl("sweep", *ONE_RANK, "--set", "launcher.backend=slurm", *GRID, "--sweep-dir", str(sweep),
                 "--max-parallel", "1", env=SLOW)
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads((sweep / "sweep.json").read_text())
    array_id = record["array"]["job_id"]
    assert "--array=0-3%1" in record["array"]["submit_command"]
    assert f"Slurm job array {array_id}" in r.stdout
    # element 0 runs, the others wait for the concurrency limit; each run names its element until it starts
    wait_for(lambda: has_steps(sweep / "run-0"), "run-0's first step")
    jobs = [json.loads((sweep / f"run-{i}" / "job.json").read_text())["job_id"] for i in range(4)]
    assert jobs[1:] == [f"{array_id}_{i}" for i in (1, 2, 3)], jobs
    one = trainctl("cancel", str(sweep / "run-0"))
    assert one.returncode == 0, one.stderr
    wait_for(lambda: has_steps(sweep / "run-1"), "run-1's first step (the next element)")
    whole = trainctl("cancel", str(sweep))
    assert whole.returncode == 0, whole.stderr
    # the two that ran were stopped (scancel: each saved a checkpoint), the two queued never started
    wait_for(lambda: states(sweep) == ["CANCELLED"] * 4, "every run of the sweep to be cancelled")
    assert not [j for j in subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True)
                .stdout.split() if j.startswith(f"{array_id}_")]
    started = [json.loads((sweep / f"run-{i}" / "job.json").read_text())["job_id"] for i in range(2)]
    for i, job_id in enumerate(started):  # an element's own job id; its log is in its run's logs/
        assert job_id.isdigit() and (sweep / f"run-{i}" / "logs" / f"slurm-{job_id}.out").is_file()
    r = trainctl("resume", str(sweep))  # at full speed now
    assert r.returncode == 0, r.stdout + r.stderr
    wait_for(lambda: states(sweep) == ["COMPLETED"] * 4, "the resumed sweep to complete", timeout=480)
    check_resumed_to_the_end(sweep, stopped=[0, 1])
    check_report(sweep)


def test_tokens_sweep_fits_loss_against_compute(tmp_path: Path) -> None:
    """A grid over the tokens trained (train.steps): mfu-report fits the final loss against compute; every point is
    the run's own (its last loss, its FLOPs per step x steps) and the exponent is the log-log slope worked out here."""
    import math

    sweep = tmp_path / "sweep"
    one_rank = [w for s in ONE_RANK[1::2] if not s.startswith(("train.steps", "checkpoint.")) for w in ("--set", s)]
    r = trainctl("sweep", *one_rank, "--grid", "train.steps=3,5,8", "--sweep-dir", str(sweep), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = trainctl("mfu-report", str(sweep), "--json")
    assert rep.returncode == 0, rep.stderr
    (sw,) = json.loads(rep.stdout)["sweeps"]
    fit = sw["scaling_fit"]
    assert fit["fitted"] and fit["form"] == "L = a*C^-b" and len(fit["points"]) == 3
    xs, ys = [], []
    for i, p in enumerate(fit["points"]):
        last = read_jsonl(sweep / f"run-{i}" / "metrics.jsonl")[-1]
        assert p["loss"] == last["loss"] and p["compute"] == last["model_flops_per_step"] * last["step"]
        xs.append(math.log(p["compute"]))
        ys.append(math.log(p["loss"]))
    mx, my = sum(xs) / 3, sum(ys) / 3
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    assert fit["b"] == pytest.approx(-slope, rel=1e-9)
    text = trainctl("mfu-report", str(sweep))
    assert "scaling fit: final loss against training compute" in text.stdout, text.stdout

"""`trainctl launch` on the real local Slurm cluster (slurm/local-cluster.sh): both modes, losses equal to a
local run, shell metacharacters, --dry-run, sinfo checks, the USR1 -> ranks -> self-requeue chain, and
status/logs/cancel/runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_fixtures import SlurmCluster

from trainctl.launch import slurm
from trainctl.rundir import RunPaths, read_jsonl
from trainctl.spec import load_spec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "trainctl" / "recipes" / "tiny-cpu.yaml"
STEPS = 6
SLURM = ["--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=4", "--set", "launcher.backend=slurm",
         "--set", f"train.steps={STEPS}"]
TRAINER_PROVES_PLACEMENT = "prove_placement" in (REPO / "trainctl" / "runtime" / "entry.py").read_text() + (
    REPO / "trainctl" / "runtime" / "trainer.py").read_text()


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainctl", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL)


def status(run: Path) -> dict:
    r = cli("status", str(run), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def wait_for(pred, what: str, timeout: float = 150, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_done(run: Path, timeout: float = 180) -> dict:
    st = wait_for(lambda: (s := status(run))["state"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
                  and s, f"{run} to finish", timeout)
    if st["state"] != "COMPLETED":
        logs = "\n".join(p.read_text()[-3000:] for p in (run / "logs").glob("slurm-*.out"))
        raise AssertionError(f"job ended {st}:\n{logs}")
    return st


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl")]


def job_id(run: Path) -> str:
    return json.loads((run / "job.json").read_text())["job_id"]


def squeue_ids() -> set[str]:
    return set(subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split())


@pytest.fixture(scope="module")
def local_losses(tmp_path_factory) -> list[float]:
    run = tmp_path_factory.mktemp("local") / "run"
    r = cli("launch", "--set", f"train.steps={STEPS}", "--run-dir", str(run), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = losses(run)
    assert len(out) == STEPS
    return out


@pytest.mark.parametrize("mode", ["srun", "torchrun"])
def test_two_node_job_completes_with_local_losses(slurm_cluster: SlurmCluster, tmp_path: Path, mode: str,
                                                   local_losses: list[float]) -> None:
    run = tmp_path / "run"
    extra = ["--set", "cluster.gpu=h100-sxm"] if mode == "srun" else []  # also request the emulated GPUs
    r = cli("launch", *SLURM, "--set", f"launcher.mode={mode}", *extra, "--run-dir", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "submitted Slurm job" in r.stdout and "trainctl logs" in r.stdout
    st = wait_done(run)
    assert st["steps_done"] == STEPS and st["attempts"] == 1 and st["last_mfu"] is not None
    assert losses(run) == pytest.approx(local_losses, rel=1e-6, abs=1e-6)
    out = (run / "logs" / f"slurm-{job_id(run)}.out").read_text()
    assert f"step {STEPS}/{STEPS}" in out
    kinds = [e["event"] for e in read_jsonl(run / "events.jsonl")]
    assert kinds[:2] == ["submit", "slurm_start"] and "finish" in kinds and kinds[-1] == "step_exit"
    logs = cli("logs", str(run))
    assert logs.returncode == 0 and f"step {STEPS}/{STEPS}" in logs.stdout
    if TRAINER_PROVES_PLACEMENT:
        placement = json.loads((run / "placement.json").read_text())
        assert placement["tp_groups_across_nodes"] == [] and sorted(placement["nodes"]) == ["n1", "n2"]
    listed = cli("runs", str(tmp_path), "--json")
    assert json.loads(listed.stdout)[0]["state"] == "COMPLETED"


EVIL = "x; touch MARK $(touch MARK) `touch MARK` \" ' |"


def test_shell_metacharacters_run_exactly_what_was_asked(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    mark = tmp_path / "MARK"
    evil = EVIL.replace("MARK", str(mark))
    run = tmp_path / f"run {EVIL}"  # relative MARKs: they would land in the job's cwd (REPO) or the run dir
    spec = tmp_path / "spec.yaml"
    spec.write_text(TINY.read_text())
    r = cli("launch", str(spec), "--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=1",
            "--set", "launcher.backend=slurm", "--set", "launcher.mode=srun", "--set", "train.steps=2",
            "--set", "parallel.tp=1", "--set", "parallel.pp=1", "--set", "parallel.dp=2",
            "--set", f"name={json.dumps(EVIL)}",
            "--set", f"launcher.srun_args={json.dumps(['--comment=' + evil])}",
            "--set", f"launcher.env={json.dumps({'TRAINCTL_EVIL': evil})}",
            "--run-dir", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    jid = job_id(run)
    show = subprocess.run(["scontrol", "show", "job", "-o", jid], capture_output=True, text=True).stdout
    assert f"JobName={EVIL} " in show, show
    st = wait_done(run, timeout=120)
    assert st["steps_done"] == 2
    assert not mark.exists() and not (REPO / "MARK").exists() and not (run / "MARK").exists()
    assert (run / "logs" / f"slurm-{jid}.out").exists()


def test_dry_run_submits_nothing(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    before = squeue_ids()
    r = cli("launch", *SLURM, "--dry-run", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --nodes=2" in r.stdout and "torch.distributed.run" in r.stdout
    assert "8 ranks = tp 2 x pp 2 x dp 2" in r.stdout and "cluster check (sinfo): ok" in r.stdout
    assert not (tmp_path / "run").exists() and squeue_ids() == before


@pytest.mark.parametrize(("sets", "needle"), [
    (["cluster.partition=nope"], "cluster.partition = 'nope': no such partition"),
    (["cluster.partition=short", "cluster.time='00:10:00'"], "over partition 'short''s limit of 00:05:00"),
    (["cluster.partition=short"], "cluster.nodes = 2 but partition 'short' has 1 node(s)"),
    (["cluster.gpu=h100-sxm", "cluster.gpus_per_node=8", "parallel.dp=4"], "cluster.gpus_per_node = 8"),
])
def test_sinfo_checks_reject_before_submitting(slurm_cluster: SlurmCluster, tmp_path: Path, sets: list[str],
                                               needle: str) -> None:
    before = squeue_ids()
    args = [x for s in sets for x in ("--set", s)]
    r = cli("launch", *SLURM, *args, "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr and r.stderr.startswith("error: ")
    assert not (tmp_path / "run").exists() and squeue_ids() == before


def _start_now(jid: str) -> None:
    time.sleep(2)  # not in the second of the requeue: "Job credential revoked" (slurm/README.md)
    wait_for(lambda: subprocess.run(["scontrol", "update", f"jobid={jid}", "StartTime=now"],
                                    capture_output=True).returncode == 0, "StartTime=now", 20)


def test_usr1_reaches_every_rank_and_the_job_requeues_itself(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The preemption chain as far as it goes without checkpoints in the trainer: Slurm's USR1 to the batch
    script -> every rank (through srun and torchrun) -> the job requeues itself -> attempt 2 runs. Also the
    placement proof under torchrun's join-order rendezvous."""
    spec = load_spec(TINY, [f"{k}={v}" for k, v in {
        "cluster.nodes": 2, "cluster.gpus_per_node": 4, "launcher.backend": "slurm", "cluster.gpu": "h100-sxm",
        "launcher.env": json.dumps({"PYTHONPATH": str(REPO / "tests")})}.items()])
    launch = slurm.plan_slurm(spec, tmp_path / "run", trainer_module="slurm_stub_trainer")
    paths = slurm.create(launch)
    jid = slurm.submit(launch, paths)
    marks = paths.root / "stub"
    wait_for(lambda: len(list(marks.glob("up-*-0"))) == 8, "8 ranks up", 120)
    subprocess.run(["scancel", "--batch", "--signal=USR1", jid], check=True)  # what --signal=B:USR1@T sends
    wait_for(lambda: status(paths.root)["state"] == "PENDING", "the job to requeue itself", 60)
    assert sorted(p.name for p in marks.glob("usr1-*")) == sorted(f"usr1-{r}-0" for r in range(8))
    _start_now(jid)
    st = wait_done(paths.root, timeout=120)
    assert st["attempts"] == 2
    assert len(list(marks.glob("done-*-1"))) == 8
    kinds = [e["event"] for e in read_jsonl(paths.events)]
    assert kinds.count("slurm_start") == 2 and "requeue" in kinds
    placement = json.loads((paths.root / "placement.json").read_text())
    assert placement["tp_groups_across_nodes"] == []
    assert sorted(placement["nodes"]) == ["n1", "n2"]
    for r in placement["ranks"]:  # what each rank reported, not rank // gpus_per_node
        assert r["node"] == (marks / f"up-{r['rank']}-1").read_text()
        assert r["gpu"] in {"0", "1", "2", "3"}
    out = (paths.logs / f"slurm-{jid}.out").read_text()
    assert "SIGUSR1" in out and "requeueing job" in out and out.count("attempt 1 on") == 1


def test_cancel_and_logs_of_a_running_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    spec = load_spec(TINY, [f"{k}={v}" for k, v in {
        "cluster.nodes": 2, "cluster.gpus_per_node": 4, "launcher.backend": "slurm", "launcher.mode": "srun",
        "launcher.env": json.dumps({"PYTHONPATH": str(REPO / "tests")})}.items()])
    launch = slurm.plan_slurm(spec, tmp_path / "run", trainer_module="slurm_stub_trainer")
    paths = slurm.create(launch)
    slurm.submit(launch, paths)
    wait_for(lambda: len(list((paths.root / "stub").glob("up-*-0"))) == 8, "8 ranks up", 120)
    assert status(paths.root)["state"] == "RUNNING"
    r = cli("cancel", str(paths.root))
    assert r.returncode == 0 and "cancelled Slurm job" in r.stdout, r.stderr
    wait_for(lambda: status(paths.root)["state"] == "CANCELLED", "CANCELLED", 60)
    assert "already CANCELLED" in cli("cancel", str(paths.root)).stdout
    text = cli("status", str(paths.root)).stdout
    assert re.search(r"CANCELLED", text)
    assert cli("logs", str(paths.root)).returncode == 0
    assert RunPaths(paths.root).job.exists()

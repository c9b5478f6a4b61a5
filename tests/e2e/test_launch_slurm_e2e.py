"""`trainctl launch` on the real local Slurm cluster (slurm/local-cluster.sh): both modes, losses equal to a
local run, shell metacharacters, --dry-run, sinfo checks, the USR1 -> ranks -> self-requeue chain, and
status/logs/cancel/runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from itertools import pairwise
from pathlib import Path

import pytest
import slurm_fixtures
from cli_utils import clone_parent, trainctl
from env_probe import PROBE_VALUE, make_probe
from paths import REPO
from slurm_fixtures import SlurmCluster

from trainctl.launch.slurm import render, sbatch_template, submit
from trainctl.rundir.paths import RunPaths, read_jsonl
from trainctl.runtime.train import faults
from trainctl.spec import load_spec

pytestmark = pytest.mark.slow

TINY = REPO / "trainctl" / "spec" / "tiny-cpu.yaml"
STEPS = 6
SLURM = ["--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=4", "--set", "launcher.backend=slurm",
         "--set", f"train.steps={STEPS}"]

def status(run: Path) -> dict:
    r = trainctl("status", str(run), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def wait_for(pred, what: str, timeout: float = 150, interval: float = 0.5):
    return slurm_fixtures.wait_for(pred, what, timeout, interval)


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


LONG_STEPS = 30  # long enough to act in the middle (~0.2 s a step here), short enough for the test budget
# TP 2 (+ SP) x PP 2 on half the ranks and half the batch of the recipe: what these tests prove (signals,
# requeues, restarts and resumes across two nodes, the stage boundary crossing them) needs no more, and 4
# processes start and step in half the time of 8 on two cores
LONG_RUN = ["--set", f"train.steps={LONG_STEPS}", "--set", "checkpoint.every_steps=4", "--set", "parallel.dp=1",
            "--set", "train.global_batch=8"]
LONG = ["--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=2", "--set", "launcher.backend=slurm",
        *LONG_RUN]


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory) -> list[float]:
    """The same spec run uninterrupted on this machine (torchrun --standalone): the loss of every step."""
    run = tmp_path_factory.mktemp("reference") / "run"
    r = trainctl("launch", str(TINY), *LONG_RUN, "--set", "cluster.gpus_per_node=4", "--run-dir", str(run), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = losses(run)
    assert len(out) == LONG_STEPS
    return out


@pytest.mark.parametrize("mode", ["srun", "torchrun"])
def test_two_node_job_completes_with_local_losses(slurm_cluster: SlurmCluster, tmp_path: Path, mode: str,
                                                   reference_losses: list[float]) -> None:
    """TP 2 (+ SP) x PP 2 over two nodes (LONG), uninterrupted: every loss the local run's.

    The srun job is submitted by the console script from a clone's parent directory, where `./trainctl/` is the
    git clone (a folder without the package's __init__.py): sbatch runs the job there, and the ranks import the
    installed package (the losses are the reference's).

    The torchrun job also carries launcher.setup, launcher.python and launcher.nccl: the setup lines run in the
    batch script and again in each node's task before its torchrun, launcher.python starts each torchrun, and
    what the lines export, with the NCCL variables, is in every rank's own environment. The container options
    are checked by rendering (pyxis is not installed here: tests/unit/test_launch_environment.py)."""
    run = tmp_path / "run"
    probe = make_probe(tmp_path / "probe")
    if mode == "srun":
        extra = ["--set", "cluster.gpu=h100-sxm"]  # also request the emulated GPUs
    else:
        extra = ["--set", f"launcher.setup={json.dumps(probe.setup)}", "--set", f"launcher.python={probe.python}",
                 "--set", "launcher.nccl.debug=INFO", "--set", "launcher.nccl.socket_ifname=lo"]
    from_clone = {"cwd": clone_parent(tmp_path), "installed": True} if mode == "srun" else {}
    r = trainctl("launch", *LONG, "--set", f"launcher.mode={mode}", *extra, "--run-dir", str(run), **from_clone)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "submitted Slurm job" in r.stdout and "trainctl logs" in r.stdout
    assert "export PYTHONSAFEPATH=1" in (run / "launch.sh").read_text()
    st = wait_done(run)
    assert st["steps_done"] == LONG_STEPS and st["attempts"] == 1 and st["last_mfu"] is not None
    proj = st["projection"]  # done: the total measured, no failures; a GPU plan is not held against a CPU run
    assert proj["total_is"] == "measured" and proj["remaining_s"] == 0 and proj["measured"]["failures"] == 0
    assert proj["steps"] == {"done": LONG_STEPS, "total": LONG_STEPS, "lost": 0}
    assert proj["vs_plan"] is None and ("trained on the CPU" in proj["vs_plan_note"]) == (mode == "srun")
    assert losses(run) == pytest.approx(reference_losses, rel=1e-6, abs=1e-6)
    out = (run / "logs" / f"slurm-{job_id(run)}.out").read_text()
    assert f"step {LONG_STEPS}/{LONG_STEPS}" in out
    kinds = [e["event"] for e in read_jsonl(run / "events.jsonl")]
    assert kinds[:2] == ["submit", "slurm_start"] and "finish" in kinds and kinds[-1] == "step_exit"
    logs = trainctl("logs", str(run))
    assert logs.returncode == 0 and f"step {LONG_STEPS}/{LONG_STEPS}" in logs.stdout
    placement = json.loads((run / "placement.json").read_text())
    assert placement["tp_groups_across_nodes"] == [] and sorted(placement["nodes"]) == ["n1", "n2"]
    listed = trainctl("runs", str(tmp_path), "--json")
    assert json.loads(listed.stdout)[0]["state"] == "COMPLETED"
    # continued on another allocation of the same ranks (one node of four, not two of two): the layout is the
    # checkpoint's, so no `layout change` line, and each changed field is said (was: nothing for cluster.*)
    dry = trainctl("resume", str(run), "--dry-run", "--set", "cluster.nodes=1", "--set", "cluster.gpus_per_node=4",
                   "--set", f"train.steps={LONG_STEPS + 10}")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    changes = [ln for ln in dry.stdout.splitlines() if ln.startswith(("spec change:", "layout change:"))]
    assert changes[:2] == ["spec change: cluster.gpus_per_node: 2 -> 4", "spec change: cluster.nodes: 2 -> 1"]
    assert len(changes) == 3 and changes[2].startswith(f"spec change: train.steps: {LONG_STEPS} -> "), dry.stdout
    assert not (run / "spec.prev-1.yaml").exists()
    # mfu-report: queueing is sbatch -> the batch script's first line; start-up from there to the first step
    (g,) = [x["goodput"] for x in json.loads(trainctl("mfu-report", str(run), "--json").stdout)["runs"]]
    (submitted,), (started,) = events(run, "submit"), events(run, "slurm_start")
    first = read_jsonl(run / "metrics.jsonl")[0]
    assert g["lost_s"]["queueing"] == pytest.approx(started["time"] - submitted["time"], abs=1e-6)
    assert g["lost_s"]["startup"] == pytest.approx(first["time"] - first["step_time_s"] - started["time"], abs=1e-6)
    if mode == "torchrun":
        script = (run / "launch.sh").read_text()
        assert probe.setup[0] in script and "export NCCL_SOCKET_IFNAME=lo" in script  # verbatim, ours quoted
        assert probe.where_setup_ran() == ["none", "0", "0"], out  # the batch script, then each node's task
        assert probe.python_saw() == [PROBE_VALUE] * 2  # one torchrun per node, by launcher.python after setup
        assert probe.python_saw("trainctl.runtime.train.faults") == [PROBE_VALUE]  # the batch script's own use
        seen = probe.ranks_saw()
        assert sorted(seen) == [0, 1, 2, 3], out
        assert all(v == {"TRAINCTL_PROBE": PROBE_VALUE, "NCCL_DEBUG": "INFO"} for v in seen.values()), seen


EVIL = "x; touch MARK $(touch MARK) `touch MARK` \" ' |"
SECRET = "hf-value-e2e-5c0d"


def test_shell_metacharacters_run_exactly_what_was_asked(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    mark = tmp_path / "MARK"
    evil = EVIL.replace("MARK", str(mark))
    run = tmp_path / f"run {EVIL}"  # relative MARKs: they would land in the job's cwd (REPO) or the run dir
    spec = tmp_path / "spec.yaml"
    spec.write_text(TINY.read_text())
    r = trainctl("launch", str(spec), "--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=1",
                 "--set", "launcher.backend=slurm", "--set", "launcher.mode=srun", "--set", "train.steps=2",
                 "--set", "parallel.tp=1", "--set", "parallel.pp=1", "--set", "parallel.dp=2",
                 "--set", f"name={json.dumps(EVIL)}",
                 "--set", f"launcher.srun_args={json.dumps(['--comment=' + evil])}",
                 "--set", f"launcher.env={json.dumps({'TRAINCTL_EVIL': evil, 'HF_TOKEN': SECRET})}",
                 "--run-dir", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    jid = job_id(run)
    show = subprocess.run(["scontrol", "show", "job", "-o", jid], capture_output=True, text=True).stdout
    assert f"JobName={EVIL} " in show, show
    st = wait_done(run, timeout=120)
    assert st["steps_done"] == 2
    assert not mark.exists() and not (REPO / "MARK").exists() and not (run / "MARK").exists()
    assert (run / "logs" / f"slurm-{jid}.out").exists()
    # a credential reached the job (its batch script stops without it) through sbatch's environment, never a file
    assert not [f for f in run.rglob("*") if f.is_file() and SECRET.encode() in f.read_bytes()]


def test_dry_run_submits_nothing(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    before = squeue_ids()
    r = trainctl("launch", *SLURM, "--dry-run", "--run-dir", str(tmp_path / "run"))
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
    r = trainctl("launch", *SLURM, *args, "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr and r.stderr.startswith("error: ")
    assert not (tmp_path / "run").exists() and squeue_ids() == before


# the stub trainer's jobs: TP 2 x PP 2 over two nodes (TP inside a node, PP across), 4 ranks
STUB_LAYOUT = {"cluster.nodes": 2, "cluster.gpus_per_node": 2, "parallel.dp": 1}
STUB_RANKS = 4


def _start_now(jid: str) -> None:
    time.sleep(2)  # not in the second of the requeue: "Job credential revoked" (slurm/README.md)
    wait_for(lambda: subprocess.run(["scontrol", "update", f"jobid={jid}", "StartTime=now"],
                                    capture_output=True).returncode == 0, "StartTime=now", 20)


def test_usr1_reaches_every_rank_and_the_job_requeues_itself(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The preemption chain as far as it goes without checkpoints in the trainer: Slurm's USR1 to the batch
    script -> every rank (through srun and torchrun) -> the job requeues itself -> attempt 2 runs. Also the
    placement proof under torchrun's join-order rendezvous."""
    spec = load_spec(TINY, [f"{k}={v}" for k, v in {
        **STUB_LAYOUT, "launcher.backend": "slurm", "cluster.gpu": "h100-sxm",
        "launcher.env": json.dumps({"PYTHONPATH": str(Path(__file__).parent)})}.items()])
    launch = render.plan_slurm(spec, tmp_path / "run", trainer_module="slurm_stub_trainer")
    paths = submit.create(launch)
    jid = submit.submit(launch, paths)
    marks = paths.root / "stub"
    wait_for(lambda: len(list(marks.glob("up-*-0"))) == STUB_RANKS, "every rank up", 120)
    subprocess.run(["scancel", "--batch", "--signal=USR1", jid], check=True)  # what --signal=B:USR1@T sends
    wait_for(lambda: status(paths.root)["state"] == "PENDING", "the job to requeue itself", 60)
    assert sorted(p.name for p in marks.glob("usr1-*")) == sorted(f"usr1-{r}-0" for r in range(STUB_RANKS))
    _start_now(jid)
    st = wait_done(paths.root, timeout=120)
    assert st["attempts"] == 2
    assert len(list(marks.glob("done-*-1"))) == STUB_RANKS
    kinds = [e["event"] for e in read_jsonl(paths.events)]
    assert kinds.count("slurm_start") == 2 and "requeue" in kinds
    placement = json.loads((paths.root / "placement.json").read_text())
    assert placement["tp_groups_across_nodes"] == []
    assert sorted(placement["nodes"]) == ["n1", "n2"]
    for r in placement["ranks"]:  # what each rank reported, not rank // gpus_per_node
        assert r["node"] == (marks / f"up-{r['rank']}-1").read_text()
        assert r["gpu"] in {"0", "1"}
    out = (paths.logs / f"slurm-{jid}.out").read_text()
    assert "SIGUSR1" in out and "requeueing job" in out and out.count("attempt 1 on") == 1


def test_cancel_and_logs_of_a_running_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    spec = load_spec(TINY, [f"{k}={v}" for k, v in {
        **STUB_LAYOUT, "launcher.backend": "slurm", "launcher.mode": "srun",
        "launcher.env": json.dumps({"PYTHONPATH": str(Path(__file__).parent)})}.items()])
    launch = render.plan_slurm(spec, tmp_path / "run", trainer_module="slurm_stub_trainer")
    paths = submit.create(launch)
    submit.submit(launch, paths)
    wait_for(lambda: len(list((paths.root / "stub").glob("up-*-0"))) == STUB_RANKS, "every rank up", 120)
    assert status(paths.root)["state"] == "RUNNING"
    r = trainctl("cancel", str(paths.root))
    assert r.returncode == 0 and "cancelled Slurm job" in r.stdout, r.stderr
    wait_for(lambda: status(paths.root)["state"] == "CANCELLED", "CANCELLED", 60)
    assert "already CANCELLED" in trainctl("cancel", str(paths.root)).stdout
    text = trainctl("status", str(paths.root)).stdout
    assert re.search(r"CANCELLED", text)
    assert trainctl("logs", str(paths.root)).returncode == 0
    assert RunPaths(paths.root).job.exists()


# --- preemption, requeue, a dead rank, `trainctl resume`: the real trainer, its checkpoints -------------

def last_step(run: Path) -> int:
    return max((r["step"] for r in read_jsonl(run / "metrics.jsonl")), default=0)


def wait_step(run: Path, step: int, timeout: float = 150) -> int:
    return wait_for(lambda: (s := last_step(run)) >= step and s, f"{run} to log step {step}", timeout, 0.2)


def test_cancel_force_on_slurm_is_slurms_own_kill(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """`trainctl cancel --force` on Slurm is `scancel --signal=KILL --full`, which slurmctld turns into its own
    cancel (SIGTERM, then SIGKILL after KillWait); the run reads CANCELLED, killed by the forced cancel (the stub
    ranks die of the SIGTERM before any checkpoint)."""
    spec = load_spec(TINY, [f"{k}={v}" for k, v in {
        **STUB_LAYOUT, "launcher.backend": "slurm", "launcher.mode": "srun",
        "launcher.env": json.dumps({"PYTHONPATH": str(Path(__file__).parent)})}.items()])
    launch = render.plan_slurm(spec, tmp_path / "run", trainer_module="slurm_stub_trainer")
    paths = submit.create(launch)
    jid = submit.submit(launch, paths)
    wait_for(lambda: len(list((paths.root / "stub").glob("up-*-0"))) == STUB_RANKS, "every rank up", 120)
    r = trainctl("cancel", "--force", str(paths.root))
    assert r.returncode == 0 and f"cancelled Slurm job {jid} with scancel --signal=KILL" in r.stdout, r
    st = wait_for(lambda: (s := status(paths.root))["state"] != "STOPPING" and s, "the job to end", 60)
    assert st["state"] == "CANCELLED" and "(`trainctl cancel --force`)" in st["reason"], st
    log = (paths.logs / f"slurm-{jid}.out").read_text()
    assert "trainctl: SIGTERM (scancel): stopping the ranks" in log, log
    assert re.search(rf"JOB {jid} ON \S+ CANCELLED", (paths.logs / f"slurm-{jid}.err").read_text())  # Slurm's own


def events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["event"] == kind]


def check_resumed_run(run: Path, reference: list[float]) -> list[dict]:
    """The run's metrics against the uninterrupted reference; returns its `resume_from` events.

    Between two trainer starts the steps are consecutive (none repeated, none skipped). A start resumes at
    or before the last logged step, and any steps it runs again (logged after its checkpoint) are exactly
    the ones its `resume_from` event announces (replayed_steps). Every step 1..N is logged, its last value
    equal to the reference's, and so the final loss."""
    recs = read_jsonl(run / "metrics.jsonl")
    resumes = events(run, "resume_from")
    bounds = [float("-inf"), *(e["time"] for e in resumes), float("inf")]
    segments = [[r["step"] for r in recs if lo <= r["time"] < hi] for lo, hi in pairwise(bounds)]
    for seg, first in zip(segments, [1, *(e["step"] + 1 for e in resumes)], strict=True):
        assert seg == list(range(first, first + len(seg))), (first, seg)
    for i, e in enumerate(resumes):
        before = {s for seg in segments[:i + 1] for s in seg}
        assert e["step"] <= max(before, default=0), e  # nothing skipped
        assert e["replayed_steps"] == len([s for s in before if s > e["step"]]), (e, sorted(before))
    last = {r["step"]: r["loss"] for r in recs}
    assert sorted(last) == list(range(1, LONG_STEPS + 1))
    assert [last[s] for s in sorted(last)] == pytest.approx(reference, rel=1e-6, abs=1e-6)
    assert recs[-1]["step"] == LONG_STEPS and recs[-1]["loss"] == pytest.approx(reference[-1], rel=1e-6)
    assert len(events(run, "finish")) == 1
    return resumes


def test_warning_signal_then_scontrol_requeue_resume_with_the_reference_losses(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_losses: list[float]) -> None:
    """srun mode. Attempt 1 gets the warning signal (what --signal=B:USR1@T delivers): every rank checkpoints
    at the next step boundary and exits 0 (the batch script reads the event), the job requeues itself, attempt
    2 resumes exactly there. Attempt 2 gets `scontrol requeue` (SIGTERM to everything, SIGKILL 5 s later): the
    ranks checkpoint if they can, else attempt 3 replays from the last periodic checkpoint. The job's log reads
    as clean stops: no traceback, no torchrun SignalException, no srun error. The run is given as a token
    budget (train.tokens, the same 30 steps of 8 x 64 tokens): every attempt's ranks read the frozen spec,
    which holds the steps it implies beside it, and `status` and `mfu-report` read them too."""
    run = tmp_path / "run"
    r = trainctl("launch", *LONG, "--set", "launcher.mode=srun", "--set", f"train.tokens={LONG_STEPS * 8 * 64}",
                 "--run-dir", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    jid = job_id(run)
    wait_step(run, 5)
    subprocess.run(["scancel", "--batch", "--signal=USR1", jid], check=True)
    wait_for(lambda: status(run)["state"] == "PENDING", "the job to requeue itself", 60)
    [stop] = events(run, "checkpoint_on_signal")
    assert stop["signal"] == "SIGUSR1" and last_step(run) == stop["step"]  # stopped right after the checkpoint
    [exit1] = events(run, "step_exit")
    assert exit1["exit_code"] == 0 and len(events(run, "requeue")) == 1
    _start_now(jid)
    wait_step(run, stop["step"] + 4)
    subprocess.run(["scontrol", "requeue", jid], check=True)
    pending = wait_for(lambda: (s := status(run))["state"] == "PENDING" and s["attempts"] == 3 and s,
                       "scontrol requeue", 60)
    assert pending["eligible_at"] and "eligible to start at" in pending["reason"], pending  # Slurm's BeginTime
    assert pending["reason"].startswith("requeued (scontrol requeue)"), pending
    # queued, it does not train: no ETA (its last step plus what is left would be a time already past)
    assert pending["projection"]["running"] is False and pending["projection"]["eta_time"] is None, pending
    _start_now(jid)
    st = wait_done(run)
    assert st["attempts"] == 3 and st["steps_done"] == LONG_STEPS and st["job_id"] == jid
    resumes = check_resumed_run(run, reference_losses)
    assert len(resumes) == 2
    assert (resumes[0]["step"], resumes[0]["replayed_steps"]) == (stop["step"], 0)  # exactly where it stopped
    term = [e for e in events(run, "checkpoint_on_signal") if e["signal"] == "SIGTERM"]
    if term:  # the SIGTERM checkpoint made it within KillWait: nothing replayed either
        assert (resumes[1]["step"], resumes[1]["replayed_steps"]) == (term[0]["step"], 0)
    assert [e["attempt"] for e in events(run, "slurm_start")] == [0, 1, 2]
    assert len(events(run, "requeue")) == 1  # the script requeued attempt 1 itself; Slurm did attempt 2
    out = (run / "logs" / f"slurm-{jid}.out").read_text()
    for noise in ("Traceback", "SignalException", "srun: error", "ChildFailedError"):
        assert noise not in out, out[-4000:]
    report = trainctl("mfu-report", str(run), "--json")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["runs"][0]["projection"]["tokens"] == {
        "done": LONG_STEPS * 8 * 64, "total": LONG_STEPS * 8 * 64, "given": True}
    assert slurm_lines(out) == [], out[-4000:]  # no "forcing job termination", no "STEP ... CANCELLED"
    assert "DUE TO JOB REQUEUE" in (run / "logs" / f"slurm-{jid}.err").read_text()  # Slurm's own, kept apart
    assert "trainctl: SIGTERM (scontrol requeue): stopping the ranks" in out, out[-4000:]
    assert f"the ranks stopped after step {stop['step']} with a committed checkpoint" in out


def rank_pid(run: Path, rank: int) -> int:
    """The pid of one training rank of this run on this machine (torchrun's agent has no RANK)."""
    out = subprocess.run(["pgrep", "-f", f"trainctl.runtime {re.escape(str(run))}"], capture_output=True,
                         text=True).stdout.split()
    for pid in out:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no process of rank {rank} among {out}")


def test_killed_rank_restarts_then_cancel_and_trainctl_resume(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                                reference_losses: list[float]) -> None:
    """torchrun mode: SIGKILL one rank -> torchrun restarts the workers of both nodes, which resume from the
    latest checkpoint; then the job is cancelled mid-run and `trainctl resume RUN` submits the run's script
    again: a new job resumes from the latest checkpoint and finishes with the reference losses."""
    run = tmp_path / "run"
    r = trainctl("launch", *LONG, "--set", "launcher.mode=torchrun", "--set", "launcher.max_restarts=2",
                 "--run-dir", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    jid = job_id(run)
    wait_step(run, 6)
    first_ckpt = wait_for(lambda: events(run, "checkpoint_committed"), "a periodic checkpoint", 60)[0]["step"]
    os.kill(rank_pid(run, 3), signal.SIGKILL)  # on the second node
    wait_for(lambda: len(events(run, "resume_from")) == 1, "the workers to restart and resume", 120)
    [start0, start1] = events(run, "start")
    killed_at = max(r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["time"] < start1["time"])
    wait_step(run, killed_at + 4)
    r = trainctl("cancel", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    wait_for(lambda: status(run)["state"] == "CANCELLED", "CANCELLED", 60)
    # Slurm says CANCELLED from the scancel on, while the batch script still waits for its step to end and
    # then writes its last line: read the log once the job has left the queue
    wait_for(lambda: jid not in squeue_ids(), "the cancelled job to leave the queue", 120)
    cancelled_at = last_step(run)
    # torchrun ignores the SIGTERM (the ranks save and exit 0): no SignalException traceback, no srun error; the
    # lost rank is one line, its peers' gloo tracebacks and torchrun's agent's lines are in their own logs
    out = (run / "logs" / f"slurm-{jid}.out").read_text()
    assert "Traceback" not in out and slurm_lines(out) == [], out[-4000:]
    assert re.search(r"trainctl: torchrun restarted the workers \(restart 1\): rank 3 on n[12] ended without a "
                     r"record \(killed by a signal", out), out[-4000:]
    peers = "".join(p.read_text(errors="replace") for p in (run / "logs" / "torchrun").rglob("stderr.log"))
    assert re.search("Connection (closed|reset) by peer", peers)  # in the ranks' own logs
    assert "trainctl: SIGTERM (scancel): stopping the ranks" in out, out[-4000:]
    if events(run, "checkpoint_on_signal"):
        assert "the ranks stopped after step" in out
    assert cancelled_at < LONG_STEPS, "the run finished before it could be cancelled: raise LONG_STEPS"
    r = trainctl("resume", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    new = job_id(run)
    assert new != jid and f"submitted job {new}" in r.stdout and "resuming" in r.stdout
    st = wait_done(run)
    assert st["job_id"] == new and st["steps_done"] == LONG_STEPS and st["attempts"] == 2
    resumes = check_resumed_run(run, reference_losses)
    assert len(resumes) == 2 and resumes[0]["step"] <= killed_at and resumes[1]["step"] <= cancelled_at
    assert resumes[0]["step"] >= first_ckpt  # from a periodic checkpoint, not from scratch
    submits = events(run, "submit")
    assert [(e["job_id"], e.get("previous_job_id")) for e in submits] == [(jid, None), (new, jid)]
    assert len(events(run, "resume_requested")) == 1
    assert len(events(run, "start")) == 3  # first start, torchrun's restart, the resubmitted job
    job = json.loads((run / "job.json").read_text())
    assert [j["job_id"] for j in job["slurm"]["jobs"]] == [jid, new]


def launch_with_faults(run: Path, env: dict[str, str], *sets: str) -> str:
    """`trainctl launch` on Slurm with a test fault in the submitting environment (sbatch exports it)."""
    r = trainctl("launch", *LONG, "--set", "launcher.mode=srun", *sets, "--run-dir", str(run), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return job_id(run)


def test_attempts_that_fail_to_start_are_requeued_then_the_run_completes(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_losses: list[float]) -> None:
    """Attempts 0 and 1 fail to launch for real (srun starts a program that does not exist, as a revoked job
    credential or a node lost at start fails a step): the trainer never begins, the batch script requeues the
    job each time, `status` shows PENDING with the time Slurm lets it start, and attempt 2 trains the whole
    run with the reference losses."""
    run = tmp_path / "run"
    jid = launch_with_faults(run, faults.encode(start_fail_attempts="0+1"))
    for n in (1, 2):
        pending = wait_for(lambda n=n: (s := status(run))["state"] == "PENDING"
                           and len(events(run, "start_failed")) == n and s, f"start failure {n} requeued", 120)
        assert "eligible to start at" in pending["reason"], pending
        _start_now(jid)
    st = wait_done(run, timeout=240)
    assert st["attempts"] == 3 and st["job_id"] == jid
    assert [e["retry"] for e in events(run, "start_failed")] == [1, 2]
    check_resumed_run(run, reference_losses)
    out = (run / "logs" / f"slurm-{jid}.out").read_text()
    assert out.count("the step failed to start") == 2 and "requeue 2 of 3" in out


def test_start_failures_beyond_the_bound_end_the_run_with_the_cause(slurm_cluster: SlurmCluster,
                                                                     tmp_path: Path) -> None:
    run = tmp_path / "run"
    jid = launch_with_faults(run, faults.encode(start_fail_attempts="0+1"), "--set", "launcher.start_retries=1")
    wait_for(lambda: status(run)["state"] == "PENDING" and events(run, "start_failed"), "the first requeue", 120)
    _start_now(jid)
    st = wait_for(lambda: (s := status(run))["state"] == "FAILED" and s, "the run to give up", 120)
    assert "launch failure" in st["reason"] and "start_retries" in st["reason"], st
    assert [e.get("gave_up", False) for e in events(run, "start_failed")] == [False, True]
    assert not events(run, "start")  # the trainer never ran


def test_a_token_file_changed_before_a_requeue_stops_the_next_attempt_naming_it(slurm_cluster: SlurmCluster,
                                                                                 tmp_path: Path) -> None:
    """A restart that no `trainctl resume` checks: the token file is rewritten in place while the job trains, every
    token changed and its size, mtime and inode as before (what the cached hash is keyed by), `scontrol requeue`
    restarts the job, and rank 0 of the next attempt stops before any step, naming the file: the sampled hash read
    at every start differs (was: the requeue trained on the other tokens)."""
    import numpy as np

    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, 200_000, dtype="<u2").tofile(tokens)
    run = tmp_path / "run"
    r = trainctl("launch", *LONG, "--set", "launcher.mode=srun", "--set", "data.synthetic=false", "--set",
                 f"data.path={tokens}", "--run-dir", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    jid = job_id(run)
    wait_step(run, 2)
    st = os.stat(tokens)
    with open(tokens, "r+b") as f:  # in place
        f.write(np.random.default_rng(1).integers(0, 256, 200_000, dtype="<u2").tobytes())
    os.utime(tokens, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(tokens).st_ino, os.stat(tokens).st_size, os.stat(tokens).st_mtime_ns) == \
        (st.st_ino, st.st_size, st.st_mtime_ns)
    subprocess.run(["scontrol", "requeue", jid], check=True)
    wait_for(lambda: status(run)["state"] == "PENDING", "scontrol requeue", 60)
    steps = last_step(run)
    _start_now(jid)
    st = wait_for(lambda: (s := status(run))["state"] == "FAILED" and s, "the next attempt to refuse the file", 150)
    why = f"data file {tokens} changed since the run recorded it (job.json): same size, other content"
    assert why in st["reason"], st
    assert last_step(run) == steps  # no step ran on the other file
    assert f"trainctl: rank 0 failed: {why}" in (run / "logs" / f"slurm-{jid}.out").read_text()


def slurm_lines(log: str) -> list[str]:
    """The lines of a job's log that Slurm wrote (srun's, slurmstepd's, torchrun's agent's)."""
    return [ln for ln in log.splitlines() if re.search(sbatch_template.SLURM_LINE, ln)]


def test_a_stop_before_the_ranks_exist_reaches_them_and_the_log_reads_clean(slurm_cluster: SlurmCluster,
                                                                            tmp_path: Path) -> None:
    """torchrun mode; each node's task holds the step at start-up (a launcher.setup line waits for a file), so
    every stop below comes before any rank exists.

    Attempt 0 gets Slurm's time-limit warning (USR1 to the batch script, as --signal=B:USR1@GRACE sends it): the
    ranks, started only afterwards, read the stop the batch script recorded and stop before their first step,
    and the job requeues itself. Attempt 1 is scancel'ed: `status` says CANCELLED before training started.
    Neither attempt trains a step, and the job's log reads as clean stops: Slurm's own lines are in slurm-J.err."""
    run, held, go = tmp_path / "run", tmp_path / "held", tmp_path / "go"
    hold = (f'if [ -n "${{SLURM_STEP_ID:-}}" ]; then touch "{held}-$SLURMD_NODENAME"; '
            f'while [ ! -e "{go}" ]; do sleep 0.2; done; fi')
    r = trainctl("launch", *LONG, "--set", "launcher.mode=torchrun", "--set", f"launcher.setup={json.dumps([hold])}",
                 "--run-dir", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    jid = job_id(run)

    def stop_held_step(*stop: str) -> None:
        wait_for(lambda: len(list(tmp_path.glob("held-n*"))) == 2, "both nodes' tasks held at start-up", 120)
        subprocess.run(stop, check=True)
        wait_for(lambda: len(events(run, "signal")) == len(events(run, "slurm_start")), "the recorded stop", 30)
        go.touch()  # torchrun starts the ranks now: after the stop

    stop_held_step("scancel", "--batch", "--signal=USR1", jid)
    pending = wait_for(lambda: (s := status(run))["state"] == "PENDING" and s, "the job to requeue itself", 120)
    assert pending["reason"].startswith("requeued (the job requeued itself)"), pending
    [early] = events(run, "checkpoint_on_signal")
    assert early["signal"] == "SIGUSR1" and early["before_first_step"] is True, early
    for f in (go, *tmp_path.glob("held-n*")):
        f.unlink()
    _start_now(jid)
    stop_held_step("scancel", jid)
    st = wait_for(lambda: (s := status(run))["state"] == "CANCELLED" and s, "CANCELLED", 60)
    assert st["reason"] == "cancelled (SIGTERM: scancel); before the first step, nothing to save", st
    assert read_jsonl(run / "metrics.jsonl") == []  # no step trained in either attempt
    log = (run / "logs" / f"slurm-{jid}.out").read_text()
    assert "trainctl: the ranks stopped before their first step; nothing new to save" in log, log
    assert "requeueing job" in log and "trainctl: SIGTERM (scancel): stopping the ranks" in log, log
    assert slurm_lines(log) == [] and "Traceback" not in log, log
    assert "CANCELLED" in (run / "logs" / f"slurm-{jid}.err").read_text()  # Slurm's own lines, kept apart


def test_a_copied_run_and_a_fresh_launch_leave_another_runs_checkpoints_alone(slurm_cluster: SlurmCluster,
                                                                             tmp_path: Path) -> None:
    """docs/FAILURES.md, "Run directories and checkpoint directories", on Slurm: a run with its checkpoint directory
    outside the run directory trains two steps; a fresh launch pointed at that directory and a `cp -a` copy of the
    run resumed are both refused before anything is submitted, and the directory keeps its bytes."""
    ckdir = tmp_path / "scratch" / "ck"
    one_rank = ["--set", "launcher.backend=slurm", "--set", "cluster.nodes=1", "--set", "cluster.gpus_per_node=1",
                "--set", "parallel.tp=1", "--set", "parallel.pp=1", "--set", "parallel.dp=1",
                "--set", "parallel.sequence_parallel=false", "--set", "train.global_batch=4"]
    run = tmp_path / "run"
    r = trainctl("launch", str(TINY), *one_rank, "--set", "train.steps=2", "--set", "checkpoint.every_steps=2",
                 "--set", f"checkpoint.dir={ckdir}", "--run-dir", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    wait_done(run)
    before = {str(p): p.stat().st_mtime for p in sorted(ckdir.rglob("*"))}
    assert any(p.endswith("step-00000002") for p in before), before
    new = tmp_path / "new"
    r = trainctl("launch", str(TINY), *one_rank, "--set", "train.steps=4", "--set", f"checkpoint.dir={ckdir}",
                 "--run-dir", str(new))
    assert r.returncode == 2, r.stdout + r.stderr
    assert (f"error: checkpoint directory {ckdir} is not empty: it holds checkpoints of step 2 of run {run}, and a "
            "new run starts from its own initialisation") in r.stderr
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(run), str(copy)], check=True)
    r = trainctl("resume", str(copy), "--set", "train.steps=4")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"error: checkpoint directory {ckdir} belongs to run {run}, of which {copy} is a copy" in r.stderr
    # nothing submitted: a submission makes its run directory first, a resubmission records its job
    assert not new.exists() and job_id(copy) == job_id(run)
    assert {str(p): p.stat().st_mtime for p in sorted(ckdir.rglob("*"))} == before


def test_a_run_directory_deleted_under_the_job_stays_deleted(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """No launcher watches a Slurm job's run directory: its ranks notice it gone after their step, agree to stop
    together, and nothing of the run is made again (was: metrics.jsonl, heartbeats and a half-written checkpoint
    came back). Two ranks saving every other step, so a save may be in flight when it goes."""
    run = tmp_path / "run"
    r = trainctl("launch", str(TINY), "--set", "launcher.backend=slurm", "--set", "cluster.nodes=1",
                 "--set", "cluster.gpus_per_node=2", "--set", "parallel.tp=1", "--set", "parallel.pp=1",
                 "--set", "parallel.dp=2", "--set", "parallel.sequence_parallel=false",
                 "--set", "train.global_batch=4", "--set", "train.steps=100000",
                 "--set", "checkpoint.every_steps=2", "--run-dir", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    jid = job_id(run)
    try:
        wait_step(run, 3)
        # gone at once, as the ranks see it (a rename is atomic), then removed: an rmtree of the live directory can
        # lose every race to ranks that save every other step, and leave it in place
        gone = run.with_name("run.deleted")
        run.rename(gone)
        shutil.rmtree(gone, ignore_errors=True)
        wait_for(lambda: jid not in squeue_ids(), "the job to end", 120)
        assert not run.exists(), sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    finally:  # a failure here must not leave the job training on for the rest of the suite
        subprocess.run(["scancel", jid], check=False)


def test_a_requeued_job_does_not_train_on_a_hand_edited_spec(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """spec.yaml edited by hand while the job ran: the job's next attempt (here its own requeue after Slurm's
    warning signal) refuses to start on an edit no one saw, in one line naming the field, and trains nothing;
    `trainctl resume` then shows the edit and records it, as for any spec change."""
    run = tmp_path / "run"
    r = trainctl("launch", str(TINY), "--set", "launcher.backend=slurm", "--set", "cluster.nodes=1",
                 "--set", "cluster.gpus_per_node=2", "--set", "parallel.tp=1", "--set", "parallel.pp=1",
                 "--set", "parallel.dp=2", "--set", "parallel.sequence_parallel=false",
                 "--set", "train.global_batch=4", "--set", "train.steps=100000", "--run-dir", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    jid = job_id(run)
    wait_step(run, 2)
    spec = run / "spec.yaml"
    spec.write_text(spec.read_text().replace("\n  lr: 0.001\n", "\n  lr: 0.5\n"))
    subprocess.run(["scancel", "--batch", "--signal=USR1", jid], check=True)
    wait_for(lambda: status(run)["state"] == "PENDING", "the job to requeue itself", 60)
    stopped_at = last_step(run)
    _start_now(jid)
    wait_for(lambda: jid not in squeue_ids(), "the requeued attempt to refuse the edit", 180)
    refused = [e for e in events(run, "failure") if "was edited since trainctl last wrote it" in e["error"]]
    assert refused and "train.lr: 0.001 -> 0.5" in refused[0]["error"], events(run, "failure")
    assert last_step(run) == stopped_at  # nothing trained on the edit
    shown = trainctl("resume", str(run), "--dry-run")
    assert "train.lr: 0.001 -> 0.5" in shown.stdout + shown.stderr, shown.stdout + shown.stderr


FP8_STEPS = 4
FP8_RUN = ["--set", "train.precision=fp8", "--set", "train.fp8_recipe=rowwise", "--set", f"train.steps={FP8_STEPS}",
           "--set", "parallel.dp=1", "--set", "train.global_batch=8"]


def test_fp8_job_on_two_nodes_has_the_local_fp8_losses(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """train.precision fp8 (emulated on these CPU nodes) over TP 2 (+ SP) x PP 2 across two Slurm nodes: the losses
    of the same spec run locally, bit for bit (the same FP8 quantization in the same layout), and mfu-report
    states the FP8 MFU convention."""
    local, run = tmp_path / "local", tmp_path / "run"
    r = trainctl("launch", str(TINY), *FP8_RUN, "--set", "cluster.gpus_per_node=4", "--run-dir", str(local))
    assert r.returncode == 0, r.stdout + r.stderr
    r = trainctl("launch", str(TINY), *FP8_RUN, "--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=2",
                 "--set", "launcher.backend=slurm", "--set", "launcher.mode=srun", "--run-dir", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    wait_done(run)
    assert len(losses(run)) == FP8_STEPS and losses(run) == losses(local)
    report = trainctl("mfu-report", str(run), "--json")
    (summary,) = [x["summary"] for x in json.loads(report.stdout)["runs"]]
    assert summary["peak"]["convention"].startswith("fp8 run, FP8 emulated on the CPU")

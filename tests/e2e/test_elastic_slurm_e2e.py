"""Elastic node ranges on the real local Slurm cluster: a two-node torchrun-mode job with cluster.min_nodes: 1
loses node n2 (its torchrun agent and its rank SIGKILLed, as a crashed node's would be) after a checkpoint and
finishes on n1 at dp 1 with twice the micro-batches. Its losses stay on an uninterrupted run's curve, the global
batch is kept, the resize is recorded, `status` says COMPLETED and `mfu-report` shows the node count change
(docs/design/launch.md, "Elastic node ranges").

How n2 is lost: `scontrol listpids JOB.0 n2` lists the processes of the step's task on n2 (Slurm's own process
tracking: the task, i.e. the node's torchrun agent, and the ranks it started), and each gets SIGKILL. A real
node loss also takes slurmd with it, which this one-host cluster cannot do without ending n1's step too (both
slurmds share the machine); what the job's peers see is the same: the agent and its ranks gone at once. Slurm
offers no signal to one task of a step (`scancel --signal` reaches every task)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import slurm_fixtures
from cli_utils import trainctl
from resume_utils import curve, ok
from slurm_fixtures import SlurmCluster, step_exited, step_pids
from spec_utils import TINY, deep_update, write_spec
from trainer_utils import max_rel_diff, run_trainer

from trainctl.rundir.paths import RunPaths, read_jsonl
from trainctl.runtime.train import faults

pytestmark = pytest.mark.slow

STEPS, EVERY = 8, 2
# Small rendezvous timeouts (torchrun's --rdzv-conf as its variable, through launcher.env) so the survivor
# re-forms the group in seconds; torch's default last call is 30 s. The first round closes once both nodes
# joined; with a last call of 2 s it closed on n1 alone once, n2's agent starting 2 s later on the loaded host.
RDZV_CONF = "join_timeout=60,last_call_timeout=6,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2"
SPEC = deep_update(TINY, {
    "name": "elastic-slurm",
    "model": {"layers": 2},
    "parallel": {"dp": "auto"},
    "train": {"steps": STEPS, "global_batch": 8},
    "checkpoint": {"every_steps": EVERY, "keep_last": 2},
    "cluster": {"nodes": 2, "min_nodes": 1, "gpus_per_node": 1},
    "launcher": {"backend": "slurm", "mode": "torchrun", "max_restarts": 2, "env": {"PET_RDZV_CONF": RDZV_CONF}},
})

def job_listed(job: str) -> bool:
    return bool(subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip())


def lose_node(job: str, node: str) -> list[int]:
    """SIGKILL every process of the training step's task on `node` (its agent and ranks); their pids."""
    pids = step_pids(job, node)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(pid, signal.SIGKILL)
    return pids


def test_losing_a_node_finishes_on_the_other_on_the_curve(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    straight.mkdir()
    write_spec(straight / "spec.yaml", base=SPEC)
    ok(run_trainer(straight, 2, dump=False), "uninterrupted run on two ranks")

    spec, run = tmp_path / "spec.yaml", tmp_path / "run"
    write_spec(spec, base=SPEC)
    r = trainctl("launch", str(spec), "--run-dir", str(run), env=faults.encode(slow_rank="0:0.2+1:0.2"))  # paced steps
    assert r.returncode == 0, r.stdout + r.stderr
    paths = RunPaths(run)
    job = json.loads(paths.job.read_text())["job_id"]
    slurm_fixtures.wait_for(lambda: any(e["event"] == "checkpoint_committed" and e["step"] >= EVERY
                                        for e in read_jsonl(paths.events)), "a checkpoint on two nodes", 60, 0.2)
    t_kill = time.time()
    assert lose_node(job, "n2"), "no process of the step's task on n2"
    slurm_fixtures.wait_for(lambda: step_exited(paths), "the training step to end", 90, 0.5)
    # the batch script's verdict line comes after step_exit (it reads the events first): wait for the job
    slurm_fixtures.wait_for(lambda: not job_listed(job), "the batch script to end", 60, 0.5)

    ev = read_jsonl(paths.events)
    log = (paths.logs / f"slurm-{job}.out").read_text()
    starts = [e for e in ev if e["event"] == "start"]
    assert [(e["world_size"], e["nodes"], e["dp"], e["micro_batches"]) for e in (starts[0], starts[-1])] == [
        (2, 2, 2, 4), (1, 1, 1, 8)], log[-3000:]
    resize = [e for e in ev if e["event"] == "elastic_resize"]
    assert len(resize) == 1 and resize[0]["time"] > t_kill
    assert {k: resize[0][k] for k in ("nodes", "previous_nodes", "dp", "micro_batches", "global_batch")} == {
        "nodes": 1, "previous_nodes": 2, "dp": 1, "micro_batches": 8, "global_batch": 8}
    assert [e["exit_code"] for e in ev if e["event"] == "step_exit"] != [0]  # n2's task did end badly ...
    assert "trainctl: every step done" in log  # ... and the batch script still calls the run done

    last = {s: loss for s, loss, _ in curve(run)}  # each step's last run (replayed steps included)
    assert sorted(last) == list(range(1, STEPS + 1))
    rel = max_rel_diff([last[s] for s in sorted(last)], [loss for _, loss, _ in curve(straight)])
    print(f"elastic on Slurm: max relative loss difference {rel:.2e}; training again on n1 "
          f"{starts[-1]['time'] - t_kill:.1f} s after the kill")
    assert rel <= 1e-5

    st = json.loads(trainctl("status", str(run), "--json").stdout)
    assert st["state"] == "COMPLETED" and st["steps_done"] == STEPS, st
    rep = trainctl("mfu-report", str(run), "--json")
    assert rep.returncode == 0, rep.stderr
    segments = json.loads(rep.stdout)["runs"][0]["nodes"]["segments"]
    assert [(x["nodes"], x["world_size"], x["micro_batches"]) for x in (segments[0], segments[-1])] == [
        (2, 2, 4), (1, 1, 8)]
    text = trainctl("mfu-report", str(run)).stdout
    assert "elastic: 2 -> 1 node" in " ".join(text.split()), text

"""The real local Slurm test cluster (slurm/local-cluster.sh): real sbatch/srun submissions on n1 and n2."""

from __future__ import annotations

import fcntl
import os
import re
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from slurm_fixtures import SlurmCluster, slurm_cluster, wait_for  # noqa: F401  (the fixture; conftest may import it too)

from trainctl.spec.models import EstimateSpec

pytestmark = pytest.mark.slow

TASK_SCRIPT = r"""#!/bin/bash
first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
echo "BATCH node=$SLURMD_NODENAME first=$first resolves=$(getent hosts "$first" | awk '{print $1}')"
srun bash -c 'echo "TASK procid=$SLURM_PROCID localid=$SLURM_LOCALID ntasks=$SLURM_NTASKS nodeid=$SLURM_NODEID \
node=$SLURMD_NODENAME nodelist=$SLURM_JOB_NODELIST cuda=${CUDA_VISIBLE_DEVICES:-unset}"'
"""

REQUEUE_SCRIPT = r"""#!/bin/bash
echo "ATTEMPT restart=${SLURM_RESTART_COUNT:-0} node=$SLURMD_NODENAME"
if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then sleep 120; fi
echo "DONE restart=${SLURM_RESTART_COUNT:-0}"
"""

# Preemption as a launcher sees it: the ranks (srun tasks) get SIGTERM at once (the partition's GraceTime
# gives them 10 s), the batch script does not; it requeues the job itself and the next attempt runs.
PREEMPT_SCRIPT = r"""#!/bin/bash
echo "ATTEMPT restart=${SLURM_RESTART_COUNT:-0}"
if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then
    srun "$TASK_PYTHON" preempt_task.py
    echo "STEP ended rc=$?"
    scontrol requeue "$SLURM_JOB_ID"
    sleep 120
fi
echo "DONE restart=${SLURM_RESTART_COUNT:-0}"
"""

# A task is one process that handles SIGTERM itself, as a rank does. (A shell whose `sleep & wait` child
# slurmstepd signalled first could end before its own signal came: CI, about once in seven runs under load.)
# Like the trainer's ranks, whose checkpoint on a signal is collective, a task stops only when every task has
# its signal (or after 20 s): srun may return once one task ended and the step was cancelled, and the requeue
# then kills a remote task whose slurmd has not signalled it yet.
PREEMPT_TASK = r"""
import os, signal, sys, time

rank = os.environ["SLURM_PROCID"]


def on_term(signum, frame):
    print(f"TASK {rank} SIGTERM", flush=True)
    open(f"sigterm-{rank}", "w").close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(os.path.exists(f"sigterm-{r}") for r in "01"):
        time.sleep(0.1)
    sys.exit(99)


signal.signal(signal.SIGTERM, on_term)
print(f"TASK {rank} up", flush=True)
while True:
    time.sleep(1)
"""


def _run(*cmd: str, timeout: float = 60) -> str:
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def _job_state(job_id: str) -> str:
    out = _run("scontrol", "show", "job", "-o", job_id)
    match = re.search(r"\bJobState=(\S+)", out)
    assert match, out
    return match.group(1)


def _wait_state(job_id: str, *states: str, timeout: float = 30) -> str:
    return wait_for(lambda: (s := _job_state(job_id)) in states and s, f"job {job_id} in {states}", timeout)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _start_now(job_id: str) -> None:
    """A requeued job waits ~121 s (BeginTime); let it start at once.

    Not in the same second as the requeue: slurmd revokes the old attempt's credential with a one-second
    resolution, and an attempt started within that second dies with "Job credential revoked" (FAILED).
    """
    time.sleep(2)

    def attempt() -> bool:
        proc = subprocess.run(
            ["scontrol", "update", f"jobid={job_id}", "StartTime=now"], capture_output=True, text=True, timeout=30
        )
        return proc.returncode == 0

    wait_for(attempt, f"scontrol update jobid={job_id} StartTime=now", timeout=20)


@pytest.fixture(scope="module")
def multinode_job(slurm_cluster: SlurmCluster, tmp_path_factory) -> str:  # noqa: F811
    work = tmp_path_factory.mktemp("slurm-multinode")
    script = work / "tasks.sh"
    script.write_text(TASK_SCRIPT)
    out = work / "out.txt"
    _run(
        "sbatch", "--wait", "-N2", "--ntasks-per-node=2", "--gpus-per-node=2", "--time=2",
        f"--chdir={work}", f"--output={out}", "--job-name=trainctl-test-tasks", str(script),
        timeout=60,
    )  # fmt: skip
    return out.read_text()


def test_status_exits_zero_when_up(slurm_cluster: SlurmCluster) -> None:  # noqa: F811
    proc = slurm_cluster.run("status")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for daemon in ("munged", "slurmctld", "slurmd n1", "slurmd n2"):
        assert re.search(rf"{daemon}\s+running", proc.stdout), proc.stdout
    assert "debug*" in proc.stdout


def test_up_twice_is_idempotent_and_fast(slurm_cluster: SlurmCluster) -> None:  # noqa: F811
    pids_before = _daemon_pids(slurm_cluster)
    t0 = time.monotonic()
    proc = slurm_cluster.run("up")
    elapsed = time.monotonic() - t0
    print(f"\nfirst up (this session): {slurm_cluster.up_seconds:.1f}s; up again: {elapsed:.2f}s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "starting" not in proc.stdout and "restarting" not in proc.stdout, proc.stdout
    assert _daemon_pids(slurm_cluster) == pids_before  # nothing was restarted
    states = _run("sinfo", "-h", "-N", "-o", "%N %T")
    assert set(states.split()) <= {"n1", "n2", "idle", "mixed", "allocated", "completing"}, states


def test_up_waits_for_a_concurrent_up_and_no_daemon_keeps_the_lock(slurm_cluster: SlurmCluster) -> None:  # noqa: F811
    """Each pytest worker calls `up` for its session, sometimes in the same second; unserialized, both started
    munged and one failed on munged's socket lock (CI). The daemons must not inherit the lock, or the next
    `up` would wait forever."""
    lock_path = Path(os.environ.get("TRAINCTL_SLURM_DIR", "/var/lib/trainctl-slurm")) / ".lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a concurrent `up` holds it
        waiting = subprocess.Popen([str(slurm_cluster.script), "up"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, text=True)
        time.sleep(1.0)
        assert waiting.poll() is None, "up ran while another up held the lock"
    out, _ = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, out
    for pid in _daemon_pids(slurm_cluster):
        held = {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir() if fd.is_symlink()}
        assert str(lock_path) not in held, f"daemon pid {pid} keeps {lock_path} open"


def test_up_brings_back_node_daemons_that_were_killed(slurm_cluster: SlurmCluster) -> None:  # noqa: F811
    """What a machine holds after the session that started the cluster was killed (CI's checkout then runs
    `up`): daemons gone without cleaning up, their pid files left behind naming dead (or unreaped) processes.
    A new slurmd writes its pid file a few milliseconds after its launcher returns; `up` once read the
    missing file at that moment, under CI load, as "slurmd -N n2 exited" and failed every Slurm test."""
    before = _daemon_pids(slurm_cluster)
    killed = [int(pid) for pid in before[2:]]  # munged, slurmctld, then the two slurmd (status's order)
    assert len(killed) == 2, before
    for pid in killed:
        os.kill(pid, 9)
    wait_for(lambda: all(_dead_or_unreaped(pid) for pid in killed), timeout=10, what="the killed slurmd to exit")
    proc = slurm_cluster.run("up")  # the pid files still name the killed daemons
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "starting slurmd -N n1" in proc.stdout and "starting slurmd -N n2" in proc.stdout, proc.stdout
    after = _daemon_pids(slurm_cluster)
    assert after[:2] == before[:2], (before, after)  # munged and slurmctld were left alone
    assert not set(after[2:]) & set(before[2:]), (before, after)
    # The nodes take work again, both of them.
    out = _run("srun", "-N2", "--ntasks-per-node=1", "--time=1", "hostname", timeout=60)
    assert len(out.split()) == 2, out


def _dead_or_unreaped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):
        return True


def _daemon_pids(cluster: SlurmCluster) -> list[str]:
    out = cluster.run("status").stdout
    return re.findall(r"\(pid (\d+)\)", out)


def test_two_nodes_two_tasks_each_with_gpus(multinode_job: str) -> None:
    tasks = [dict(kv.split("=", 1) for kv in line.split()[1:]) for line in multinode_job.splitlines()
             if line.startswith("TASK ")]  # fmt: skip
    assert len(tasks) == 4, multinode_job
    assert sorted(int(t["procid"]) for t in tasks) == [0, 1, 2, 3]
    assert {t["ntasks"] for t in tasks} == {"4"}
    assert {t["nodelist"] for t in tasks} == {"n[1-2]"}
    by_node: dict[str, list[dict[str, str]]] = {}
    for t in tasks:
        by_node.setdefault(t["node"], []).append(t)
    assert sorted(by_node) == ["n1", "n2"]
    for node, node_tasks in by_node.items():
        assert sorted(t["localid"] for t in node_tasks) == ["0", "1"], node
        assert len({t["nodeid"] for t in node_tasks}) == 1, node
        # Block distribution: node k runs PROCIDs 2k and 2k+1; every task sees the node's two GPUs.
        nodeid = int(node_tasks[0]["nodeid"])
        assert sorted(int(t["procid"]) for t in node_tasks) == [2 * nodeid, 2 * nodeid + 1]
        for t in node_tasks:
            assert t["cuda"] != "unset", f"no CUDA_VISIBLE_DEVICES on {node}:\n{multinode_job}"
            assert len(t["cuda"].split(",")) == 2, t


def test_first_host_of_allocation_resolves(multinode_job: str) -> None:
    batch = next(line for line in multinode_job.splitlines() if line.startswith("BATCH "))
    fields = dict(kv.split("=", 1) for kv in batch.split()[1:])
    assert fields["first"] == "n1"
    assert fields["node"] == "n1"  # the batch script runs on the first node
    assert fields["resolves"] == "127.0.0.1"
    assert socket.gethostbyname(fields["first"]) == "127.0.0.1"


def test_requeue_runs_again_with_restart_count(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    """Also the source of plan's `estimate.requeue_s` default: Slurm holds a requeued job for its requeue delay
    (slurm.conf(5): `requeue_delay` defaults to AuthInfo's cred_expire, 120 s) and makes it eligible a second
    after that; this cluster sets neither."""
    script = tmp_path / "requeue.sh"
    script.write_text(REQUEUE_SCRIPT)
    out = tmp_path / "out.txt"
    job_id = _run(
        "sbatch", "--parsable", "--requeue", "--open-mode=append", "--time=2", f"--chdir={tmp_path}",
        f"--output={out}", "--job-name=trainctl-test-requeue", str(script),
    ).strip().split(";")[0]  # fmt: skip
    try:
        wait_for(lambda: "ATTEMPT restart=0" in _read(out), "the first attempt to start")
        requeued = time.time()
        _run("scontrol", "requeue", job_id)
        _wait_state(job_id, "PENDING")
        eligible = re.search(r"\bEligibleTime=(\S+)", _run("scontrol", "show", "job", "-o", job_id))
        assert eligible, "no EligibleTime"
        delay = datetime.strptime(eligible[1], "%Y-%m-%dT%H:%M:%S").timestamp() - requeued  # local time, as time()
        assert abs(delay - (EstimateSpec().requeue_s + 1)) <= 2, (eligible[1], delay)
        _start_now(job_id)
        _wait_state(job_id, "COMPLETED")
        text = wait_for(lambda: "DONE restart=1" in (t := _read(out)) and t, "the second attempt's output")
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    assert text.count("ATTEMPT ") == 2, text
    assert text.index("ATTEMPT restart=0") < text.index("ATTEMPT restart=1") < text.index("DONE restart=1"), text
    assert "DONE restart=0" not in text, text
    assert "DUE TO JOB REQUEUE" in text, text


def test_preemption_signals_ranks_and_job_requeues_itself(
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    script = tmp_path / "preempt.sh"
    script.write_text(PREEMPT_SCRIPT)
    (tmp_path / "preempt_task.py").write_text(PREEMPT_TASK)
    out = tmp_path / "out.txt"
    job_id = _run(
        "sbatch", "--parsable", "--requeue", "--open-mode=append", "--time=2", "-N2", "--gpus-per-node=4",
        f"--export=ALL,TASK_PYTHON={sys.executable}", f"--chdir={tmp_path}", f"--output={out}",
        "--job-name=trainctl-test-preempt", str(script),
    ).strip().split(";")[0]  # fmt: skip
    try:
        wait_for(lambda: len(re.findall(r"TASK \d up", _read(out))) >= 2, "both tasks of the first attempt to start")
        # A job in the higher-tier partition needs a GPU: the debug job is preempted.
        _run(
            "sbatch", "--parsable", "--partition=urgent", "-N1", "--gpus-per-node=1", "--time=1",
            f"--chdir={tmp_path}", "--output=/dev/null", "--job-name=trainctl-test-urgent", "--wrap=true",
        )  # fmt: skip
        _wait_state(job_id, "PENDING", timeout=30)
        _start_now(job_id)
        _wait_state(job_id, "COMPLETED")
        text = wait_for(lambda: "DONE restart=1" in (t := _read(out)) and t, "the second attempt's output")
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    # each task's own record: srun may be gone before it forwards a remote task's last output line
    assert sorted(p.name for p in tmp_path.glob("sigterm-*")) == ["sigterm-0", "sigterm-1"], text
    assert "STEP ended rc=" in text, text
    assert text.index("ATTEMPT restart=0") < text.index("ATTEMPT restart=1"), text
    assert "DONE restart=0" not in text, text

"""Elastic node ranges with real torchrun agents: two agents on this machine act as two nodes (c10d rendezvous
on 127.0.0.1, one rank each); after a checkpoint one agent and its rank are SIGKILLed as a lost node would be,
the other re-rendezvouses alone (cluster.min_nodes: 1) and finishes at dp 1 with twice the micro-batches. Its
losses stay on an uninterrupted run's curve and the global batch is kept (docs/design/launch.md, "Elastic node
ranges")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cli_utils import trainctl
from resume_utils import curve, events, ok
from spec_utils import TINY, deep_update, write_spec
from trainer_utils import ROOT, free_port, max_rel_diff, rank_env, run_trainer

from trainctl.launch.procs import children
from trainctl.runtime.train import faults

pytestmark = pytest.mark.slow

STEPS, EVERY = 12, 2
SPEC = deep_update(TINY, {
    "name": "elastic",
    "parallel": {"dp": "auto"},
    "train": {"steps": STEPS, "global_batch": 8},
    "checkpoint": {"every_steps": EVERY, "keep_last": 2},
    "cluster": {"nodes": 2, "min_nodes": 1, "gpus_per_node": 1},
    "launcher": {"backend": "slurm", "mode": "torchrun", "max_restarts": 2},
})
# Small rendezvous timeouts so the survivor re-forms the group in seconds (torch's defaults: 30 s last call).
RDZV_CONF = "join_timeout=60,last_call_timeout=2,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2"


def write_run(root: Path, name: str) -> Path:
    run = root / name
    run.mkdir(parents=True)
    write_spec(run / "spec.yaml", base=SPEC)
    return run


def agent(run: Path, port: int, host: bool, env: dict[str, str]) -> subprocess.Popen:
    """One node's torchrun agent, in its own session (its process group is the 'node'). is_host: on one
    machine both agents would match 127.0.0.1 and each host a rendezvous of its own (checked: two worlds of 1)."""
    log = open(run / f"agent-{'a' if host else 'b'}.log", "w")  # noqa: SIM115 - the agent holds it
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
           f"--rdzv-conf={RDZV_CONF},is_host={int(host)}", "--max-restarts=2", "-m", "trainctl.runtime", str(run)]
    return subprocess.Popen(cmd, cwd=ROOT, env=rank_env(env), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for(what: str, cond: Any, procs: list[subprocess.Popen], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert all(p.poll() is None for p in procs), f"an agent ended before {what}"
        time.sleep(0.1)


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL an agent's process group and its ranks (torchrun starts each rank in a session of its own)."""
    ranks = children(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    proc.wait()


def test_losing_a_node_finishes_on_the_other_on_the_curve(tmp_path: Path) -> None:
    pace = faults.encode(slow_rank="0:0.25+1:0.25")  # steps slow enough to kill a node mid-run
    straight = write_run(tmp_path, "straight")
    ok(run_trainer(straight, 2, dump=False), "uninterrupted run on two ranks")

    run = write_run(tmp_path, "elastic")
    port = free_port()
    b = agent(run, port, host=False, env=pace)  # the client waits for the store; the host joins right after
    a = agent(run, port, host=True, env=pace)
    try:
        wait_for("a checkpoint committed at step 4 on two nodes", lambda: any(
            e["event"] == "checkpoint_committed" and e["step"] >= 4 for e in events(run)), [a, b])
        t_kill = time.time()
        kill_node(b)
        assert a.wait(timeout=120) == 0, (run / "agent-a.log").read_text()[-3000:]
    finally:
        for p in (a, b):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)

    ev = events(run)
    starts = [e for e in ev if e["event"] == "start"]
    assert [(e["world_size"], e["nodes"], e["dp"], e["micro_batches"]) for e in (starts[0], starts[-1])] == [
        (2, 2, 2, 4), (1, 1, 1, 8)]
    resize = [e for e in ev if e["event"] == "elastic_resize"]
    assert len(resize) == 1 and resize[0]["time"] > t_kill
    assert {k: resize[0][k] for k in ("nodes", "previous_nodes", "dp", "micro_batches", "previous_micro_batches",
                                      "global_batch")} == {
        "nodes": 1, "previous_nodes": 2, "dp": 1, "micro_batches": 8, "previous_micro_batches": 4, "global_batch": 8}
    resumed = [e for e in ev if e["event"] == "resume_from" and e["time"] > t_kill]
    assert resumed and resumed[0]["step"] >= 4 and resumed[0]["same_layout"] is False
    assert [e for e in ev if e["event"] == "finish"][-1]["steps"] == STEPS

    # each step's last run (a replayed step's earlier one was lost with the node) against the straight run
    last = {s: loss for s, loss, _ in curve(run)}
    assert sorted(last) == list(range(1, STEPS + 1))
    want = [loss for _, loss, _ in curve(straight)]
    rel = max_rel_diff([last[s] for s in sorted(last)], want)
    detect = min(e["time"] for e in ev if e["event"] == "failure" and e["time"] > t_kill) - t_kill
    back = starts[-1]["time"] - t_kill
    print(f"elastic: max relative loss difference {rel:.2e}; survivor's failure {detect:.1f} s and its "
          f"restart on one node {back:.1f} s after the kill")
    assert rel <= 1e-5

    # mfu-report shows the node count and throughput over time
    rep = trainctl("mfu-report", str(run), "--json", env=rank_env())
    assert rep.returncode == 0, rep.stderr
    nodes = json.loads(rep.stdout)["runs"][0]["nodes"]
    assert [(x["nodes"], x["world_size"], x["micro_batches"]) for x in nodes["segments"]][-1] == (1, 1, 8)
    assert nodes["segments"][0]["nodes"] == 2 and all(x["tokens_per_s"] > 0 for x in nodes["segments"])

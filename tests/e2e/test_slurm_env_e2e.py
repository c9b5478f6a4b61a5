"""launcher.setup, launcher.python and launcher.nccl in one real Slurm job (torchrun mode, 1 node x 2 ranks, 2
steps of the tiny model): the setup lines run in the batch script and again in the node's task before
torchrun, launcher.python starts torchrun, and what the lines export, with the NCCL variables, is in each
rank's own environment. The container options are checked by rendering (pyxis is not installed here:
tests/unit/test_launch_environment.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from env_probe import PROBE_VALUE, make_probe
from paths import REPO
from slurm_fixtures import SlurmCluster, wait_for

from trainctl.rundir import read_jsonl

pytestmark = pytest.mark.slow

TINY = REPO / "trainctl" / "recipes" / "tiny-cpu.yaml"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainctl", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, stdin=subprocess.DEVNULL)


def test_setup_lines_and_python_reach_the_ranks_of_a_slurm_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    probe = make_probe(tmp_path / "probe")
    run = tmp_path / "run"
    r = cli("launch", str(TINY), "--set", "launcher.backend=slurm", "--set", "launcher.mode=torchrun",
            "--set", "cluster.nodes=1", "--set", "cluster.gpus_per_node=2", "--set", "parallel.tp=1",
            "--set", "parallel.pp=1", "--set", "parallel.dp=2", "--set", "parallel.sequence_parallel=false",
            "--set", "train.global_batch=4", "--set", "train.steps=2",
            "--set", f"launcher.setup={json.dumps(probe.setup)}", "--set", f"launcher.python={probe.python}",
            "--set", "launcher.nccl.debug=INFO", "--set", "launcher.nccl.socket_ifname=lo", "--run-dir", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    script = (run / "launch.sh").read_text()
    assert probe.setup[0] in script and "export NCCL_SOCKET_IFNAME=lo" in script  # the lines verbatim, ours quoted
    state = wait_for(lambda: (s := json.loads(cli("status", str(run), "--json").stdout))["state"]
                     in ("COMPLETED", "FAILED", "CANCELLED") and s, "the job to end", 180, 0.5)
    out = "\n".join(p.read_text()[-3000:] for p in (run / "logs").glob("slurm-*.out"))
    assert state["state"] == "COMPLETED", out
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    assert probe.where_setup_ran() == ["none", "0"], out  # the batch script, then the node's task (step 0)
    assert probe.python_saw() == [PROBE_VALUE]  # one torchrun, started by launcher.python after the setup
    assert probe.python_saw("trainctl.runtime.faults") == [PROBE_VALUE]  # the batch script's own use, after it
    seen = probe.ranks_saw()
    assert sorted(seen) == [0, 1], out
    assert all(v == {"TRAINCTL_PROBE": PROBE_VALUE, "NCCL_DEBUG": "INFO"} for v in seen.values()), seen

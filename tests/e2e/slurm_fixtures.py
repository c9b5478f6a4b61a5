"""pytest fixture for the real local Slurm test cluster (slurm/local-cluster.sh).

Enable it in tests/e2e/conftest.py with ``from tests.slurm_fixtures import slurm_cluster  # noqa: F401``.

``slurm_cluster`` runs ``slurm/local-cluster.sh up`` once per session and leaves the cluster running
afterwards (a second ``up`` takes about a second; ``slurm/local-cluster.sh down`` stops it). The tests
that use it are skipped only where the cluster cannot exist: not root, or no apt-get / the packages
cannot be installed (the script's exit code 3). Any other failure is an error, so CI (root) really runs
them.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from paths import REPO

from trainctl.rundir.paths import RunPaths, read_jsonl

CLUSTER_SCRIPT = REPO / "slurm" / "local-cluster.sh"
EXIT_CANNOT_RUN_HERE = 3


@dataclass(frozen=True)
class SlurmCluster:
    script: Path
    up_seconds: float
    up_output: str
    partitions: tuple[str, ...] = ("debug", "short", "urgent")
    nodes: tuple[str, ...] = ("n1", "n2")
    gpus_per_node: int = 4
    cpus_per_node: int = 8

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run slurm/local-cluster.sh ARGS (captures output, does not raise)."""
        return subprocess.run(
            [str(self.script), *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (slurm/local-cluster.sh installs packages, starts daemons)")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [str(CLUSTER_SCRIPT), "up"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"slurm/local-cluster.sh up did not finish in {exc.timeout}s")
    elapsed = time.monotonic() - t0
    output = proc.stdout + proc.stderr
    # The script's own ERROR line first: the daemons' log tails after it are long.
    reason = next((ln for ln in reversed(output.splitlines()) if "ERROR" in ln), output.strip()[-300:])
    if proc.returncode == EXIT_CANNOT_RUN_HERE:
        pytest.skip(f"no local Slurm cluster here: {reason}")
    if proc.returncode != 0:
        pytest.fail(f"slurm/local-cluster.sh up failed (exit {proc.returncode}): {reason}\n{output[-4000:]}")
    print(f"\nslurm/local-cluster.sh up: {elapsed:.1f}s")
    return SlurmCluster(script=CLUSTER_SCRIPT, up_seconds=elapsed, up_output=output)


def wait_for(predicate, what: str, timeout: float = 30, interval: float = 0.2):
    """Poll `predicate` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def step_exited(paths: RunPaths, job: str | None = None) -> bool:
    """Whether the run's batch script recorded its training step's end (`step_exit`), of job JOB if given."""
    return any(e["event"] == "step_exit" and job in (None, e.get("job_id")) for e in read_jsonl(paths.events))


def step_pids(job: str, node: str) -> list[int]:
    """The processes of job step JOB.0's task on NODE (Slurm's own process tracking, `scontrol listpids`)."""
    out = subprocess.run(["scontrol", "listpids", f"{job}.0", node], capture_output=True, text=True).stdout
    return [int(w[0]) for w in (line.split() for line in out.splitlines()[1:]) if w and w[0].isdigit()]

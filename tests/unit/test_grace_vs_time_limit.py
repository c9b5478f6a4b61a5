"""launcher.grace_s against cluster.time, through the CLI: a grace as long as the time limit is refused (exit 2,
one line naming both fields and the fix) by `validate`, `plan` and `launch`; one that takes more than a quarter
of it is a warning with the numbers in `validate` and `plan`."""

from __future__ import annotations

import json
import subprocess

import pytest
from cli_utils import trainctl
from paths import REPO

from trainctl.spec import time_limit

TINY = str(REPO / "recipes" / "tiny-cpu.yaml")
SLURM = ["--set", "launcher.backend=slurm", "--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=4"]


def in_bare_shell(*args: str) -> subprocess.CompletedProcess[str]:
    """`trainctl ARGS` with only a wide COLUMNS and the system PATH in its environment."""
    return trainctl(*args, env={"COLUMNS": "400", "PATH": "/usr/bin:/bin"}, inherit_env=False)


REFUSED = ("launcher.grace_s = 300: not shorter than cluster.time = '00:02:00' (120 s): Slurm's stop warning would "
           "come as every attempt starts, and the job would stop before training. Fix: lower launcher.grace_s well "
           "below 120 (the time a checkpoint takes, e.g. 12) or raise cluster.time")


@pytest.mark.parametrize("command", [["validate", TINY], ["plan", TINY],
                                     ["launch", TINY, *SLURM, "--dry-run", "--run-dir", "/nonexistent/run"]])
def test_a_grace_as_long_as_the_time_limit_is_refused(command: list[str]) -> None:
    r = in_bare_shell(*command, "--set", "cluster.time=00:02:00")  # the default grace: 300 s
    assert r.returncode == 2, r.stdout + r.stderr
    [line] = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert line.startswith("error: ") and line.endswith(REFUSED), line
    assert "Traceback" not in r.stderr and "#SBATCH" not in r.stdout


def test_launch_grace_option_is_the_spec_field() -> None:
    ok = in_bare_shell("launch", TINY, *SLURM, "--set", "cluster.time=00:02:00", "--grace", "20", "--dry-run",
                  "--run-dir", "/nonexistent/run")
    assert ok.returncode == 0, ok.stderr
    assert "#SBATCH --signal=B:USR1@20" in ok.stdout and "grace" not in ok.stderr
    refused = in_bare_shell("launch", TINY, *SLURM, "--set", "cluster.time=00:02:00", "--grace", "120", "--dry-run")
    assert refused.returncode == 2 and "launcher.grace_s = 120: not shorter than cluster.time" in refused.stderr


WARNING = ("launcher.grace_s = 300 is 50% of cluster.time = '00:10:00' (10m 00s): every attempt is told to checkpoint "
           "and stop after 5m 00s, and the last 5m 00s of its allocation go unused; lower launcher.grace_s (enough "
           "to save a checkpoint) or raise cluster.time")


def test_a_grace_over_a_quarter_of_the_time_limit_warns_with_the_numbers() -> None:
    v = in_bare_shell("validate", TINY, "--set", "cluster.time=00:10:00")
    assert v.returncode == 0 and v.stdout.startswith("ok "), v.stderr
    assert v.stderr.strip() == f"warning: {WARNING}"
    j = in_bare_shell("validate", TINY, "--set", "cluster.time=00:10:00", "--json")
    assert json.loads(j.stdout)["launcher"]["grace_s"] == 300  # stdout stays one JSON document
    p = in_bare_shell("plan", TINY, "--set", "cluster.time=00:10:00", "--json")
    assert p.returncode == 0, p.stderr
    assert {"code": "GRACE_OF_TIME_LIMIT", "level": "warning", "message": WARNING}.items() <= next(
        w for w in json.loads(p.stdout)["warnings"] if w["code"] == "GRACE_OF_TIME_LIMIT").items()
    for quiet in (["--set", "cluster.time=00:20:00"],
                  ["--set", "cluster.time=00:10:00", "--set", "launcher.grace_s=60"]):
        assert "grace" not in in_bare_shell("validate", TINY, *quiet).stderr
        assert "GRACE_OF_TIME_LIMIT" not in in_bare_shell("plan", TINY, *quiet, "--json").stdout


def test_launch_without_any_option_takes_the_spec_grace(tmp_path) -> None:
    spec = tmp_path / "spec.yaml"
    recipe = (REPO / "recipes" / "tiny-cpu.yaml").read_text()
    assert "launcher: {backend: local, mode: torchrun}" in recipe  # replaced, not given twice (refused as such)
    assert "cluster: {nodes: 1, gpus_per_node: 8, gpu: cpu}" in recipe
    spec.write_text(recipe.replace("launcher: {backend: local, mode: torchrun}",
                                   "launcher: {backend: slurm, grace_s: 45}")
                    .replace("cluster: {nodes: 1, gpus_per_node: 8, gpu: cpu}",
                             "cluster: {nodes: 2, gpus_per_node: 4, gpu: cpu, time: '01:00:00'}"))
    r = in_bare_shell("launch", str(spec), "--dry-run")  # no --set, no --grace
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --signal=B:USR1@45" in r.stdout


def test_time_limit_formats_in_seconds() -> None:
    assert [time_limit.seconds(t) for t in ("10", "05:30", "1:00:00", "2-03", "1-00:00:01")] == [
        600, 330, 3600, 2 * 86400 + 3 * 3600, 86401]
    assert time_limit.seconds("1h") is None and time_limit.seconds("UNLIMITED") == time_limit.UNLIMITED_S

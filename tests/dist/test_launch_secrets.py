"""Credentials and file modes through real local runs (`trainctl launch` and `trainctl resume`, 2 CPU ranks under
torchrun): a value of launcher.env whose name looks like a credential, and one passed through by name, reach
every rank's environment while no file of the run directory holds them; the run directory's files get the
umask's mode (docs/design/launch.md, "Secrets"). The same launch runs launcher.setup lines and launcher.python,
and sets launcher.nccl: what they give reaches the ranks too ("Containers and environment")."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
from cli_utils import TRAINCTL
from env_probe import PROBE_VALUE, make_probe
from trainer_utils import ROOT, files_containing, processes_mentioning

from trainctl.launch import secrets
from trainctl.rundir.paths import read_jsonl
from trainctl.spec import load_spec

pytestmark = pytest.mark.slow

DP2 = ["--set", "parallel.tp=1", "--set", "parallel.pp=1", "--set", "parallel.dp=2", "--set", "cluster.gpus_per_node=2",
       "--set", "parallel.sequence_parallel=false", "--set", "train.global_batch=4"]
HF, WANDB, NEW = "hf-value-3d9e71", "wandb-value-b20c4a", "new-value-77f1e0"
# one name per pattern of launch/secrets.py (as docs/launching.md lists them), each with its own value: every one
# is held back (was: SECRETKEY and MYPASSWORD1 were written to spec.yaml, launch.sh and job.json)
PATTERNS = {name: f"pattern-value-{i}-5e0a" for i, name in enumerate(
    ["SECRETKEY", "MYPASSWORD1", *(f"MY{p}1" for p in secrets.CREDENTIAL_ANYWHERE),
     *(f"X_{w}" for w in secrets.CREDENTIAL_WORDS), *(f"GH{e}" for e in secrets.CREDENTIAL_WORD_ENDINGS)])}


def launch_watching_ranks(run: Path, args: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str],
                                                                                     list[dict[str, str]]]:
    """Run the CLI under umask 022 and read every rank's environment (/proc/PID/environ) while it lives."""
    e = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "WANDB_API_KEY", "OTHER_TOKEN")}
    proc = subprocess.Popen([*TRAINCTL, *args], cwd=ROOT, env={**e, **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=lambda: os.umask(0o022))
    seen: dict[int, dict[str, str]] = {}
    while proc.poll() is None:
        for pid in processes_mentioning(f"trainctl.runtime {run}"):
            try:
                raw = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            seen[pid] = dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)
        time.sleep(0.25)  # a rank lives for seconds (imports, process groups, steps)
    out, err = proc.communicate()
    ranks = [v for v in seen.values() if "RANK" in v]  # the workers (torchrun itself has no RANK)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), ranks


def test_credentials_reach_the_ranks_never_the_run_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    probe = make_probe(tmp_path / "probe")
    proc, ranks = launch_watching_ranks(run, [
        "launch", "--run-dir", str(run), *DP2, "--set", "train.steps=2", "--set", f"launcher.env.HF_TOKEN={HF}",
        "--set", "launcher.env.MY_SETTING=visible", "--set", "launcher.env_passthrough=[WANDB_API_KEY]",
        *(x for name, value in PATTERNS.items() for x in ("--set", f"launcher.env.{name}={value}")),
        "--set", f"launcher.setup={json.dumps(probe.setup)}", "--set", f"launcher.python={probe.python}",
        "--set", "launcher.nccl.debug=INFO"],
        {"WANDB_API_KEY": WANDB})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "launcher.env.HF_TOKEN looks like a credential" in proc.stdout and HF not in proc.stdout
    assert [v for v in PATTERNS.values() if v in proc.stdout + proc.stderr] == []
    assert sorted(r["RANK"] for r in ranks) == ["0", "1"]
    for r in ranks:
        assert (r.get("HF_TOKEN"), r.get("WANDB_API_KEY"), r.get("MY_SETTING")) == (HF, WANDB, "visible")
        assert (r.get("TRAINCTL_PROBE"), r.get("NCCL_DEBUG")) == (PROBE_VALUE, "INFO")  # setup's export, nccl
        assert {n: r.get(n) for n in PATTERNS} == PATTERNS
    assert sorted(probe.ranks_saw()) == [0, 1]  # each rank's own start-up saw them (its sitecustomize ran)
    assert probe.where_setup_ran() == ["none"]  # once, in the launcher's shell before torchrun, not per rank
    assert probe.python_saw() == [PROBE_VALUE]  # torchrun started by launcher.python, after the setup
    assert files_containing(run, HF, WANDB, *PATTERNS.values()) == []
    lz = load_spec(run / "spec.yaml").launcher
    assert (lz.env, lz.env_passthrough) == ({"MY_SETTING": "visible"}, ["WANDB_API_KEY", "HF_TOKEN", *PATTERNS])
    assert "export MY_SETTING=visible" in (run / "launch.sh").read_text()
    # others on the cluster read run directories: the umask's modes, not mkstemp's 0600
    modes = {f: stat.S_IMODE((run / f).stat().st_mode) for f in ("spec.yaml", "plan.json", "job.json", "launch.sh")}
    assert modes == {"spec.yaml": 0o644, "plan.json": 0o644, "job.json": 0o644, "launch.sh": 0o755}

    # resume in a new shell: the values were never written, so without them it stops before anything runs
    events_before = (run / "events.jsonl").read_text()
    proc, _ = launch_watching_ranks(run, ["resume", str(run), "--set", "train.steps=3"],
                                    {"WANDB_API_KEY": WANDB, **PATTERNS})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (error,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert "HF_TOKEN is not set in this environment" in error and "export HF_TOKEN=" in error
    assert (run / "events.jsonl").read_text() == events_before and not list(run.glob("spec.prev-*"))
    # exported again (a rotated token), plus a new credential given at resume: every rank has all three
    proc, ranks = launch_watching_ranks(run, ["resume", str(run), "--set", "train.steps=3",
                                              "--set", f"launcher.env.OTHER_TOKEN={NEW}"],
                                        {"WANDB_API_KEY": WANDB, "HF_TOKEN": HF + "-2", **PATTERNS})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    assert len(ranks) == 2
    for r in ranks:
        assert (r.get("HF_TOKEN"), r.get("WANDB_API_KEY"), r.get("OTHER_TOKEN")) == (HF + "-2", WANDB, NEW)
    assert files_containing(run, HF, WANDB, NEW, *PATTERNS.values()) == []
    (changed,) = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "spec_changed"]
    assert "launcher.env.OTHER_TOKEN=<redacted>" in changed["overrides"]

"""Disk space for checkpoints (docs/ARCHITECTURE.md, "Disk space") on a real, small tmpfs (fixture `tmpfs`):
the check before training (warning, --strict refusal), and a save that hits ENOSPC mid-run: one line, the
previous checkpoint kept (retention never deletes the last valid checkpoint before a new one commits)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from trainer_utils import ROOT, TINY, deep_update

from trainctl.checkpoint import list_checkpoints, stale_dirs
from trainctl.checkpoint.space import human_bytes
from trainctl.launch import local
from trainctl.plan.checkpoint_size import checkpoint_bytes
from trainctl.rundir import read_jsonl
from trainctl.spec import load_spec


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainctl", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def spec_file(tmp_path: Path, ckdir: Path, **sections) -> Path:
    spec = deep_update(TINY, {"parallel": {"dp": 2}, "cluster": {"gpus_per_node": 2}, "train": {"steps": 6},
                              "checkpoint": {"every_steps": 2, "keep_last": 1, "dir": str(ckdir)}})
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(deep_update(spec, sections)))
    return p


def test_checkpoint_size_of_the_plan() -> None:
    spec = load_spec(ROOT / "recipes" / "tiny-cpu.yaml")
    assert 3.02e6 < checkpoint_bytes(spec) < 3.6e6  # 3.02 MB written by the trainer (TP2 x PP2 x DP2)


def test_too_little_space_warns_and_strict_refuses(tmp_path: Path, tmpfs) -> None:
    small = tmpfs("3m")  # one checkpoint of the tiny model (~2.6 MB) fits, keep_last 1 + 1 do not
    spec = spec_file(tmp_path, small / "ck")
    run = tmp_path / "run"
    r = cli("launch", str(spec), "--run-dir", str(run), "--dry-run")
    assert r.returncode == 0, r.stderr
    (warning,) = [x for x in r.stdout.splitlines() if x.startswith("warning:")]
    need = human_bytes(2 * checkpoint_bytes(load_spec(spec)))
    assert f"checkpoint directory {small / 'ck'} has" in warning and f"needs {need}" in warning, warning
    assert "keep_last 1 + 1 checkpoints" in warning
    r = cli("launch", str(spec), "--run-dir", str(run), "--strict")
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    assert line.startswith(f"error: checkpoint directory {small / 'ck'} has") and need in line, line
    assert not run.exists()
    # resume checks the same, with the spec it will run
    local.create(local.plan_local(load_spec(spec), run))
    r = cli("resume", str(run), "--strict")
    assert r.returncode == 2 and f"checkpoint directory {small / 'ck'} has" in r.stderr, r.stdout + r.stderr
    r = cli("resume", str(run), "--strict", "--dry-run", "--set", f"checkpoint.dir={tmp_path / 'roomy'}")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_disk_full_mid_run_stops_with_one_line_and_keeps_the_last_checkpoint(tmp_path: Path, tmpfs) -> None:
    full = tmpfs("4m")  # step 2's checkpoint fits; step 4's cannot be written beside it (keep_last 1)
    spec = spec_file(tmp_path, full)
    run = tmp_path / "run"
    r = cli("launch", str(spec), "--run-dir", str(run))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert any(x.startswith("warning: checkpoint directory") for x in r.stdout.splitlines())  # said before
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("run failed: disk full")]
    assert f"saving checkpoint step 4 in {full} failed:" in line, line
    assert " free, " in line and " needed per checkpoint" in line and "newest valid checkpoint: step 2" in line
    # retention deletes only after a commit: the last valid checkpoint is still there, nothing half-written
    infos = list_checkpoints(full)
    assert [(i.step, i.valid) for i in infos] == [(2, True)] and stale_dirs(full) == []
    (event,) = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "disk_full"]
    assert event["newest_valid_step"] == 2 and event["dir"] == str(full)
    assert event["needed_bytes"] == checkpoint_bytes(load_spec(spec)) and event["free_bytes"] < event["needed_bytes"]

"""What a copied run, another run's checkpoint directory, a symbolic link in a run directory or three launches at
once must not do, through the real CLI with real torchrun (docs/FAILURES.md, "Run directories and checkpoint
directories"). One tiny one-rank run with an absolute checkpoint.dir outside its run directory is launched once;
each test copies it (`cp -a`) or points a new run at its checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_utils import TRAINCTL, trainctl
from spec_utils import write_spec

from trainctl.checkpoint import list_checkpoints
from trainctl.errors import EXIT_USAGE
from trainctl.rundir.paths import read_jsonl

pytestmark = pytest.mark.slow

# keep_last 1: a run that wrote into another's directory would prune the other's newest step at its first save
RUN = {"train": {"steps": 2}, "checkpoint": {"every_steps": 2, "keep_last": 1}}


def snapshot(ckdir: Path) -> dict[str, float]:
    """Every file under a checkpoint directory with its mtime: what another run must leave alone."""
    return {str(p.relative_to(ckdir)): p.stat().st_mtime for p in sorted(ckdir.rglob("*"))}


def one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    """The refusal's line (the hint follows it), with no traceback."""
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, r.stdout[-2000:] + r.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(spec, run directory, its checkpoint directory elsewhere): a finished run with step 2 committed."""
    base = tmp_path_factory.mktemp("safety")
    ckdir = base / "scratch" / "ck-original"
    spec = write_spec(base / "spec.yaml", {**RUN, "checkpoint": {**RUN["checkpoint"], "dir": str(ckdir)}})
    run = base / "original"
    r = trainctl("launch", str(spec), "--run-dir", str(run))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert [i.step for i in list_checkpoints(ckdir) if i.valid] == [2]
    return spec, run, ckdir


def test_a_copied_run_neither_writes_nor_prunes_the_originals_checkpoints(original: tuple[Path, Path, Path],
                                                                         tmp_path: Path) -> None:
    _, run, ckdir = original
    before = snapshot(ckdir)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(run), str(copy)], check=True)
    r = trainctl("resume", str(copy), "--set", "train.steps=4")
    assert r.returncode == EXIT_USAGE, r.stdout[-2000:] + r.stderr[-3000:]
    assert one_line_error(r) == (f"error: checkpoint directory {ckdir} belongs to run {run}, of which {copy} is a "
                                 "copy: resuming the copy would write and prune the original's checkpoints")
    assert "cp -a" in r.stderr and "--set checkpoint.dir=NEW" in r.stderr  # the fix is on the next line
    assert snapshot(ckdir) == before
    # the fix it gives: a copy of the checkpoints of the copy's own; it continues from step 2 there and prunes there
    own = tmp_path / "ck-copy"
    subprocess.run(["cp", "-a", str(ckdir), str(own)], check=True)
    r = trainctl("resume", str(copy), "--set", "train.steps=4", "--set", f"checkpoint.dir={own}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "from step 2" in r.stdout
    assert [i.step for i in list_checkpoints(own) if i.valid] == [4]  # keep_last 1 pruned its step 2, not ours
    assert snapshot(ckdir) == before
    # and the original is still whole and still its own: resumable from its step 2
    dry = trainctl("resume", str(run), "--set", "train.steps=4", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert json.loads(dry.stdout)["resume_step"] == 2


def test_a_fresh_launch_refuses_another_runs_checkpoint_directory(original: tuple[Path, Path, Path],
                                                                  tmp_path: Path) -> None:
    spec, run, ckdir = original
    before = snapshot(ckdir)
    new = tmp_path / "new"
    r = trainctl("launch", str(spec), "--run-dir", str(new), "--set", "train.steps=4")
    assert r.returncode == EXIT_USAGE, r.stdout[-2000:] + r.stderr[-3000:]
    assert one_line_error(r) == (f"error: checkpoint directory {ckdir} is not empty: it holds checkpoints of step 2 "
                                 f"of run {run}, and a new run starts from its own initialisation, never from another "
                                 "run's checkpoints")
    assert f"--set checkpoint.dir=NEW; to continue that run: trainctl resume {run}" in r.stderr
    assert not new.exists() and snapshot(ckdir) == before
    assert "resumed from checkpoint" not in r.stdout


def test_a_symbolic_link_in_the_run_directory_is_refused_and_its_target_untouched(original: tuple[Path, Path, Path],
                                                                                 tmp_path: Path) -> None:
    _, run, ckdir = original
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(run), str(copy)], check=True)
    victim = tmp_path / "elsewhere.jsonl"
    shutil.copy(copy / "metrics.jsonl", victim)
    kept = victim.read_bytes()
    (copy / "metrics.jsonl").unlink()
    (copy / "metrics.jsonl").symlink_to(victim)
    # its own checkpoint directory, so that only the link is in the way
    r = trainctl("resume", str(copy), "--set", "train.steps=4", "--set", f"checkpoint.dir={tmp_path / 'ck'}")
    assert r.returncode == EXIT_USAGE, r.stdout[-2000:] + r.stderr[-3000:]
    assert one_line_error(r) == (f"error: {copy}/metrics.jsonl is a symbolic link; trainctl writes only regular files "
                                 f"it made there (it points to {victim})")
    assert "replace the link with a regular file" in r.stderr
    assert victim.read_bytes() == kept and not (tmp_path / "ck").exists()


def test_three_launches_at_once_get_three_run_directories(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", {"train": {"steps": 1, "warmup": 1}})
    procs = [subprocess.Popen([*TRAINCTL, "launch", str(spec)], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(os.environ)) for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    dirs = sorted((tmp_path / "runs").iterdir())
    assert len(dirs) == 3, dirs
    for d in dirs:  # each holds one whole run of its own
        assert [m["step"] for m in read_jsonl(d / "metrics.jsonl")] == [1]
        assert len(json.loads((d / "job.json").read_text())["attempts"]) == 1

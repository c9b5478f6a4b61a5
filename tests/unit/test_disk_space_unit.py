"""Disk space helpers without a run: the disk-full test, the one line, the event of the latest attempt, and
the planner's checkpoint size (docs/design/checkpoints.md, "Disk space")."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from paths import REPO

from trainctl.checkpoint.space import disk_full_message, existing_ancestor, human_bytes, is_disk_full
from trainctl.launch.diskspace import disk_full_line, space_problem
from trainctl.plan.checkpoint_size import BYTES_PER_PARAM, checkpoint_bytes
from trainctl.rundir.paths import RunPaths, record_event
from trainctl.spec import load_spec

TINY = REPO / "recipes" / "tiny-cpu.yaml"


def test_is_disk_full() -> None:
    assert is_disk_full(f"rank 1: OSError: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: '/x'")
    assert is_disk_full(os.strerror(errno.EDQUOT))
    assert not is_disk_full("rank 0: RuntimeError: boom")


def test_disk_full_message_is_one_line_with_every_fact(tmp_path: Path) -> None:
    m = disk_full_message(tmp_path, 40, free=3 * 2**20, needed=5 * 2**30, newest_valid=30)
    assert "\n" not in m and str(tmp_path) in m and "step 40" in m
    assert "3.0 MiB free, 5.0 GiB needed" in m and "newest valid checkpoint: step 30" in m
    assert "newest valid checkpoint: none" in disk_full_message(directory=tmp_path, step=2, free=0, needed=1,
                                                                newest_valid=None)
    assert human_bytes(512) == "512 B" and human_bytes(1536) == "1.5 KiB"


def test_disk_full_line_is_of_the_latest_attempt_only(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    record_event(paths, "launch")
    record_event(paths, "disk_full", message="disk full: old")
    assert disk_full_line(paths) == "disk full: old"
    record_event(paths, "resume")
    assert disk_full_line(paths) is None


def test_checkpoint_size_scales_with_parameters_and_keeps_the_padded_vocab() -> None:
    spec = load_spec(TINY)
    big = load_spec(TINY, ["model.layers=8"])
    assert checkpoint_bytes(big) > checkpoint_bytes(spec)
    llama = load_spec(REPO / "recipes" / "llama3-8b.yaml")
    assert 8.0e9 * BYTES_PER_PARAM < checkpoint_bytes(llama) < 8.1e9 * BYTES_PER_PARAM  # 8.03B parameters


def test_space_problem_counts_keep_last_plus_one(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    ok = load_spec(TINY, [f"checkpoint.dir={tmp_path / 'ck'}"])
    assert space_problem(ok, tmp_path / "run") is None
    assert existing_ancestor(tmp_path / "a" / "b") == tmp_path
    keep = int(free // checkpoint_bytes(ok)) + 1  # keep_last + 1 of them cannot fit
    short = load_spec(TINY, [f"checkpoint.dir={tmp_path / 'ck'}", f"checkpoint.keep_last={keep}"])
    problem = space_problem(short, tmp_path / "run")
    assert problem and f"keep_last {keep} + 1 checkpoints" in problem and str(tmp_path / "ck") in problem
    none = load_spec(TINY, ["checkpoint.every_steps=null"])
    assert space_problem(none, tmp_path / "run") is None

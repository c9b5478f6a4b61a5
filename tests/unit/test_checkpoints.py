"""Checkpoint directories without torch: validity reasons, listing, retention, schedule, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import REPO as ROOT

from trainctl.checkpoint import (
    HASH,
    MANIFEST,
    MARKER,
    CheckpointError,
    CheckpointInfo,
    SaveSchedule,
    file_digest,
    find_step,
    latest_valid,
    list_checkpoints,
    manifest_bytes,
    marker_bytes,
    resolve_checkpoint_dir,
    staging_dirname,
    stale_dirs,
    step_dirname,
    to_delete,
    validate,
)


def make_ckpt(directory: Path, step: int, files: dict[str, bytes] | None = None, commit: bool = True,
              milestone: bool = False, meta: dict | None = None) -> Path:
    """A checkpoint as the writer leaves it (committed) or as a dead writer leaves it (staging)."""
    files = files or {"__0_0.distcp": b"a" * 1000, "__1_0.distcp": b"b" * 700, ".metadata": b"m" * 50}
    path = directory / (step_dirname(step) if commit else staging_dirname(step, "abcd1234"))
    path.mkdir(parents=True)
    entries = {}
    for name, data in files.items():
        (path / name).write_bytes(data)
        size, digest = file_digest(path / name)
        entries[name] = {"size": size, HASH: digest, "rank": 0}
    if commit:
        data = manifest_bytes({"format": 1, "step": step, "time": 1.0e9 + step, "world_size": 2,
                               "milestone": milestone, "meta": {"tokens": step * 10, **(meta or {})},
                               "files": entries})
        (path / MANIFEST).write_bytes(data)
        (path / MARKER).write_bytes(marker_bytes(data))
    return path


def test_valid_checkpoint(tmp_path):
    p = make_ckpt(tmp_path, 5)
    assert validate(p) is None and validate(p, deep=True) is None
    [info] = list_checkpoints(tmp_path)
    assert (info.step, info.valid, info.world_size, info.meta) == (5, True, 2, {"tokens": 50})
    assert info.size_bytes > 1750


@pytest.mark.parametrize("damage, reason", [
    (lambda p: (p / MARKER).unlink(), "missing COMMITTED marker"),
    (lambda p: (p / "__1_0.distcp").write_bytes(b"b" * 300), "truncated shard __1_0.distcp: 300 bytes"),
    (lambda p: (p / "__1_0.distcp").unlink(), "missing file __1_0.distcp"),
    (lambda p: (p / MANIFEST).write_text("{not json"), "unreadable manifest"),
    (lambda p: (p / MANIFEST).unlink(), "missing manifest.json"),
    (lambda p: (p / MARKER).write_text("{}"), "marker does not match"),
])
def test_damage_is_detected_with_a_reason(tmp_path, damage, reason):
    p = make_ckpt(tmp_path, 7)
    damage(p)
    got = validate(p)
    assert got is not None and reason in got, got


def test_checksum_mismatch_needs_deep(tmp_path):
    p = make_ckpt(tmp_path, 3)
    (p / "__0_0.distcp").write_bytes(b"X" * 1000)  # same size, other bytes
    assert validate(p) is None
    assert validate(p, deep=True) == "checksum mismatch in __0_0.distcp"


def test_latest_valid_skips_newer_invalid_with_reasons(tmp_path):
    make_ckpt(tmp_path, 1)
    make_ckpt(tmp_path, 2)
    (make_ckpt(tmp_path, 3) / MARKER).unlink()
    make_ckpt(tmp_path, 4, commit=False)  # a writer died mid-save
    bad = make_ckpt(tmp_path, 5)
    (bad / "__0_0.distcp").write_bytes(b"Y" * 1000)
    skipped: list[CheckpointInfo] = []
    assert latest_valid(tmp_path, skipped=skipped).step == 5  # shallow check: sizes match
    skipped.clear()
    assert latest_valid(tmp_path, deep=True, skipped=skipped).step == 2
    assert [(i.step, i.reason.split(":")[0]) for i in skipped] == [
        (5, "checksum mismatch in __0_0.distcp"), (4, "incomplete"), (3, "missing COMMITTED marker")]
    assert [i.step for i in list_checkpoints(tmp_path)] == [1, 2, 3, 4, 5]


def test_empty_missing_and_non_directory(tmp_path):
    assert list_checkpoints(tmp_path / "nope") == [] and latest_valid(tmp_path / "nope") is None
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        list_checkpoints(tmp_path / "file")


def test_find_step_and_stale_dirs(tmp_path):
    make_ckpt(tmp_path, 10)
    staging = make_ckpt(tmp_path, 20, commit=False)
    assert find_step(tmp_path, 10).step == 10
    with pytest.raises(CheckpointError, match="no checkpoint for step 30"):
        find_step(tmp_path, 30)
    assert stale_dirs(tmp_path) == [staging]


def test_names_sort_by_step():
    names = [step_dirname(s) for s in (5, 100, 20, 1_000_000)]
    assert sorted(names) == [step_dirname(s) for s in (5, 20, 100, 1_000_000)]


def test_resolve_checkpoint_dir(tmp_path):
    assert resolve_checkpoint_dir(tmp_path) == tmp_path / "checkpoints"
    (tmp_path / "spec.yaml").write_text("checkpoint: {dir: /shared/ck}\n")
    assert resolve_checkpoint_dir(tmp_path) == Path("/shared/ck")


# --- retention --------------------------------------------------------------------------------

def info(step: int, valid: bool = True, milestone: bool = False) -> CheckpointInfo:
    return CheckpointInfo(step=step, path=Path(step_dirname(step)), size_bytes=1, valid=valid,
                          reason=None if valid else "bad", milestone=milestone)


def test_retention_example():
    infos = [info(s) for s in range(1, 10)] + [info(10, valid=False)]
    gone = {i.step for i in to_delete(infos, keep_last=2, milestone_every=4)}
    assert gone == {1, 2, 3, 5, 6, 7}  # keeps 8, 9 (last two), 4, 8 (milestones), 10 (invalid: untouched)


@given(st.lists(st.tuples(st.integers(1, 200), st.booleans(), st.booleans()), max_size=30, unique_by=lambda t: t[0]),
       st.integers(1, 5), st.one_of(st.none(), st.integers(1, 50)))
def test_retention_properties(rows, keep_last, milestone_every):
    infos = [info(s, v, m) for s, v, m in rows]
    gone = to_delete(infos, keep_last, milestone_every)
    gone_steps = {i.step for i in gone}
    valid = sorted(i.step for i in infos if i.valid)
    assert all(i.valid for i in gone)  # never touches invalid ones
    assert not gone_steps & set(valid[-keep_last:])  # keeps the newest K, so the newest valid
    for i in infos:
        if i.milestone or (milestone_every and i.step % milestone_every == 0):
            assert i.step not in gone_steps
    kept_valid = [s for s in valid if s not in gone_steps]
    assert len(kept_valid) >= min(keep_last, len(valid))
    # Everything not kept by a rule is deleted.
    assert set(valid) - gone_steps == set(valid[-keep_last:]) | {
        i.step for i in infos if i.valid and (i.milestone or (milestone_every and i.step % milestone_every == 0))}


@given(st.lists(st.integers(1, 100), min_size=1, max_size=20, unique=True), st.integers(1, 3),
       st.one_of(st.none(), st.integers(1, 10)), st.integers(1, 100))
def test_retention_never_deletes_the_fresh_checkpoint_after_a_rewind(steps, keep_last, milestone_every, current):
    infos = [info(s) for s in steps] + [info(current)]  # steps > current: left by the abandoned branch
    gone = {i.step for i in to_delete(infos, keep_last, milestone_every, current=current)}
    assert current not in gone and all(s <= current for s in gone)


def test_retention_rejects_keep_zero():
    with pytest.raises(ValueError):
        to_delete([info(1)], keep_last=0)


def test_save_schedule():
    s = SaveSchedule(every_steps=10, last_time=0.0)
    assert [st for st in range(1, 31) if s.due(st, now=1.0)] == [10, 20, 30]
    m = SaveSchedule(every_minutes=1.0, last_time=0.0)
    assert not m.due(5, now=59.0) and m.due(5, now=60.0)
    m.mark(5, now=60.0)
    assert not m.due(5, now=500.0)  # never twice at the same step
    assert not m.due(6, now=100.0) and m.due(6, now=120.0)


# --- CLI --------------------------------------------------------------------------------------

def test_cli_lists_json_without_torch(tmp_path):
    run = tmp_path / "run"
    ck = run / "checkpoints"
    make_ckpt(ck, 1, meta={"layout": {"tp": 2, "pp": 2, "virtual_stages": 2, "dp": 4, "zero": 1}})
    make_ckpt(ck, 2, milestone=True)
    (make_ckpt(ck, 3) / "__0_0.distcp").write_bytes(b"a" * 10)
    make_ckpt(ck, 4, commit=False)
    probe = ("import sys\nfrom trainctl.cli.app import app, _register\n_register()\n"
             "import trainctl.cli.checkpoints_cmd\nfrom trainctl.cli.app import main\n"
             "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
             "assert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", probe, "checkpoints", str(run), "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["latest_valid"] == 2
    rows = {c["step"]: c for c in data["checkpoints"]}
    assert rows[1]["valid"] and rows[2]["milestone"] and rows[2]["meta"] == {"tokens": 20}
    assert "truncated shard __0_0.distcp" in rows[3]["reason"] and "incomplete" in rows[4]["reason"]
    table = subprocess.run([sys.executable, "-c", probe, "checkpoints", str(run)], capture_output=True,
                           text=True, cwd=ROOT, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert table.returncode == 0 and "latest" in table.stdout and "truncated" in table.stdout, table.stderr
    assert "tp2 pp2 (v2) dp4 zero1" in table.stdout  # step 1's layout, from its manifest


@settings(deadline=None)  # the first example imports torch
@given(rows=st.integers(1, 9), cols=st.integers(1, 9), data=st.data())
def test_zero_master_ranges_become_rectangles_that_tile_them(rows, cols, data):
    """A ZeRO-1/2 rank's master covers a flat range [lo, hi) of a parameter; the checkpoint saves it as the
    parameter-shaped rectangles that range covers (runtime/checkpoint/state.py). They must tile the range exactly, in
    order, each a block of the row-major layout."""
    from trainctl.runtime.checkpoint.state import _rectangles

    n = rows * cols
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    rects = _rectangles(lo, hi, (rows, cols))
    assert len(rects) <= 3
    covered = []
    for (r0, c0), (nr, nc), a, b in rects:
        cells = [(r0 + i) * cols + c0 + j for i in range(nr) for j in range(nc)]
        assert cells == list(range(a, b))  # a rectangle is a contiguous run of the flattening
        covered += cells
    assert covered == list(range(lo, hi))
    assert _rectangles(lo, hi, (n,)) == ([([lo], [hi - lo], lo, hi)] if hi > lo else [])

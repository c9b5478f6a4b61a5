"""Disk space for checkpoints (docs/design/checkpoints.md, "Disk space") on a real, small tmpfs (fixture `tmpfs`):
the check before training (warning, --strict refusal), and a save that hits ENOSPC mid-run: one line, the
previous checkpoint kept (retention never deletes the last valid checkpoint before a new one commits)."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import pytest
from cli_utils import TRAINCTL, trainctl
from resume_utils import wait_for_step
from spec_utils import write_spec
from trainer_utils import ROOT

from trainctl.checkpoint import list_checkpoints, stale_dirs
from trainctl.checkpoint.space import human_bytes
from trainctl.launch import local
from trainctl.plan.checkpoint_size import checkpoint_bytes
from trainctl.rundir.paths import read_jsonl
from trainctl.spec import load_spec

DP2 = {"parallel": {"dp": 2}, "cluster": {"gpus_per_node": 2}, "train": {"steps": 6},
       "checkpoint": {"every_steps": 2, "keep_last": 1}}


def test_checkpoint_size_of_the_plan() -> None:
    spec = load_spec(ROOT / "recipes" / "tiny-cpu.yaml")
    assert 3.02e6 < checkpoint_bytes(spec) < 3.6e6  # 3.02 MB written by the trainer (TP2 x PP2 x DP2)


def test_too_little_space_warns_and_strict_refuses(tmp_path: Path, tmpfs) -> None:
    small = tmpfs("3m")  # one checkpoint of the tiny model (~2.6 MB) fits, keep_last 1 + 1 do not
    spec = write_spec(tmp_path / "spec.yaml", DP2, {"checkpoint": {"dir": str(small / "ck")}})
    run = tmp_path / "run"
    r = trainctl("launch", str(spec), "--run-dir", str(run), "--dry-run")
    assert r.returncode == 0, r.stderr
    (warning,) = [x for x in r.stdout.splitlines() if x.startswith("warning:")]
    need = human_bytes(2 * checkpoint_bytes(load_spec(spec)))
    assert f"checkpoint directory {small / 'ck'} has" in warning and f"needs {need}" in warning, warning
    assert "keep_last 1 + 1 checkpoints" in warning
    r = trainctl("launch", str(spec), "--run-dir", str(run), "--strict")
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    assert line.startswith(f"error: checkpoint directory {small / 'ck'} has") and need in line, line
    assert not run.exists()
    # resume checks the same, with the spec it will run
    local.create(local.plan_local(load_spec(spec), run))
    r = trainctl("resume", str(run), "--strict")
    assert r.returncode == 2 and f"checkpoint directory {small / 'ck'} has" in r.stderr, r.stdout + r.stderr
    r = trainctl("resume", str(run), "--strict", "--dry-run", "--set", f"checkpoint.dir={tmp_path / 'roomy'}")
    assert r.returncode == 0, r.stdout + r.stderr


def steps_ended(run: Path) -> dict[int, list[tuple[int, float]]]:
    """(step, when it ended) of every step each rank trained, from its step-time log."""
    out = {}
    for f in sorted((run / "logs").glob("steptimes-rank*.jsonl")):
        rows = [r for r in read_jsonl(f) if "step" in r]
        out[int(f.stem.removeprefix("steptimes-rank"))] = [(r["step"], r["time"]) for r in rows]
    return out


@pytest.mark.slow
def test_disk_full_mid_run_stops_with_one_line_and_keeps_the_last_checkpoint(tmp_path: Path, tmpfs) -> None:
    """An async save that fails stops the run at the next step, not at the next save (step 30 here)."""
    full = tmpfs("4m")  # step 10's checkpoint fits; step 20's cannot be written beside it (keep_last 1)
    spec = write_spec(tmp_path / "spec.yaml", DP2,
                      {"train": {"steps": 40}, "checkpoint": {"dir": str(full), "every_steps": 10}})
    run = tmp_path / "run"
    r = trainctl("launch", str(spec), "--run-dir", str(run))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert any(x.startswith("warning: checkpoint directory") for x in r.stdout.splitlines())  # said before
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("run failed: disk full")]
    assert f"saving checkpoint step 20 in {full} failed:" in line, line
    assert " free, " in line and " needed per checkpoint" in line and "newest valid checkpoint: step 10" in line
    st = trainctl("status", str(run))  # the same words, naming the kind once
    assert st.returncode == 0 and "FAILED - disk full: saving checkpoint step 20" in st.stdout, st.stdout
    assert st.stdout.count("disk full") == 1, st.stdout
    # retention deletes only after a commit: the last valid checkpoint is still there, nothing half-written
    infos = list_checkpoints(full)
    assert [(i.step, i.valid) for i in infos] == [(10, True)] and stale_dirs(full) == []
    events = read_jsonl(run / "events.jsonl")
    (event,) = [e for e in events if e["event"] == "disk_full"]
    assert event["newest_valid_step"] == 10 and event["dir"] == str(full)
    assert event["needed_bytes"] == checkpoint_bytes(load_spec(spec)) and event["free_bytes"] < event["needed_bytes"]
    # every rank stopped after the same step, and rank 0 (whose writer recorded the failure when the writers
    # agreed on it) ended at most one step after that
    (failed,) = [e for e in events if e["event"] == "checkpoint_failed"]
    ended = steps_ended(run)
    assert len(ended) == 2 and len({rows[-1][0] for rows in ended.values()}) == 1, ended
    after = [step for step, t in ended[0] if t > failed["time"]]
    assert len(after) <= 1, f"steps trained after the save of step 20 was known to have failed: {after}"
    assert 20 <= ended[0][-1][0] < 40


DISK_FILLED = ("ran out of space while the run trained (its disk or quota is full)", "disk full: ",
               "the run directory's disk is full (")


def fill(directory: Path) -> None:
    """Take every free block of the file system holding `directory`."""
    with open(directory / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(bytes(4096))


@pytest.mark.slow
def test_run_directory_disk_full_is_said_by_the_launcher_and_status(tmp_path: Path, tmpfs) -> None:
    """The run directory's own disk fills (its checkpoints, logs and records all on it): the launcher stops the
    ranks, says so, and records it where `status` reads it (was: `status` said the launcher was gone without a
    record, "killed?")."""
    disk = tmpfs("8m")
    spec = write_spec(tmp_path / "spec.yaml", {"train": {"steps": 300}, "checkpoint": {"every_steps": 100}})
    run = disk / "run"
    proc = subprocess.Popen([*TRAINCTL, "launch", str(spec), "--run-dir", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    try:
        wait_for_step(run, 1)
        fill(disk)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    # which write fails first (the launcher's log, a rank's metrics or checkpoint) is the machine's choice: each
    # way ends in a line that says the disk filled
    assert proc.returncode == 1, out[-3000:]
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("run failed: ") and any(w in last for w in DISK_FILLED), out[-3000:]
    st = trainctl("status", str(run), "--json")
    assert st.returncode == 0 and json.loads(st.stdout)["state"] == "FAILED", st.stdout + st.stderr
    reason = json.loads(st.stdout)["reason"]
    assert any(w in reason for w in DISK_FILLED) and "killed?" not in reason, reason
    assert not (run / ".launcher-reserve").exists()  # the space it held went to the records

    # nothing recorded after the ranks' start, by the ranks or the launcher (as in a disk full before the launcher
    # could hold its reserve): `status` reads the full disk itself
    events = run / "events.jsonl"
    lines = events.read_bytes().splitlines(keepends=True)
    kept = b"".join(lines[:next(i for i, x in enumerate(lines) if b'"event":"start"' in x) + 1])
    with open(events, "r+b") as f:  # rewritten in place: the disk has no block for a new file
        f.write(kept)
        f.truncate()
    st = trainctl("status", str(run))
    assert st.returncode == 0, st.stderr
    assert any(w in st.stdout for w in DISK_FILLED) and "killed?" not in st.stdout, st.stdout

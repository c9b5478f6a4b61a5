"""One job per run directory (docs/design/run-states.md, "Run lock"): real launches, real processes, no mocks.

A second `trainctl launch --run-dir` or `trainctl resume` on a run that is training exits 2 at once with one
line naming the live launcher and how to stop it; a lock left by a crash (dead pid) or by another login node
that stopped heartbeating is taken over with a note.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_utils import TRAINCTL, trainctl
from spec_utils import write_spec
from trainer_utils import ROOT

from trainctl.checkpoint import latest_valid
from trainctl.hardware.hostname import this_host
from trainctl.launch import runlock
from trainctl.rundir.paths import RunPaths, read_jsonl

pytestmark = pytest.mark.slow


# one rank: the lock is the launcher's, and a second rank would only cost CPU
ONE_RANK = {"parallel": {"dp": 1}, "cluster": {"gpus_per_node": 1}, "train": {"steps": 2},
            "checkpoint": {"every_steps": 2, "keep_last": 2}}


def kill_tree(proc: subprocess.Popen[str]) -> None:
    from trainctl.launch.local import kill_tree as kill

    if proc.poll() is None:
        kill(proc.pid)
        proc.wait(timeout=30)


def error_lines(r: subprocess.CompletedProcess[str]) -> list[str]:
    return [x for x in r.stderr.splitlines() if x.strip()]


def test_second_launch_and_resume_on_a_live_run_exit_2_fast(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", ONE_RANK,
                      {"train": {"steps": 100000}, "checkpoint": {"every_steps": 100000}})
    run = tmp_path / "run"
    proc = subprocess.Popen([*TRAINCTL, "launch", str(spec), "--run-dir", str(run)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lock = RunPaths(run).lock
    try:
        deadline = time.time() + 90
        while not read_jsonl(run / "metrics.jsonl"):  # training is under way
            assert proc.poll() is None and time.time() < deadline, "the run did not start"
            time.sleep(0.3)
        held = json.loads(lock.read_text())
        assert held["pid"] == proc.pid and held["host"] == this_host() and held["start"] and held["boot_id"]
        assert held["children"], "the launcher records torchrun and its ranks"  # recorded within ~1 s
        torchrun = held["children"][0][0]
        for args in (["launch", str(spec), "--run-dir", str(run)], ["resume", str(run)]):
            t0 = time.perf_counter()
            r = trainctl(*args)
            took = time.perf_counter() - t0
            print(f"trainctl {args[0]} on a live run: exit {r.returncode} in {took:.2f} s")
            assert r.returncode == 2, r.stdout + r.stderr
            (line,) = error_lines(r)
            assert f"{run} is in use by a live job: trainctl launch (pid {proc.pid} on host {this_host()}" \
                   in line, line
            assert f"torchrun pid {torchrun}" in line and f"`trainctl cancel {run}`" in line, line
            assert took < 10, took
        assert not [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "resume_requested"]
        r = trainctl("cancel", str(run))  # what the line says to do
        assert r.returncode == 0, r.stdout + r.stderr
        proc.wait(timeout=90)
        assert not lock.exists()  # released when the launcher exits
    finally:
        kill_tree(proc)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("lock")
    run = tmp / "run"
    r = trainctl("launch", str(write_spec(tmp / "spec.yaml", ONE_RANK)), "--run-dir", str(run))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert not RunPaths(run).lock.exists()  # released when the launcher exits
    return run


def resume_one_more_step(run: Path) -> subprocess.CompletedProcess[str]:
    info = latest_valid(run / "checkpoints")
    assert info is not None
    return trainctl("resume", str(run), "--set", f"train.steps={info.step + 1}")


def test_stale_lock_of_a_dead_launcher_is_taken_over_with_a_note(finished_run: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = runlock.Owner(host=this_host(), pid=dead.pid, start=12345, boot_id=runlock.boot_id(),
                         token="old", command="launch", since=time.time() - 60)
    RunPaths(finished_run).lock.write_text(gone.to_json())
    r = resume_one_more_step(finished_run)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    notes = [x for x in r.stdout.splitlines() if "took over the stale lock" in x]
    assert len(notes) == 1 and f"pid {dead.pid} is gone" in notes[0], r.stdout
    assert not RunPaths(finished_run).lock.exists()


def test_lock_of_another_host_refuses_while_it_beats_and_is_taken_over_when_old(finished_run: Path) -> None:
    other = runlock.Owner(host="login-elsewhere", pid=4242, start=1, boot_id="another-boot", token="x",
                          command="resume", since=time.time() - 3600)
    lock = RunPaths(finished_run).lock
    lock.write_text(other.to_json())  # fresh heartbeat: live, whatever pid 4242 is here
    r = trainctl("resume", str(finished_run))
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = error_lines(r)
    assert "trainctl resume (pid 4242 on host login-elsewhere" in line and "heartbeat" in line, line
    assert "on host login-elsewhere (or wait for it to end)" in line
    old = time.time() - runlock.STALE_AFTER_S - 60
    os.utime(lock, (old, old))
    r = resume_one_more_step(finished_run)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "took over the stale lock of trainctl resume (pid 4242 on host login-elsewhere" in r.stdout, r.stdout
    assert "no heartbeat from host login-elsewhere" in r.stdout

"""The run lock's pure logic (who is live, who is stale) and its file protocol in one process (no training)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainctl.errors import UsageError
from trainctl.hardware.hostname import this_host
from trainctl.launch import runlock
from trainctl.launch.runlock import UNKNOWN_START, Here, Owner, verdict
from trainctl.rundir.paths import RunPaths

HOST, BOOT = "login1", "boot-a"


def owner(**over) -> Owner:
    base = dict(host=HOST, pid=100, start=5000, boot_id=BOOT, token="t", command="launch", since=1.0)
    return Owner(**{**base, **over})


def here(procs: dict[int, int | None], host: str = HOST, boot: str | None = BOOT) -> Here:
    """A machine whose processes are `procs` (pid -> start time; a missing pid does not exist)."""
    return Here(host, boot, start_of=lambda pid: procs.get(pid))


def test_same_host_owner_running_with_its_start_time_is_live() -> None:
    v = verdict(owner(), 500.0, here({100: 5000}))
    assert v.live and "pid 100 is running" in v.why  # age does not matter on the same host


def test_same_host_dead_pid_is_stale() -> None:
    v = verdict(owner(), 1.0, here({}))
    assert not v.live and "pid 100 is gone" in v.why


def test_recycled_pid_is_stale() -> None:
    v = verdict(owner(), 1.0, here({100: 7777}))
    assert not v.live and "another process" in v.why


def test_reboot_makes_the_lock_stale_even_when_the_pid_exists() -> None:
    v = verdict(owner(), 1.0, here({100: 5000}, boot="boot-b"))
    assert not v.live and "rebooted" in v.why


def test_a_live_child_keeps_the_lock_when_the_launcher_died() -> None:
    o = owner(children=((200, 6000), (201, 6001)))
    assert verdict(o, 1.0, here({200: 6000})).live
    assert "child pid 201" in verdict(o, 1.0, here({201: 6001})).why
    dead = verdict(o, 1.0, here({200: 1}))  # a recycled child pid is not the child
    assert not dead.live and "2 child processes" in dead.why


def test_unknown_start_time_trusts_the_pid() -> None:
    assert verdict(owner(), 1.0, here({100: UNKNOWN_START})).live
    assert verdict(owner(start=None), 1.0, here({100: 1234})).live


def test_other_host_is_judged_by_heartbeat_age() -> None:
    other = owner(host="login2")
    assert verdict(other, 30.0, here({})).live
    v = verdict(other, runlock.STALE_AFTER_S + 1, here({100: 5000}))  # its pid here means nothing
    assert not v.live and "no heartbeat from host login2" in v.why


def test_torn_lock_is_live_while_young_then_stale() -> None:
    assert verdict(None, 1.0, here({})).live
    assert not verdict(None, runlock.WRITING_GRACE_S + 1, here({})).live


def test_owner_json_round_trip_and_torn_text() -> None:
    o = owner(children=((200, 6000),))
    assert Owner.from_json(o.to_json()) == o
    assert Owner.from_json("") is None and Owner.from_json('{"host": "x"') is None


def test_proc_start_of_this_process_and_of_none() -> None:
    assert runlock.proc_start(os.getpid()) not in (None, UNKNOWN_START)
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert runlock.proc_start(p.pid) is None


# --- the file protocol, in this process ----------------------------------------------------------------

def write_lock(root: Path, o: Owner, age_s: float = 0.0) -> Path:
    path = RunPaths(root).lock
    path.write_text(o.to_json())
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))
    return path


def test_acquire_refuse_release(tmp_path: Path) -> None:
    lock = runlock.acquire(tmp_path, "launch")
    try:
        held = json.loads(RunPaths(tmp_path).lock.read_text())
        assert held["pid"] == os.getpid() and held["host"] == this_host() and held["boot_id"]
        with pytest.raises(UsageError, match=rf"in use by a live job: trainctl launch \(pid {os.getpid()} on host"):
            runlock.check_free(tmp_path)
        with pytest.raises(UsageError, match="trainctl cancel"):
            runlock.acquire(tmp_path, "resume")
    finally:
        lock.release()
    assert not RunPaths(tmp_path).lock.exists()
    runlock.check_free(tmp_path)


def test_stale_locks_are_taken_over_with_a_note(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    here_now = Here.now()
    cases = [owner(host=here_now.host, boot_id=here_now.boot_id, pid=p.pid),  # crashed
             owner(host=here_now.host, boot_id="an-earlier-boot", pid=os.getpid()),  # rebooted
             owner(host="another-login-node")]  # old heartbeat
    for o in cases:
        write_lock(tmp_path, o, age_s=runlock.STALE_AFTER_S + 5)
        notes: list[str] = []
        runlock.acquire(tmp_path, "resume", notes.append).release()
        assert len(notes) == 1 and notes[0].startswith("took over the stale lock of trainctl launch"), notes
    assert list(tmp_path.iterdir()) == []  # nothing left aside


def test_live_lock_of_another_host_is_refused_naming_it(tmp_path: Path) -> None:
    write_lock(tmp_path, owner(host="login7", pid=4242))
    with pytest.raises(UsageError) as e:
        runlock.acquire(tmp_path, "resume")
    assert "pid 4242 on host login7" in e.value.message and "on host login7 (or wait" in e.value.message
    assert "\n" not in e.value.message


def test_two_racing_launchers_get_one_lock(tmp_path: Path) -> None:
    write_lock(tmp_path, owner(host="gone-node"), age_s=runlock.STALE_AFTER_S + 5)
    results: list[str] = []
    won: list[runlock.RunLock] = []
    barrier = threading.Barrier(8)

    def go() -> None:
        barrier.wait()
        try:
            won.append(runlock.acquire(tmp_path, "resume"))
            results.append("won")
        except UsageError:
            results.append("refused")

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for lock in won:
        lock.release()
    assert sorted(results) == ["refused"] * 7 + ["won"]


def test_heartbeat_records_children_and_touches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runlock, "CHILD_POLL_S", 0.05)
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.2)
    lock = runlock.acquire(tmp_path, "launch")
    path = RunPaths(tmp_path).lock
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.time() + 10
        while child.pid not in [c[0] for c in json.loads(path.read_text())["children"]]:
            assert time.time() < deadline, path.read_text()
            time.sleep(0.05)
        os.utime(path, (time.time() - 100, time.time() - 100))
        deadline = time.time() + 10
        while time.time() - path.stat().st_mtime > 50:
            assert time.time() < deadline
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
        lock.release()
    assert not path.exists()

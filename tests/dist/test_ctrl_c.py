"""What the person at the terminal sees and keeps, through `trainctl launch` with real torchrun, real ranks and
real signals (docs/design/signals.md, "Signal chain" and "Run states"): Ctrl-C saves and stops with no step
lost, a second Ctrl-C kills at once, a SIGKILLed launcher leaves no process behind and a resumable run, a rank
killed by SIGKILL is named as the first cause (out of memory when the kernel's OOM killer sent it), and
`status` agrees with the launcher's last line. Two ranks (DP 2): enough for "every rank stops after the same
step"."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pty
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cli_utils import TRAINCTL, trainctl
from paths import REPO
from trainer_utils import processes_mentioning

from trainctl.checkpoint import list_checkpoints
from trainctl.checkpoint.format import step_dirname
from trainctl.errors import EXIT_RUN_FAILED, EXIT_STOPPED
from trainctl.hardware import oom_kills
from trainctl.hardware.hostname import this_host
from trainctl.rundir.paths import read_jsonl
from trainctl.runtime.train import faults

pytestmark = pytest.mark.slow

TINY = REPO / "recipes" / "tiny-cpu.yaml"
DP2 = ["--set", "parallel.tp=1", "--set", "parallel.pp=1", "--set", "parallel.dp=2",
       "--set", "parallel.sequence_parallel=false", "--set", "cluster.gpus_per_node=2"]
LONG = ["--set", "train.steps=100000", "--set", "checkpoint.every_steps=100000"]  # no save unless asked
TORCHRUN_LOG_LINE = re.compile(r"^[WEI]\d{4} ")  # torchrun's glog-style lines
GONE_WITHIN_S = 60.0  # a liveness bound, not a timing claim: "within seconds" is what is printed


def launch(run: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([*TRAINCTL, "launch", str(TINY), "--run-dir", str(run), *DP2, *LONG, *extra], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def wait_for_step(run: Path, proc: subprocess.Popen[str], step: int) -> None:
    deadline = time.time() + 180
    while not any(m.get("step", 0) >= step for m in read_jsonl(run / "metrics.jsonl")):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() < deadline, "the run did not reach its step"
        time.sleep(0.2)


def processes_of(run: Path) -> list[int]:
    return processes_mentioning(str(run))


def wait_gone(run: Path) -> float:
    t0 = time.monotonic()
    while processes_of(run):
        assert time.monotonic() - t0 < GONE_WITHIN_S, f"processes left: {processes_of(run)}"
        time.sleep(0.1)
    return time.monotonic() - t0


def status(run: Path) -> dict[str, Any]:
    r = trainctl("status", str(run), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def assert_clean(out: str) -> None:
    """Only trainctl's own lines: no Python traceback, no torchrun log lines or failure block."""
    assert "Traceback" not in out and "ChildFailedError" not in out and "Root Cause" not in out, out[-3000:]
    assert not [ln for ln in out.splitlines() if TORCHRUN_LOG_LINE.match(ln)], out[-3000:]


def valid_steps(run: Path) -> list[int]:
    return [c.step for c in list_checkpoints(run / "checkpoints") if c.valid]


@pytest.fixture
def small_memory_cgroup() -> Any:
    """A memory cgroup of 256 MiB beside this test's own (cgroup v1 or v2): what a job's memory limit is."""
    where = oom_kills.cgroup_dir()
    if where is None:
        pytest.skip("no memory cgroup visible here")
    group = where[0] / f"trainctl-test-{secrets.token_hex(4)}"
    try:
        group.mkdir()
        limit = next(f for f in ("memory.limit_in_bytes", "memory.max") if (group / f).exists())
        (group / limit).write_text(str(256 << 20))
    except (OSError, StopIteration) as e:
        pytest.skip(f"cannot make a memory cgroup with a limit here: {e}")
    yield group
    for _ in range(100):  # the killed rank leaves the group as the kernel reaps it
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def test_rank_killed_by_the_oom_killer_is_out_of_memory(tmp_path: Path, small_memory_cgroup: Path) -> None:
    """Rank 1 runs in a 256 MiB memory cgroup and outgrows it at step 3: the kernel's SIGKILL is named out of
    memory (its cgroup's OOM kill count grew since the rank started), where a `kill -9` stays a signal
    (test_rank_killed_by_sigkill_is_the_first_cause)."""
    run = tmp_path / "run"
    proc = launch(run, env=faults.encode(oom_at_step=f"1:3:{small_memory_cgroup}"))
    out, _ = proc.communicate(timeout=180)
    wait_gone(run)
    assert proc.returncode == EXIT_RUN_FAILED, out[-3000:]
    assert re.search(r"run failed: rank 1 on \S+: out of memory: killed by the kernel's out-of-memory killer "
                     rf"\(memory cgroup {re.escape(str(small_memory_cgroup))}: 1 OOM kill\(s\) since it started\)",
                     out), out[-2000:]
    assert_clean(out)
    st = status(run)
    assert st["state"] == "FAILED" and "rank 1" in st["reason"] and "out of memory" in st["reason"], st


def test_ctrl_c_saves_after_the_current_step_and_loses_none(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = launch(run)
    wait_for_step(run, proc, 3)
    proc.send_signal(signal.SIGINT)  # what the terminal sends the foreground launcher
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == EXIT_STOPPED, out[-3000:]
    wait_gone(run)
    last = max(m["step"] for m in read_jsonl(run / "metrics.jsonl"))
    # the checkpoint is of the last step any rank ran: no step is lost
    assert valid_steps(run) == [last]
    assert f"stopped at step {last}, checkpoint saved; `trainctl resume {run}` continues" in out, out[-2000:]
    assert "press Ctrl-C again to kill at once" in out
    assert_clean(out)
    st = status(run)
    assert (st["state"], st["steps_done"]) == ("STOPPED", last) and "Ctrl-C" in st["reason"], st
    # nothing trains, so no ETA: a stopped run's last step plus what is left is a time that will not come
    assert st["projection"]["running"] is False and st["projection"]["eta_time"] is None
    assert st["projection"]["remaining_s"] > 0 and st["projection"]["total_is"] == "projected"
    # every rank stopped after that step
    for f in (run / "logs").glob("steptimes-rank*.jsonl"):
        assert max(r["step"] for r in read_jsonl(f) if "step_s" in r) == last, f


def test_second_ctrl_c_kills_at_once(tmp_path: Path) -> None:
    """The first stop request is a SIGHUP (the terminal closed: handled as Ctrl-C) and its save is slowed (the
    writer sleeps 30 s before the commit): a Ctrl-C then kills every process before the commit, and the run
    stays resumable from what was committed before (nothing here)."""
    run = tmp_path / "run"
    proc = launch(run, env=faults.encode(slow_write_s=30))
    wait_for_step(run, proc, 2)
    proc.send_signal(signal.SIGHUP)
    deadline = time.time() + 120
    while not any(e["event"] == "stop_requested" for e in read_jsonl(run / "events.jsonl")):
        assert time.time() < deadline
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    gone = wait_gone(run)
    assert proc.returncode == EXIT_STOPPED, out[-3000:]
    assert "SIGHUP: every rank saves a checkpoint after its current step" in out
    assert "SIGINT again: killing torchrun and every rank now" in out
    assert "killed before the ranks could save (a second Ctrl-C)" in out and valid_steps(run) == []
    assert_clean(out)
    assert status(run)["state"] == "STOPPED"
    print(f"second Ctrl-C: every process gone {gone:.2f} s after the launcher returned")


def test_a_failed_rank_with_a_restart_left_is_starting_again_not_stopping(tmp_path: Path) -> None:
    """Rank 1 fails at step 3 of torchrun's first attempt, with launcher.max_restarts=1: while torchrun restarts
    the workers, `status` says STARTING and names the failure and the restart (it said STOPPING, "the ranks
    save a checkpoint", which nothing does, and `cancel` then sent nothing); the restarted workers train on."""
    from trainctl.launch.status import run_status

    run = tmp_path / "run"
    proc = launch(run, "--set", "launcher.max_restarts=1", "--set", "train.steps=6",
                  "--set", "checkpoint.every_steps=2", env=faults.encode(fail_at_step=3, fail_rank=1, fail_attempt=0))
    seen: list[tuple[str, str]] = []
    while proc.poll() is None:
        # job.json is written (atomically) last when the run directory is made: before it there is no run to
        # ask about; after it any exception of status is a failure of this test
        if (run / "job.json").is_file():
            st = run_status(run)
            seen.append((st.state, st.reason or ""))
        time.sleep(0.1)
    out = proc.communicate()[0]
    assert proc.returncode == 0, out[-3000:]
    restarting = [why for state, why in seen if state == "STARTING" and "torchrun restarts" in why]
    assert restarting, sorted(set(seen))
    assert re.match(r"rank 1 on \S+: exception: .*InjectedFailure.*; torchrun restarts the workers from the newest "
                    r"checkpoint \(1 restart left, launcher.max_restarts\)$", restarting[0]), restarting[0]
    assert "STOPPING" not in {state for state, _ in seen}, sorted(set(seen))
    assert status(run)["state"] == "COMPLETED"


def test_sigkilled_launcher_leaves_no_orphan_and_a_resumable_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = launch(run)
    wait_for_step(run, proc, 3)
    t0 = time.monotonic()
    proc.kill()  # SIGKILL: no handler runs in the launcher
    proc.communicate(timeout=30)
    wait_gone(run)
    print(f"SIGKILLed launcher: torchrun and its ranks gone after {time.monotonic() - t0:.2f} s")
    last = max(m["step"] for m in read_jsonl(run / "metrics.jsonl"))
    assert valid_steps(run) == [last]  # the ranks saw their parent go and saved after the same step
    st = status(run)
    assert st["state"] == "STOPPED" and "the launcher or torchrun was killed" in st["reason"], st
    # the lock left by the dead launcher is stale: resume takes it over and continues from that step
    r = trainctl("resume", str(run), "--set", f"train.steps={last + 1}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "took over the stale lock" in r.stdout and f"from step {last}" in r.stdout
    assert status(run)["state"] == "COMPLETED"


def test_rank_killed_by_sigkill_is_the_first_cause(tmp_path: Path) -> None:
    """The survivors fail with gloo's "connection closed by peer", which is not the cause: torchrun's record of
    the SIGKILL names the rank. The launcher's last line and `status` say the same."""
    run = tmp_path / "run"
    proc = launch(run)
    wait_for_step(run, proc, 2)
    pids = {}
    for pid in processes_of(run):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next((v.split(b"=", 1)[1] for v in env if v.startswith(b"RANK=")), None)
        if rank is not None and any(v.startswith(b"LOCAL_RANK=") for v in env):
            pids[int(rank)] = pid
    os.kill(pids[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=180)
    wait_gone(run)
    assert proc.returncode == EXIT_RUN_FAILED, out[-3000:]
    # this host by one name: torchrun's (its fully qualified name, "localhost" where /etc/hosts says so) is
    # the one the events and every other line use
    assert re.search(rf"run failed: rank 1 on {re.escape(this_host())}: signal: killed by SIGKILL", out), out[-2000:]
    assert_clean(out)
    st = status(run)
    assert st["state"] == "FAILED" and "rank 1" in st["reason"] and "SIGKILL" in st["reason"], st
    assert st["reason"].startswith(f"rank 1 on {this_host()}: "), st
    hosts = {e["host"] for e in read_jsonl(run / "events.jsonl") if "host" in e}
    assert hosts <= {this_host()}, hosts


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def test_ctrl_z_stops_the_launcher_while_the_ranks_train_on(tmp_path: Path) -> None:
    """Ctrl-Z (SIGTSTP) stops the launcher only: the ranks, in their own session, keep training (as
    docs/FAILURES.md says); continued (`fg`), the launcher shows the run again and a Ctrl-C stops it as usual.
    The launcher runs in a process group of its own, as a shell's job does: the kernel discards SIGTSTP sent to
    an orphaned process group, which pytest's own group is when whatever started pytest has exited."""
    run = tmp_path / "run"
    proc = subprocess.Popen([*TRAINCTL, "launch", str(TINY), "--run-dir", str(run), *DP2, *LONG], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, process_group=0)
    try:
        wait_for_step(run, proc, 2)
        os.kill(proc.pid, signal.SIGTSTP)
        deadline = time.time() + 60
        while process_state(proc.pid) != "T":
            assert time.time() < deadline, "the launcher did not stop"
            time.sleep(0.1)
        stopped_at = max(m["step"] for m in read_jsonl(run / "metrics.jsonl"))
        deadline = time.time() + 180
        while max(m["step"] for m in read_jsonl(run / "metrics.jsonl")) < stopped_at + 3:
            assert time.time() < deadline, "the ranks did not train on while the launcher was stopped"
            time.sleep(0.2)
        assert process_state(proc.pid) == "T"
        os.kill(proc.pid, signal.SIGCONT)
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == EXIT_STOPPED, out[-3000:]
        assert re.search(rf"^step +{stopped_at + 3}/", out, re.MULTILINE), out[-3000:]  # the steps trained meanwhile
    finally:  # a failed check leaves no ranks training 100,000 steps
        for pid in [proc.pid, *processes_of(run)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def wait_for_event(run: Path, kind: str) -> None:
    deadline = time.time() + 120
    while not any(e["event"] == kind for e in read_jsonl(run / "events.jsonl")):
        assert time.time() < deadline, f"no {kind} event"
        time.sleep(0.1)


def test_cancel_again_waits_for_the_save_and_force_keeps_the_committed_checkpoint(tmp_path: Path) -> None:
    """Step 2's save commits; step 4's is still being written (the writer sleeps before its commit) when `cancel`
    asks the ranks to stop. A second `cancel` sends nothing ("already stopping"), a second SIGTERM is only noted;
    `cancel --force` kills every process, the save in flight with it, and the run resumes from step 2, the
    newest committed checkpoint: `status` and `runs` say 2 steps are committed and the rest will be run again
    (they used to count the lost steps as done)."""
    run = tmp_path / "run"
    proc = launch(run, "--set", "checkpoint.every_steps=2", "--set", "checkpoint.keep_last=1",
                  env=faults.encode(slow_write_s=600, slow_write_from_step=4))
    wait_for_step(run, proc, 5)
    assert valid_steps(run) == [2] and list((run / "checkpoints").glob(f"{step_dirname(4)}.tmp-*"))
    first = trainctl("cancel", str(run))
    assert first.returncode == 0 and "every rank saves a checkpoint" in first.stdout, first
    wait_for_event(run, "stop_requested")
    again = trainctl("cancel", str(run))
    assert again.returncode == 0, again
    assert re.search(r"already stopping: step \d+, checkpoint in progress; nothing more sent", again.stdout), again
    early = trainctl("resume", str(run))  # while the save is in flight: wait, not "stop it with trainctl cancel"
    assert early.returncode == 2, early
    (line,) = early.stderr.strip().splitlines()
    assert re.search(rf"{re.escape(str(run))} is still stopping: `trainctl cancel` asked it to stop at "
                     r"\d\d:\d\d:\d\d; step \d+, checkpoint in progress \(trainctl launch .*; wait for it to end "
                     rf"\(`trainctl status {re.escape(str(run))}` says when it has\)", line), line
    assert "trainctl cancel " + str(run) not in line, line
    proc.send_signal(signal.SIGTERM)  # a second `kill` of the launcher is noted, not a kill either
    assert proc.poll() is None and status(run)["state"] == "STOPPING"  # still saving, nothing killed
    force = trainctl("cancel", "--force", str(run))
    assert force.returncode == 0 and "kill torchrun and every rank now" in force.stdout, force
    out, _ = proc.communicate(timeout=120)
    wait_gone(run)
    assert proc.returncode == EXIT_STOPPED, out[-3000:]
    assert out.count("SIGTERM again: already stopping") == 1, out[-2000:]  # the kill's; the second cancel sent none
    assert "SIGTERM from `trainctl cancel --force`: killing torchrun and every rank now" in out, out[-2000:]
    assert "killed before the ranks could save (`trainctl cancel --force`)" in out and "Ctrl-C)" not in out
    assert_clean(out)
    assert valid_steps(run) == [2]  # the save in flight is discarded whole; the committed one is kept
    st = status(run)
    assert st["state"] == "CANCELLED" and "cancel --force" in st["reason"], st
    # status and runs count what is committed, and the steps past it that the resume runs again
    ran = max(m["step"] for m in read_jsonl(run / "metrics.jsonl"))
    assert ran >= 5 and (st["steps_done"], st["steps_committed"], st["steps_lost"]) == (ran, 2, ran - 2), st
    said = f"steps 2/100000 committed ({ran} run; {ran - 2} will be run again)"
    shown = trainctl("status", str(run), env={"COLUMNS": "300"}).stdout
    assert said in shown and f"steps 2/100000 committed, {ran - 2} more to run again (measured" in shown, shown
    assert st["projection"]["steps"] == {"done": 2, "total": 100000, "lost": ran - 2}, st["projection"]
    listed = trainctl("runs", str(tmp_path), env={"COLUMNS": "200"}).stdout
    assert said.removeprefix("steps ") in listed, listed
    exit_event = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "launcher_exit"][-1]
    assert exit_event["state"] == "CANCELLED", exit_event
    resumed = trainctl("resume", str(run), "--set", "train.steps=3")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resumed from checkpoint step 2" in resumed.stdout, resumed.stdout[-2000:]


@pytest.mark.parametrize("how", ["cancel", "ctrl-c"])
def test_a_stop_during_start_up_is_resumable_with_nothing_to_save(tmp_path: Path, how: str) -> None:
    """`cancel` as soon as the ranks' processes exist (still importing torch, before their signal handler), or
    Ctrl-C as soon as the run lock exists (torchrun not started yet): no rank dies of the SIGTERM, none trains."""
    run = tmp_path / "run"
    proc = launch(run)
    deadline = time.time() + 120
    while not ((run / "run.lock").exists() if how == "ctrl-c"
               else any(b"trainctl.runtime" in Path(f"/proc/{p}/cmdline").read_bytes() for p in processes_of(run)
                        if Path(f"/proc/{p}/cmdline").exists())):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.02)
    if how == "cancel":
        r = trainctl("cancel", str(run))
        assert r.returncode == 0, r
    else:
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=180)
    wait_gone(run)
    word, state = ("cancelled", "CANCELLED") if how == "cancel" else ("stopped", "STOPPED")
    assert proc.returncode == EXIT_STOPPED, out[-3000:]
    assert f"{word} before the first step: nothing to save; `trainctl resume {run}` starts from the beginning" \
        in out, out[-2000:]
    assert "checkpoint saved" not in out and "killed by" not in out
    assert_clean(out)
    assert valid_steps(run) == [] and not read_jsonl(run / "metrics.jsonl")
    st = status(run)
    assert st["state"] == state and "nothing to save" in st["reason"], st
    # export says why there is no checkpoint (the schedule is set; the run stopped before its first save),
    # not "set checkpoint.every_steps", which the spec sets
    exported = trainctl("export", str(run), str(tmp_path / "hf"), "--format", "hf")
    assert exported.returncode == 2 and "set checkpoint.every_steps" not in exported.stderr, exported.stderr
    assert exported.stderr.splitlines()[-1] == (
        "hint: none was saved: the run stopped before its first step, before its first save at step 100000 "
        f"(checkpoint.every_steps). Fix: `trainctl resume {run}` runs it on to a save (a stop after a step also "
        "saves)"), exported.stderr


@pytest.fixture
def read_only_later() -> Any:
    """A function that makes a directory read-only in place (a read-only bind mount of it over itself: root
    ignores file modes, not a read-only mount); unmounted at the end."""
    mounted: list[Path] = []

    def make(where: Path) -> None:
        for argv in (["mount", "--bind", str(where), str(where)], ["mount", "-o", "remount,bind,ro", str(where)]):
            r = subprocess.run(argv, capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"cannot make a read-only mount here: {' '.join(argv)}: {r.stderr.strip()}")
            if argv[1] == "--bind":
                mounted.append(where)

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def delete_under_writers(path: Path) -> None:
    """rm -rf of a directory the ranks still write into: a file they create between rmtree's listing and its
    rmdir fails that rmdir (ENOTEMPTY), so delete again until the directory is gone."""
    for _ in range(100):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.ENOTEMPTY:
                raise
    raise AssertionError(f"{path} kept filling up while it was deleted")


@pytest.mark.parametrize("what", ["was deleted while the run trained (job.json is gone)",
                                  "became read-only while the run trained (its file system was remounted "
                                  "read-only)"], ids=["deleted", "read-only"])
def test_run_dir_lost_while_training_is_one_line(tmp_path: Path, read_only_later: Any, what: str) -> None:
    run = tmp_path / "run"
    proc = launch(run)
    wait_for_step(run, proc, 2)
    if "deleted" in what:
        delete_under_writers(run)
    else:
        read_only_later(run)
    out, _ = proc.communicate(timeout=180)
    wait_gone(run)
    assert proc.returncode == EXIT_RUN_FAILED, out[-3000:]
    assert out.rstrip().splitlines()[-1] == (f"run failed: the run directory {run} {what}; nothing more of this run "
                                             "could be recorded there"), out[-2000:]
    assert_clean(out)
    if "deleted" in what:  # neither the launcher nor a rank made any of it again (a heartbeat, metrics, a save)
        assert not run.exists(), sorted(str(p.relative_to(run)) for p in run.rglob("*"))


def test_terminal_that_goes_away_still_saves_and_records(tmp_path: Path) -> None:
    """The launcher runs on a real pty; its other side closes (the terminal window went away: SIGHUP, then every
    write to it fails with EIO). The ranks save, and the launcher records how the run ended and exits 75."""
    run = tmp_path / "run"
    pid, master = pty.fork()
    if pid == 0:  # the child: the launcher, with the pty as its terminal
        try:
            os.chdir(REPO)
            os.execv(sys.executable, [sys.executable, "-m", "trainctl", "launch", str(TINY), "--run-dir", str(run),
                                      *DP2, *LONG])
        finally:
            os._exit(127)
    seen = b""
    deadline = time.time() + 180
    while not any(m.get("step", 0) >= 2 for m in read_jsonl(run / "metrics.jsonl")):
        assert time.time() < deadline, seen[-3000:]
        if select.select([master], [], [], 0.2)[0]:
            with contextlib.suppress(OSError):
                seen += os.read(master, 65536)
    os.close(master)  # the terminal goes away
    deadline = time.time() + 180
    while (waited := os.waitpid(pid, os.WNOHANG))[0] == 0:
        assert time.time() < deadline, "the launcher did not end"
        time.sleep(0.2)
    wait_gone(run)
    assert os.waitstatus_to_exitcode(waited[1]) == EXIT_STOPPED
    last = max(m["step"] for m in read_jsonl(run / "metrics.jsonl"))
    assert valid_steps(run) == [last]
    events = read_jsonl(run / "events.jsonl")
    assert [e["signal"] for e in events if e["event"] == "stop_requested"] == ["SIGHUP"]
    exit_event = [e for e in events if e["event"] == "launcher_exit"]
    assert exit_event and exit_event[-1]["state"] == "STOPPED", events[-3:]
    attempt = json.loads((run / "job.json").read_text())["attempts"][-1]
    assert attempt["status"] == "stopped" and attempt["exit_code"] == 0, attempt
    assert status(run)["state"] == "STOPPED"

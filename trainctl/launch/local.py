"""Local launch: run the bundled trainer under `torchrun --standalone` on this machine. No torch import.

torchrun writes every rank's stdout/stderr to RUN/logs/<run id>/attempt_<n>/<rank>/ and tees rank 0's
to its own console; we stream that console to ours and into RUN/logs/launcher.log.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from trainctl.data_prep import check_data
from trainctl.errors import EXIT_DIVERGED, EXIT_OK, EXIT_RUN_FAILED, RunError, UsageError
from trainctl.launch import runlock
from trainctl.launch.backend import (
    DEFAULT_GRACE_S,
    TRAINER_MODULE,
    Backend,
    JobState,
    Line,
    LogFiles,
    Say,
    no_rank_logs,
    note,
    verbatim,
)
from trainctl.launch.create import (
    check_run_dir,
    create_run_dir,
    default_run_dir,
    freeze_spec,
    now_iso,
    read_job,
    record_attempt,
)
from trainctl.launch.diskspace import disk_full_line
from trainctl.launch.slurm import job_state as words
from trainctl.rundir import RunPaths, read_jsonl, record_event
from trainctl.spec import RunSpec

NAME = "local"  # launcher.backend and job.json "backend" of runs this backend starts
KILL_GRACE_S = 30.0  # after a forwarded signal, how long torchrun gets to stop its workers


@dataclass(frozen=True)
class LocalLaunch:
    """Everything a local launch will do, rendered before anything runs (what --dry-run prints)."""

    spec: RunSpec
    run_dir: Path
    nproc: int
    command: list[str]
    env: dict[str, str]  # variables set on top of the caller's environment
    module: str = TRAINER_MODULE  # what every rank runs


def available_cpus() -> int:
    # The CPUs this process may use (cgroups/taskset/Slurm), not the machine's total.
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _descendants(pid: int) -> list[int]:
    """Child processes, recursively, from /proc (Linux); torchrun starts each worker in its own session,
    so killing torchrun's process group would miss them."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            out += [child, *_descendants(child)]
    return out


def kill_tree(pid: int) -> None:
    for p in [*_descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def torchrun_command(run_dir: Path, nproc: int, max_restarts: int = 0, python: str | None = None,
                     module: str = TRAINER_MODULE) -> list[str]:
    """`torchrun` through this interpreter (so the venv's torch runs), rank 0 on the console only."""
    return [
        python or sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
        f"--log-dir={RunPaths(run_dir).logs}", "--redirects=3", "--tee=3", "--local-ranks-filter=0",
        "-m", module, str(run_dir),
    ]


def plan_local(spec: RunSpec, run_dir: Path | None = None, existing: bool = False,
               module: str = TRAINER_MODULE) -> LocalLaunch:
    """Check what can be checked before starting (exit 2 on a problem) and render the command.

    existing=True: relaunch into an existing run directory (`trainctl resume`), which must then exist."""
    if spec.backend != NAME:
        raise UsageError(f"launcher.backend = {spec.launcher.backend!r} resolves to {spec.backend!r}, not {NAME}",
                         hint=f"use --set launcher.backend={NAME} to run on this machine")
    if spec.cluster.nodes != 1:
        raise UsageError(f"cluster.nodes = {spec.cluster.nodes}: a local launch runs on this one machine",
                         hint="set cluster.nodes: 1 (and gpus_per_node to the number of ranks)")
    spec = freeze_spec(spec)
    check_data(spec)
    root = (run_dir or default_run_dir(spec)).absolute()
    runlock.check_free(root)  # one job per run directory: a live launcher there is named (exit 2)
    if not existing:
        check_run_dir(root)
    nproc = spec.cluster.gpus_per_node * spec.cluster.nodes
    env = {
        # N ranks share the cores; without this each rank starts a thread per core and they thrash.
        "OMP_NUM_THREADS": str(max(1, available_cpus() // nproc)),
        "PYTHONUNBUFFERED": "1",  # step lines reach the log files (and the console) as they happen
        **spec.launcher.env,
    }
    command = torchrun_command(root, nproc, spec.launcher.max_restarts, module=module)
    return LocalLaunch(spec=spec, run_dir=root, nproc=nproc, command=command, env=env, module=module)


def create(launch: LocalLaunch) -> RunPaths:
    return create_run_dir(launch.run_dir, launch.spec, backend=NAME, command=launch.command, env=launch.env)


class ConsoleFilter:
    """What of torchrun's console a person needs: rank 0's lines without the `[default0]:` prefix, and
    torchrun's failure summary without torchrun's own Python traceback (that stays in launcher.log)."""

    RANK0 = "[default0]:"

    def __init__(self) -> None:
        self.in_traceback = False
        self.out_ok = True

    def filter(self, line: str) -> str | None:
        if line.startswith(self.RANK0):
            return line[len(self.RANK0):]
        if line.startswith("Traceback (most recent call last):"):
            self.in_traceback = True
        if self.in_traceback:
            if "ChildFailedError" in line:
                self.in_traceback = False
            return None
        return line


def run(launch: LocalLaunch, paths: RunPaths, out: TextIO | None = None, kind: str = "launch") -> int:
    """Run torchrun, stream its console, forward Ctrl-C/SIGTERM; 0 when the trainer succeeded, else 1.

    Appends a new attempt to job.json (a `trainctl resume` of the same run directory is attempt 2, ...)."""
    out = out or sys.stdout
    started = time.time()
    attempt = len(read_job(paths).get("attempts") or []) + 1
    record_attempt(paths, attempt=attempt, started=now_iso(), kind=kind)
    record_event(paths, kind, backend=NAME, nproc=launch.nproc, attempt=attempt)
    # Own session: a terminal Ctrl-C reaches only us, and we decide what torchrun gets (and when to kill).
    proc = subprocess.Popen(launch.command, env={**os.environ, **launch.env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    interrupted: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        interrupted.append(signum)
        if len(interrupted) == 1:  # torchrun stops its workers itself (signal, then SIGKILL after 30 s)
            proc.send_signal(signum)
        else:  # a second Ctrl-C: the user means it
            kill_tree(proc.pid)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with open(paths.launcher_log, "ab") as log:
            assert proc.stdout is not None
            console = ConsoleFilter()
            for line in iter(proc.stdout.readline, b""):
                log.write(line)
                log.flush()
                shown = console.filter(line.decode("utf-8", errors="replace"))
                if shown is not None and console.out_ok:
                    try:
                        out.write(shown)
                        out.flush()
                    except BrokenPipeError:  # `trainctl launch | head`: keep training, keep logging
                        console.out_ok = False
        try:
            rc = proc.wait(timeout=KILL_GRACE_S if interrupted else None)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    # Ranks that stopped on SIGTERM/USR1/USR2 after a checkpoint exit 0 under torchrun (see
    # trainctl.runtime.checkpointing.requeue_code): the event, not the exit code, says the run is unfinished.
    from trainctl.launch.resume import stopped_for_requeue

    stopped = stopped_for_requeue(paths, since=started)
    # A diverged run's ranks exit 0 under torchrun too (trainctl.runtime.divergence.exit_code): read the event.
    diverged = next((e for e in read_jsonl(paths.events) if e.get("event") == "diverged"
                     and e.get("time", 0) >= started), None)
    finished = rc == 0 and not interrupted and not stopped and not diverged
    status = EXIT_OK if finished else EXIT_DIVERGED if diverged else EXIT_RUN_FAILED
    record_attempt(paths, attempt=attempt, exit_code=rc, status="completed" if finished else "diverged" if diverged
                   else "stopped_after_checkpoint" if stopped else ("interrupted" if interrupted else "failed"),
                   seconds=round(time.time() - started, 3))
    record_event(paths, "launcher_exit", backend=NAME, exit_code=rc,
                 signal=signal.Signals(interrupted[0]).name if interrupted else None)
    return status


def end_line(paths: RunPaths, status: int, *, since: float, trainer: bool = True) -> Line:
    """The launcher's last line for one attempt: what happened and how to go on."""
    from trainctl.launch.resume import stopped_for_requeue

    if status == EXIT_OK:
        return note(("done", "green"), f" metrics: {paths.metrics}" if trainer else "")
    if status == EXIT_DIVERGED:
        ev = next((e for e in reversed(read_jsonl(paths.events)) if e.get("event") == "diverged"), {})
        kept = ev.get("last_finite_checkpoint")
        go_on = (f"change what made it diverge (train.lr, train.grad_clip) and `trainctl resume {paths.root} "
                 f"--set ...` continues from it" if kept else "no checkpoint to continue from")
        return note(("diverged", "red"), f" at step {ev.get('step')}; last finite checkpoint "
                    f"{f'step {kept}' if kept else 'none'}; {go_on}")
    if stopped_for_requeue(paths, since=since):
        return note(("stopped by a signal after a checkpoint", "yellow"), f"; `trainctl resume {paths.root}` "
                    "continues")
    if full := disk_full_line(paths):
        return note(("run failed", "red"), f": {full}")
    return note(("run failed", "red"), f"; rank logs under {paths.logs} (console copy in {paths.launcher_log})")


def env_words(env: dict[str, str]) -> str:
    """The variables a launch sets, as shell words (what a person would type before the command)."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())


# --- the run's state, for `trainctl status/runs/logs/cancel` ------------------------------------------

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a recycled pid is not our launcher
        return b"trainctl" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


def launcher_pid(events: list[dict[str, Any]]) -> int | None:
    """The local launcher's pid (the `launch` event's writer)."""
    for ev in reversed(events):
        if ev.get("event") in ("launch", "resume") and isinstance(ev.get("pid"), int):
            return int(ev["pid"])
    return None


def local_state(job: dict[str, Any], events: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The last launch's state in Slurm's words, from job.json's attempts and whether its launcher lives."""
    attempts = job.get("attempts") or []
    if not attempts:
        return words.PENDING, "not started"
    last = attempts[-1]
    status = last.get("status")
    if status == "completed":
        return words.COMPLETED, None
    if status == "interrupted":
        return words.CANCELLED, f"exit code {last.get('exit_code')}"
    if status == "failed":
        return words.FAILED, f"exit code {last.get('exit_code')}"
    if status == "diverged":  # the divergence guard stopped it (runtime/divergence.py)
        return words.FAILED, "diverged: the loss or gradient norm stayed NaN/inf (events.jsonl: diverged)"
    pid = launcher_pid(events)
    if pid is not None and _pid_alive(pid):
        return words.RUNNING, None
    return words.FAILED, "the launcher process is gone without recording an exit"


# --- the backend ----------------------------------------------------------------------------------------

class LocalBackend(Backend[LocalLaunch, LocalLaunch]):
    """torchrun --standalone on this machine: `launch` and `resume` run in the foreground to the end."""

    name = NAME

    def prepare(self, spec: RunSpec, run_dir: Path | None, *, grace_s: int = DEFAULT_GRACE_S,
                module: str = TRAINER_MODULE) -> LocalLaunch:
        return plan_local(spec, run_dir, module=module)  # no time limit here: grace_s has nothing to warn of

    def dry_run(self, launch: LocalLaunch) -> list[Line]:
        return [note(f"run dir (not created): {launch.run_dir}"),
                verbatim(f"{env_words(launch.env)} {shlex.join(launch.command)}")]

    def start(self, launch: LocalLaunch, say: Say) -> int:
        paths = create(launch)
        say(note(("run dir", "bold"), f" {paths.root}"))
        say(note((f"{launch.nproc} ranks, {env_words(launch.env)}; per-rank logs in {paths.logs}", "dim")))
        with runlock.hold(paths.root, "launch", lambda s: say(note(("note", "yellow"), f" {s}"))):
            started = time.time()
            status = run(launch, paths)
        say(end_line(paths, status, since=started, trainer=launch.module == TRAINER_MODULE))
        return status

    def require_not_active(self, paths: RunPaths) -> None:
        runlock.check_free(paths.root)  # its launcher (or torchrun) still runs: exit 2 naming it

    def prepare_resume(self, spec: RunSpec, paths: RunPaths) -> LocalLaunch:
        return plan_local(spec, paths.root, existing=True)

    def resume_details(self, relaunch: LocalLaunch) -> dict[str, Any]:
        return {"command": relaunch.command, "env": relaunch.env}

    def resume_dry_run(self, relaunch: LocalLaunch) -> list[Line]:
        return [verbatim(f"{env_words(relaunch.env)} {shlex.join(relaunch.command)}")]

    def resume(self, relaunch: LocalLaunch, say: Say) -> int:

        paths = RunPaths(relaunch.run_dir)
        with runlock.hold(paths.root, "resume", lambda s: say(note(("note", "yellow"), f" {s}"))):
            started = time.time()
            status = run(relaunch, paths, kind="resume")
        say(end_line(paths, status, since=started))
        return status

    def job_state(self, paths: RunPaths, job: dict[str, Any], events: list[dict[str, Any]]) -> JobState:
        state, reason = local_state(job, events)
        return JobState(state, reason, attempts=len(job.get("attempts") or []), active=words.is_active(state))

    def log_files(self, paths: RunPaths, job: dict[str, Any], rank: int | None) -> LogFiles:
        if rank is None:
            return LogFiles([paths.launcher_log])
        files = paths.local_rank_logs(rank)
        if not files:
            raise no_rank_logs(paths, rank, "the run may not have started yet")
        return LogFiles(files)

    def cancel(self, paths: RunPaths, job: dict[str, Any]) -> str:
        # SIGTERM, as Ctrl-C would: the launcher forwards it to torchrun, the ranks checkpoint and stop.
        pid = launcher_pid(read_jsonl(paths.events))
        if pid is None:
            raise RunError(f"{paths.root}: no launcher pid recorded in {paths.events.name}")
        os.kill(pid, signal.SIGTERM)
        return f"sent SIGTERM to the local launcher (pid {pid})"

"""Local launch: run the bundled trainer under `torchrun --standalone` on this machine. No torch import.

torchrun writes every rank's stdout/stderr to RUN/logs/<run id>/attempt_<n>/<rank>/ and tees rank 0's
to its own console; we stream that console to ours and into RUN/logs/launcher.log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TextIO

from trainctl.data_prep import check_data
from trainctl.errors import EXIT_OK, EXIT_RUN_FAILED, UsageError
from trainctl.launch.run_dir import (
    check_run_dir,
    create_run_dir,
    default_run_dir,
    freeze_spec,
    now_iso,
    read_job,
    record_attempt,
)
from trainctl.rundir import RunPaths, record_event
from trainctl.spec import RunSpec

TRAINER_MODULE = "trainctl.runtime"
KILL_GRACE_S = 30.0  # after a forwarded signal, how long torchrun gets to stop its workers


@dataclass(frozen=True)
class LocalLaunch:
    """Everything a local launch will do, rendered before anything runs (what --dry-run prints)."""

    spec: RunSpec
    run_dir: Path
    nproc: int
    command: list[str]
    env: dict[str, str]  # variables set on top of the caller's environment


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


def torchrun_command(run_dir: Path, nproc: int, max_restarts: int = 0, python: str | None = None) -> list[str]:
    """`torchrun` through this interpreter (so the venv's torch runs), rank 0 on the console only."""
    return [
        python or sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
        f"--log-dir={run_dir / 'logs'}", "--redirects=3", "--tee=3", "--local-ranks-filter=0",
        "-m", TRAINER_MODULE, str(run_dir),
    ]


def plan_local(spec: RunSpec, run_dir: Path | None = None, existing: bool = False) -> LocalLaunch:
    """Check what can be checked before starting (exit 2 on a problem) and render the command.

    existing=True: relaunch into an existing run directory (`trainctl resume`), which must then exist."""
    if spec.backend != "local":
        raise UsageError(f"launcher.backend = {spec.launcher.backend!r} resolves to {spec.backend!r}, not local",
                         hint="use --set launcher.backend=local to run on this machine")
    if spec.cluster.nodes != 1:
        raise UsageError(f"cluster.nodes = {spec.cluster.nodes}: a local launch runs on this one machine",
                         hint="set cluster.nodes: 1 (and gpus_per_node to the number of ranks)")
    spec = freeze_spec(spec)
    check_data(spec)
    root = (run_dir or default_run_dir(spec)).absolute()
    if not existing:
        check_run_dir(root)
    nproc = spec.cluster.gpus_per_node * spec.cluster.nodes
    env = {
        # N ranks share the cores; without this each rank starts a thread per core and they thrash.
        "OMP_NUM_THREADS": str(max(1, available_cpus() // nproc)),
        "PYTHONUNBUFFERED": "1",  # step lines reach the log files (and the console) as they happen
        **spec.launcher.env,
    }
    command = torchrun_command(root, nproc, spec.launcher.max_restarts)
    return LocalLaunch(spec=spec, run_dir=root, nproc=nproc, command=command, env=env)


def create(launch: LocalLaunch) -> RunPaths:
    return create_run_dir(launch.run_dir, launch.spec, backend="local", command=launch.command, env=launch.env)


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
    record_event(paths, kind, backend="local", nproc=launch.nproc, attempt=attempt)
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
        with open(paths.logs / "launcher.log", "ab") as log:
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
    # trainctl.runtime.resume.requeue_code): the event, not the exit code, says the run is unfinished.
    from trainctl.launch.resume import stopped_for_requeue

    stopped = stopped_for_requeue(paths, since=started)
    finished = rc == 0 and not interrupted and not stopped
    status = EXIT_OK if finished else EXIT_RUN_FAILED
    record_attempt(paths, attempt=attempt, exit_code=rc, status="completed" if finished else
                   "stopped_after_checkpoint" if stopped else ("interrupted" if interrupted else "failed"),
                   seconds=round(time.time() - started, 3))
    record_event(paths, "launcher_exit", backend="local", exit_code=rc,
                 signal=signal.Signals(interrupted[0]).name if interrupted else None)
    return status

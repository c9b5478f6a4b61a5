"""Local launch: run the bundled trainer under `torchrun --standalone` on this machine. No torch import.

torchrun writes every rank's stdout/stderr to RUN/logs/<run id>/attempt_<n>/<rank>/ and tees it to its own
console; we copy that console into RUN/logs/launcher.log and show rank 0's lines on ours (every rank's with
--verbose).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, BinaryIO, TextIO

from trainctl import terminal
from trainctl.data.prep import check_data
from trainctl.errors import RunError, UsageError
from trainctl.fileio import open_append
from trainctl.hf import init_source
from trainctl.launch import environment, package_origin, runlock
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
from trainctl.launch.diskspace import disk_full_line, run_dir_full
from trainctl.launch.procs import children, die_with_parent, handles, kill_tree, signal_all
from trainctl.rundir.paths import DirIdentity, RunPaths, read_jsonl, record_event
from trainctl.rundir.runstate import (
    CANCELLED,
    COMPLETED,
    DIVERGED,
    FAILED,
    FORCED,
    LOST_PEER,
    STOPPED,
    Cause,
    Outcome,
    forced,
    lost_peer_ranks,
    oom_or,
    outcome,
    read_events,
    since,
    torchrun_root_cause,
)
from trainctl.spec import RunSpec

NAME = "local"  # launcher.backend and job.json "backend" of runs this backend starts
KILL_GRACE_S = 30.0  # after a forwarded signal, how long torchrun gets to stop its workers
SECOND_CTRL_C = "a second Ctrl-C"  # what killed the tree, in a run's outcome
RUN_DIR_LOST = "run directory"  # a Cause kind: the run directory was deleted or became unwritable under the run


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


def torchrun_command(run_dir: Path, nproc: int, max_restarts: int = 0, python: str | None = None,
                     module: str = TRAINER_MODULE) -> list[str]:
    """`torchrun` through this interpreter (so the venv's torch runs). Every rank's output goes to its log files
    and, prefixed `[default<rank>]:`, to torchrun's console, which the launcher copies to launcher.log and
    filters for the terminal (ConsoleFilter: rank 0's own lines, or every line under --verbose)."""
    return [
        python or sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
        f"--log-dir={RunPaths(run_dir).logs}", "--redirects=3", "--tee=3",
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
    init_source.check(spec, root)  # the weights it starts from fit its model (exit 2 naming the field)
    runlock.check_free(root)  # one job per run directory: a live launcher there is named (exit 2)
    if not existing:
        check_run_dir(root, spec if module == TRAINER_MODULE else None)
    nproc = spec.cluster.gpus_per_node * spec.cluster.nodes
    env = {
        # N ranks share the cores; without this each rank starts a thread per core and they thrash.
        "OMP_NUM_THREADS": str(max(1, available_cpus() // nproc)),
        "PYTHONUNBUFFERED": "1",  # step lines reach the log files (and the console) as they happen
        **package_origin.rank_variables(spec.launcher.python),  # not a trainctl/ folder of the working directory
        **environment.spec_variables(spec),
    }
    lz = spec.launcher
    if lz.python is not None:
        check_python(lz.python, after_setup=bool(lz.setup))
    environment.check_setup(lz.setup)
    command = torchrun_command(root, nproc, lz.max_restarts, python=lz.python, module=module)
    if lz.setup:  # the same lines as on Slurm, in the shell that then becomes torchrun (exec: the same pid)
        command = ["bash", "-c", environment.exec_after_setup(lz.setup, RunPaths(root).events), "trainctl-setup",
                   *command]
    return LocalLaunch(spec=spec, run_dir=root, nproc=nproc, command=command, env=env, module=module)


def check_python(python: str, *, after_setup: bool) -> None:
    """launcher.python must run here: a path must be an executable file; a bare name must be on PATH, unless
    launcher.setup may put it there (then the setup's shell reports a missing one)."""
    if "/" not in python:
        if shutil.which(python) is None and not after_setup:
            raise UsageError(f"launcher.python = {python!r} is not on PATH",
                             hint="give the interpreter's path, or leave launcher.python out to use this one")
        return
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        why = "is not executable" if os.path.isfile(python) else "does not exist"
        raise UsageError(f"launcher.python = {python!r} {why}",
                         hint="give the path of a python with trainctl and torch installed, or leave it out")


def create(launch: LocalLaunch) -> RunPaths:
    return create_run_dir(launch.run_dir, launch.spec, backend=NAME, command=launch.command, env=launch.env,
                          trains=launch.module == TRAINER_MODULE)


TRACEBACK_STARTS = ("Traceback (most recent call last):", "During handling of the above exception",
                    "The above exception was the direct cause")
STACK_DUMP_STARTS = ("Thread 0x", "Current thread 0x")  # faulthandler's dump of every thread (hang watchdog)
# a rank's own summary lines (runtime/entry.py's on a failure, runtime/observe/watchdog.py's on a hang)
SUMMARY_LINE = re.compile(r"trainctl: rank \d+( failed|: watchdog): ")


class ConsoleFilter:
    """What of torchrun's console a person needs: rank 0's own lines without the `[default0]:` prefix. The
    other ranks' lines, rank 0's Python tracebacks and stack dumps, torchrun's log lines (`W...`, `E...`) and
    its ChildFailedError block stay in launcher.log (and the rank logs); the launcher ends with one line
    naming the first cause instead. `verbose` shows everything as it comes, every rank's lines with their
    `[default<rank>]:` prefix."""

    RANK0 = "[default0]:"

    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose
        self.in_traceback = False
        self.after_message = False  # the traceback's "Type: message" line has passed

    def filter(self, line: str) -> str | None:
        if self.verbose:
            return line
        if not line.startswith(self.RANK0):
            return None
        text = line[len(self.RANK0):]
        if SUMMARY_LINE.match(text):  # the rank's own summary; the launcher's last line names the first cause
            return None
        if text.startswith("USDT:"):  # kineto's profiler_start/stop trace markers (train.profile): in the log only
            return None
        if text.startswith(TRACEBACK_STARTS):
            self.in_traceback, self.after_message = True, False
            return None
        if text.startswith(STACK_DUMP_STARTS):  # indented frames follow, no message line
            self.in_traceback, self.after_message = True, True
            return None
        # inside: the frames (indented), then "Type: message" whose own lines may go on indented or blank
        if self.in_traceback and (text[:1] in (" ", "\t", "\n", "") or not self.after_message):
            self.after_message = self.after_message or text[:1] not in (" ", "\t", "\n", "")
            return None
        self.in_traceback = self.after_message = False
        return text


class Stopper:
    """The launcher's signal handler. The first Ctrl-C (SIGINT), SIGTERM (`trainctl cancel`, `kill`) or SIGHUP (the
    terminal closed) asks every rank to stop: it is recorded (`stop_requested`) first, then SIGTERM goes to the
    ranks themselves, not to torchrun, so they save after the same step and exit 0, and torchrun ends cleanly
    with them. Only a rank that already handles SIGTERM is signalled (SIGTERM's default action would kill it);
    one still starting reads the record once its handler is in place (runtime/train/signals.recorded_stop).
    Killing the whole tree at once takes a second Ctrl-C (the person at the terminal sees it happen) or a
    `trainctl cancel --force`; a repeated SIGTERM or SIGHUP is only noted. Installed before the run lock is
    taken, so `trainctl cancel` never finds a launcher without it."""

    def __init__(self, paths: RunPaths, say: Callable[[str], None], *, trainer: bool) -> None:
        self.paths, self.say = paths, say
        self.begun: float | None = None  # when the attempt began: the time its begin event bears
        self.trainer = trainer  # the trainer's ranks handle SIGTERM; a measuring worker's simply die of it
        self.proc: subprocess.Popen[bytes] | None = None  # torchrun, once started
        self.signals: list[int] = []
        self.killed_by: str | None = None  # what killed the tree, in words (runstate.outcome)
        self.lost: OSError | None = None  # the run directory can no longer be written (RunDirWatch, a write)
        self.ended = False  # torchrun has exited: the attempt's outcome stands, a stop has nothing left to stop
        self.noted: set[str] = set()  # the notes already printed: a flood of repeated signals prints each once
        self.saying = False  # a line is being written: a signal arriving then (a full pipe blocks) must not recurse

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.ended:
            self._note(f"trainctl: {name}: the ranks have already ended; nothing left to stop")
            return
        self.signals.append(signum)
        force = self._forced()
        if len(self.signals) > 1 or force:
            if force or signum == signal.SIGINT:
                self._kill(FORCED if force else SECOND_CTRL_C, name)
            else:
                self._note(f"trainctl: {name} again: already stopping, the ranks save after their current step "
                           f"(`trainctl cancel --force {shlex.quote(str(self.paths.root))}` or Ctrl-C kills at "
                           "once)")
            return
        if self.begun is not None:  # else begin() records it
            self._record()
        self._ask_ranks()
        self.say(f"trainctl: {name}: every rank saves a checkpoint after its current step, then stops "
                 "(press Ctrl-C again to kill at once)")

    def _note(self, text: str) -> None:
        """Say `text` once, and never from inside another line's write."""
        if text in self.noted or self.saying:
            return
        self.noted.add(text)
        self.saying = True
        try:
            self.say(text)
        finally:
            self.saying = False

    def begin(self, begun: float) -> None:
        """The attempt began at `begun` (its begin event bears that time): a request made before is recorded
        now, inside the attempt that its ranks and `status` read."""
        self.begun = begun
        if self.signals:
            self._record()

    def _record(self) -> None:
        try:
            record_event(self.paths, "stop_requested", signal=signal.Signals(self.signals[0]).name,
                         ranks=len(self._ranks()))
        except OSError as e:  # the run directory is gone or read-only: stop the ranks all the same
            self.lost = self.lost or e

    def lose(self, error: OSError) -> None:
        """The run directory was deleted or became read-only under the run: stop the ranks. A deleted one
        leaves nothing to save into (a save would only make parts of it again), so its ranks are killed."""
        if self.lost is not None:
            return
        self.lost = error
        if error.errno == errno.ENOENT:
            if self.proc is not None:
                kill_tree(self.proc.pid)
        else:
            self._ask_ranks()

    def _ranks(self) -> list[int]:
        return children(self.proc.pid) if self.proc is not None else []

    def _ask_ranks(self) -> None:
        ranks = self._ranks()
        if self.trainer:
            signal_all([p for p in ranks if handles(p, signal.SIGTERM)], signal.SIGTERM)
        elif self.proc is not None:  # a measuring worker: SIGTERM ends it; torchrun ends one still starting
            signal_all(ranks, signal.SIGTERM) or signal_all([self.proc.pid], signal.SIGTERM)

    def _forced(self) -> bool:
        try:
            return self.begun is not None and forced(since(read_jsonl(self.paths.events), self.begun))
        except OSError:
            return False

    def _kill(self, by: str, name: str) -> None:
        self.killed_by = by
        self.say(f"trainctl: {name} {'again' if by == SECOND_CTRL_C else f'from {by}'}: killing torchrun and "
                 "every rank now")
        if self.proc is not None:
            kill_tree(self.proc.pid)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def handling_stops(stopper: Stopper, *, to_the_end: bool) -> Iterator[None]:
    """`stopper` handles Ctrl-C, SIGTERM and SIGHUP inside. `to_the_end` (a training launch, whose exit status
    says how the run ended): it keeps them until the process exits, and from `atexit` on they are ignored, so
    a stop asked in the launcher's last moments (its records and last line written; Python's finalization,
    which puts a Python handler back to the default, death) cannot turn exit 0 or 75 into 143. Otherwise (a
    measuring job, after which the command goes on) the handlers before are put back."""
    old = {s: signal.signal(s, stopper) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        if to_the_end:
            atexit.register(_ignore_stops)
        else:
            for s, h in old.items():
                signal.signal(s, h)


def _ignore_stops() -> None:
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


class RunDirWatch:
    """Notices, every few seconds, the run directory deleted (or deleted and made again: rundir.paths.DirIdentity)
    or made read-only under a running launcher, and has the Stopper stop the ranks (which notice a deleted one
    themselves after their step: runtime/checkpoint/policy.py)."""

    EVERY_S = 2.0

    def __init__(self, paths: RunPaths, stopper: Stopper) -> None:
        self.paths, self.stopper = paths, stopper
        self.identity = DirIdentity.of(paths.root)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="trainctl-run-dir-watch", daemon=True)

    def __enter__(self) -> RunDirWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self.EVERY_S):
            if (problem := self.problem()) is not None:
                self.stopper.lose(problem)
                return

    def problem(self) -> OSError | None:
        job = str(self.paths.job)
        lost = self.identity.lost(self.paths.root)
        if lost is not None and lost.errno != errno.ENOENT:
            return lost
        if lost is not None or not self.paths.job.exists():
            return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), job)
        try:
            if os.statvfs(self.paths.root).f_flag & os.ST_RDONLY:
                return OSError(errno.EROFS, os.strerror(errno.EROFS), job)
        except OSError as e:
            return e
        return None


def terminal_say(out: TextIO | None = None) -> Callable[[str], None]:
    """A line to the person's terminal (`out`: stdout), which may have gone away (trainctl/terminal.py)."""
    def say(text: str) -> None:
        terminal.write(out or sys.stdout, text + "\n")
    return say


def run(launch: LocalLaunch, paths: RunPaths, stopper: Stopper, out: TextIO | None = None, kind: str = "launch",
        verbose: bool = False, lock_note: Callable[[str], None] | None = None) -> Outcome:
    """Hold the run lock, run torchrun, stream rank 0's console, with `stopper` (installed by the caller:
    handling_stops) turning Ctrl-C/SIGTERM into "save and stop"; how it ended.

    Appends a new attempt to job.json (a `trainctl resume` of the same run directory is attempt 2, ...).
    The person's terminal may go away (trainctl/terminal.py); the run directory may be deleted or become
    read-only under it: the run then ends FAILED with one line naming the directory (run_dir_lost)."""
    out = out or sys.stdout
    with runlock.hold(paths.root, kind, lock_note) as lock:
        stopper.begin(lock.owner.since)
        return _run(launch, paths, out, kind, ConsoleFilter(verbose), stopper, started=lock.owner.since)


def _run(launch: LocalLaunch, paths: RunPaths, out: TextIO, kind: str, console: ConsoleFilter, stopper: Stopper,
         *, started: float) -> Outcome:
    """The attempt, from `started`, the moment its run lock was taken: a `trainctl cancel`, which finds the
    launcher through the lock, records its request inside the attempt even before its begin event is written."""
    try:
        attempt = len(read_job(paths).get("attempts") or []) + 1
        record_attempt(paths, attempt=attempt, started=now_iso(), kind=kind)
        record_event(paths, kind, backend=NAME, nproc=launch.nproc, attempt=attempt, time=started)
        log_from = paths.launcher_log.stat().st_size if paths.launcher_log.exists() else 0  # this attempt's part
        log: BinaryIO | None = open_append(paths.launcher_log)  # closed below; may fail mid-run
    except OSError as e:
        raise RunError(run_dir_lost(paths, e).reason) from e
    reserve = SpaceReserve(paths.launcher_reserve)
    try:
        rc = _torchrun(launch, paths, out, console, stopper, log)
        full = run_dir_full(paths) if rc else None  # as the ranks ended, the reserve still held
    finally:
        reserve.free()  # room for the records below, when the disk filled under the run
    if stopper.lost is None and full is not None and _unrecorded_failure(
            outcome(since(read_events(paths), started))):
        # a rank that could not write (its metrics, its checkpoint) died before it could record why either
        stopper.lost = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(paths.root))
    if stopper.lost is not None:  # the ranks failed of it too, most likely: the directory is the cause
        lost = run_dir_lost(paths, stopper.lost)
        if stopper.lost.errno in (errno.ENOSPC, errno.EDQUOT):  # still there: say so where `status` reads it
            with contextlib.suppress(OSError):
                _record_end(paths, attempt=attempt, rc=rc, result=lost, stopper=stopper, started=started)
        return lost
    events = since(read_events(paths), started)
    result = outcome(events, killed=stopper.killed_by)
    if rc and _unrecorded_failure(result):
        # nothing recorded, or only the survivors' "connection closed": a rank died by a signal, or torchrun
        # could not start its ranks; torchrun's own record says which
        cause = oom_or(torchrun_root_cause(read_from(paths.launcher_log, log_from), lost_peer_ranks(events))
                       or (result and result.cause), paths)
        result = Outcome(state=FAILED, step=None, reason=cause.line() if cause else f"torchrun exited with status {rc}",
                         cause=cause)
    elif result is None:
        result = Outcome(COMPLETED, None, "every step done")
    try:
        _record_end(paths, attempt=attempt, rc=rc, result=result, stopper=stopper, started=started)
    except OSError as e:  # lost in the last moment
        return run_dir_lost(paths, e)
    return result


def _unrecorded_failure(result: Outcome | None) -> bool:
    """The events of a failed attempt (their `outcome`) hold no rank's record of why, or only the survivors'
    "connection closed": a rank died by a signal, torchrun could not start its ranks, or a rank could not write
    its record."""
    return result is None or (result.cause is not None and result.cause.kind == LOST_PEER)


def _torchrun(launch: LocalLaunch, paths: RunPaths, out: TextIO, console: ConsoleFilter, stopper: Stopper,
              log: BinaryIO | None) -> int:
    """Run torchrun to its end, copying its console to `log` (launcher.log) and the filtered lines to `out`;
    its exit status."""
    # Own session: a terminal Ctrl-C reaches only us, and we decide what the ranks get. torchrun dies with
    # us however we die (PDEATHSIG), and its ranks then stop themselves after a checkpoint.
    env = {**os.environ, **launch.env, **terminal.launch_variables()}
    proc = subprocess.Popen(launch.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=die_with_parent)
    stopper.proc = proc  # a stop asked for before now is recorded: the ranks read it as they start
    assert proc.stdout is not None
    with RunDirWatch(paths, stopper):
        for line in iter(proc.stdout.readline, b""):
            if log is not None:
                try:
                    log.write(line)
                    log.flush()
                except OSError as e:  # the disk filled or failed under the run
                    stopper.lose(e)
                    log = None
            shown = console.filter(line.decode("utf-8", errors="replace"))
            if shown is not None:
                terminal.write(out, shown)
        rc = proc.wait()
    stopper.ended = True
    if log is not None:
        with contextlib.suppress(OSError):
            log.close()
    return rc


def _record_end(paths: RunPaths, *, attempt: int, rc: int, result: Outcome, stopper: Stopper,
                started: float) -> None:
    """How the attempt ended, in job.json's attempt and the `launcher_exit` event (`status` reads it)."""
    record_attempt(paths, attempt=attempt, exit_code=rc, status=result.state.lower(),
                   seconds=round(time.time() - started, 3))
    record_event(paths, "launcher_exit", backend=NAME, exit_code=rc, state=result.state, step=result.step,
                 reason=result.reason, cause=result.cause.to_json() if result.cause else None,
                 signal=signal.Signals(stopper.signals[0]).name if stopper.signals else None)


class SpaceReserve:
    """A little space (RUN/.launcher-reserve) held while the ranks run and freed when they end, so that a launcher
    whose run filled the disk can still record how the run ended (job.json's attempt, the `launcher_exit` event):
    without it `status` finds no record and can only guess (was: "gone without a record ... (killed?)")."""

    SIZE = 64 << 10  # job.json rewritten and one event, many times over

    def __init__(self, path: Path) -> None:
        self.path = path
        try:  # written, not sparse: the blocks are really taken; a disk already full holds none
            with open(path, "wb") as f:
                f.write(bytes(self.SIZE))
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            self.free()

    def free(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)


def run_dir_lost(paths: RunPaths, error: OSError) -> Outcome:
    """A run whose directory the launcher can no longer write (deleted, read-only, full, or else): FAILED,
    with one line naming the directory and what happened."""
    where = f"the run directory {paths.root}"
    name = Path(error.filename).name if error.filename else None
    if error.errno == errno.ENOENT or not paths.root.is_dir():
        what = f"was deleted while the run trained{f' ({name} is gone)' if name else ''}"
    elif error.errno == errno.EROFS:
        what = "became read-only while the run trained (its file system was remounted read-only)"
    elif error.errno in (errno.ENOSPC, errno.EDQUOT):  # its end is recorded (SpaceReserve): resumable
        line = (f"{where} ran out of space while the run trained (its disk or quota is full); free space, "
                f"then `trainctl resume {shlex.quote(str(paths.root))}` continues from the "
                "newest valid checkpoint")
        return Outcome(state=FAILED, step=None, reason=line, cause=Cause(RUN_DIR_LOST, line))
    else:
        what = f"can no longer be written ({error.strerror or error})"
    line = f"{where} {what}; nothing more of this run could be recorded there"
    return Outcome(state=FAILED, step=None, reason=line, cause=Cause(RUN_DIR_LOST, line))


def read_from(path: Path, offset: int) -> str:
    """The file from `offset` on ("" when it is gone)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def end_line(paths: RunPaths, result: Outcome, *, trainer: bool = True) -> Line:
    """The launcher's last line for one attempt: what happened and how to go on."""
    run = shlex.quote(str(paths.root))
    if result.state == COMPLETED:
        return note(("done", "green"), f" metrics: {paths.metrics}" if trainer else "")
    if result.state == DIVERGED:
        go_on = (f"change what made it diverge (train.lr, train.grad_clip) and `trainctl resume {run} --set ...` "
                 "continues from it" if result.kept else "no checkpoint to continue from")
        return note(("diverged", "red"), f" at step {result.step}; last finite checkpoint "
                    f"{f'step {result.kept}' if result.kept else 'none'}; {go_on}")
    if result.state in (STOPPED, CANCELLED):
        word = "cancelled" if result.state == CANCELLED else "stopped"
        if result.before_first_step:
            kept = f"checkpoint step {result.step} kept" if result.step else "nothing to save"
            return note((f"{word} before the first step", "yellow"), f": {kept}; `trainctl resume {run}` "
                        + ("continues" if result.step else "starts from the beginning"))
        if result.step is None:
            return note((word, "yellow"), f": {result.reason}; `trainctl resume {run}` continues from the newest "
                        "valid checkpoint")
        return note((f"{word} at step {result.step}, checkpoint saved", "yellow"),
                    f"; `trainctl resume {run}` continues")
    if result.cause is not None and result.cause.kind == RUN_DIR_LOST:  # its logs are gone or unchanged since
        return note(("run failed", "red"), f": {result.reason}")
    if full := disk_full_line(paths):
        return note(("run failed", "red"), f": {full}")
    log = ""
    if result.cause is not None and result.cause.rank is not None:
        files = paths.local_rank_logs(result.cause.rank)
        log = f"; its logs: {files[-1].parent}" if files else ""
    return note(("run failed", "red"), f": {result.reason}{log or f'; logs under {paths.logs}'} "
                f"(console copy in {paths.launcher_log})")


def env_words(env: dict[str, str]) -> str:
    """The variables a launch sets, as shell words (what a person would type before the command)."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())


def lock_holds(paths: RunPaths) -> tuple[bool, str | None, list[int]]:
    """(whether the run lock's launcher, torchrun or a rank still runs, why, their pids)."""
    held = runlock.read_lock(paths.lock)
    if held is None:
        return False, None, []
    v = runlock.verdict(held.owner, held.age_s, runlock.Here.now())
    pids = [held.owner.pid, *(p for p, _ in held.owner.children)] if held.owner else []
    return v.live, v.why, pids


# --- the backend ----------------------------------------------------------------------------------------

class LocalBackend(Backend[LocalLaunch, LocalLaunch]):
    """torchrun --standalone on this machine: `launch` and `resume` run in the foreground to the end."""

    name = NAME

    def prepare(self, spec: RunSpec, run_dir: Path | None, *, grace_s: int = DEFAULT_GRACE_S,
                module: str = TRAINER_MODULE, dry_run: bool = False) -> LocalLaunch:
        # no time limit here: grace_s has nothing to warn of; the ranks run here, so a dry run checks it all
        return plan_local(spec, run_dir, module=module)

    def dry_run(self, launch: LocalLaunch) -> list[Line]:
        return [note(f"run dir (not created): {launch.run_dir}"),
                verbatim(f"{env_words(launch.env)} {shlex.join(launch.command)}")]

    def start(self, launch: LocalLaunch, say: Say, *, verbose: bool = False) -> int:
        # the stop handlers come first: a SIGTERM while the run directory is made stops the run before its first
        # step (exit 75), where the default action would kill the launcher with a half-made directory (143)
        stopper = self._stopper(launch)
        with handling_stops(stopper, to_the_end=launch.module == TRAINER_MODULE):
            self.create(launch)
            return self._run_created(launch, say, verbose, stopper)

    def create(self, launch: LocalLaunch) -> RunPaths:
        return create(launch)

    def start_created(self, launch: LocalLaunch, say: Say, *, verbose: bool = False) -> int:
        stopper = self._stopper(launch)
        with handling_stops(stopper, to_the_end=launch.module == TRAINER_MODULE):
            return self._run_created(launch, say, verbose, stopper)

    @staticmethod
    def _stopper(launch: LocalLaunch) -> Stopper:
        return Stopper(RunPaths(launch.run_dir.resolve()), terminal_say(), trainer=launch.module == TRAINER_MODULE)

    def _run_created(self, launch: LocalLaunch, say: Say, verbose: bool, stopper: Stopper) -> int:
        paths = RunPaths(launch.run_dir.resolve())  # as create_run_dir made it
        say(note(("run dir", "bold"), f" {paths.root}"))
        say(note((f"{launch.nproc} ranks, {env_words(launch.env)}; per-rank logs in {paths.logs}", "dim")))
        return self._attempt(launch, paths, "launch", say, verbose, stopper)

    def _attempt(self, launch: LocalLaunch, paths: RunPaths, kind: str, say: Say, verbose: bool,
                 stopper: Stopper) -> int:
        """Hold the run lock, run torchrun to the end, print the one last line; the exit code."""
        result = run(launch, paths, stopper, kind=kind, verbose=verbose,
                     lock_note=lambda s: say(note(("note", "yellow"), f" {s}")))
        say(end_line(paths, result, trainer=launch.module == TRAINER_MODULE))
        return result.exit_code

    def require_not_active(self, paths: RunPaths) -> None:
        runlock.check_free(paths.root)  # its launcher (or torchrun) still runs: exit 2 naming it

    def prepare_resume(self, spec: RunSpec, paths: RunPaths) -> LocalLaunch:
        return plan_local(spec, paths.root, existing=True)

    def resume_details(self, relaunch: LocalLaunch) -> dict[str, Any]:
        return {"command": relaunch.command, "env": relaunch.env}

    def resume_dry_run(self, relaunch: LocalLaunch) -> list[Line]:
        return [verbatim(f"{env_words(relaunch.env)} {shlex.join(relaunch.command)}")]

    def resume(self, relaunch: LocalLaunch, say: Say, *, verbose: bool = False) -> int:
        paths = RunPaths(relaunch.run_dir)
        trainer = relaunch.module == TRAINER_MODULE
        with handling_stops(stopper := Stopper(paths, terminal_say(), trainer=trainer), to_the_end=trainer):
            return self._attempt(relaunch, paths, "resume", say, verbose, stopper)

    def job_state(self, paths: RunPaths, job: dict[str, Any], events: list[dict[str, Any]]) -> JobState:
        live, why, _ = lock_holds(paths)
        return JobState("RUNNING" if live else "ENDED", why, attempts=len(job.get("attempts") or []), active=live)

    def log_files(self, paths: RunPaths, job: dict[str, Any], rank: int | None) -> LogFiles:
        if rank is None:
            return LogFiles([paths.launcher_log])
        files = paths.local_rank_logs(rank)
        if not files:
            raise no_rank_logs(paths, rank, "the run may not have started yet")
        return LogFiles(files)

    def cancel(self, paths: RunPaths, job: dict[str, Any], *, force: bool = False) -> str:
        # As Ctrl-C would: the launcher asks every rank to save after its step and stop; with force (the request
        # recorded says so: Stopper) it kills them. A launcher that is gone (killed) left ranks that stop by
        # themselves; they are signalled directly.
        held = runlock.read_lock(paths.lock)
        if held is None or held.owner is None:
            raise RunError(f"{paths.root}: no live launcher recorded in {paths.lock.name}")
        if signal_all([held.owner.pid], signal.SIGTERM):
            if force:
                return f"asked the local launcher (pid {held.owner.pid}) to kill torchrun and every rank now"
            return (f"asked the local launcher (pid {held.owner.pid}) to stop: every rank saves a checkpoint after "
                    "its current step")
        # torchrun is the first child recorded, then its ranks: those still running with their recorded start
        # (never a recycled pid)
        left = [p for p, start in held.owner.children[1:] if runlock.proc_start(p) == start]
        if force:
            signal_all(left, signal.SIGKILL)
            return f"the launcher is gone; killed its {len(left)} ranks"
        signal_all(left, signal.SIGTERM)
        return f"the launcher is gone; asked its {len(left)} ranks to save and stop"


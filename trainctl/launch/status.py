"""What `trainctl status` and `runs` show of a run directory. No torch.

The state is the run-state model's (rundir/runstate.py: PENDING, STARTING, RUNNING, STOPPING, STOPPED,
CANCELLED, COMPLETED, FAILED, DIVERGED), the same for every backend; Slurm's own word for the job is shown
beside it. Progress (name, steps, loss, MFU, trainer starts) is read from the run directory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainctl.checkpoint.location import committed_step
from trainctl.errors import UsageError
from trainctl.launch.backend import backend_for
from trainctl.launch.diskspace import run_dir_full
from trainctl.rundir.paths import RunPaths, last_jsonl, read_jsonl, read_yaml
from trainctl.rundir.runstate import (
    CANCELLED,
    COMPLETED,
    FAILED,
    PENDING,
    RUNNING,
    STARTING,
    STOPPED,
    STOPPING,
    Outcome,
    RunState,
    attempt_begin,
    failed_unasked,
    live_outcome,
    outcome,
    read_events,
    since,
    stop_requested,
)

if TYPE_CHECKING:
    from trainctl.launch.repair import DamagedJob


def run_state(paths: RunPaths, job: dict[str, Any]) -> RunState:
    """The run's state now (asks the backend: Slurm's job state, or whether the local launcher lives)."""
    backend = backend_for(job)
    events = read_events(paths)
    js = backend.job_state(paths, job, events)
    current = since(events, attempt_begin(events))
    attempts = job.get("attempts") or []
    ended = outcome(current)
    base = dict(backend=backend.name, job_state=js.state if backend.name != "local" else None,
                attempts=js.attempts, nodes=js.nodes, eligible_at=js.eligible_at)
    if js.active:
        if js.pending:
            return RunState(PENDING, js.reason, True, **base)
        if (failed := failed_unasked(current)) is not None:
            # torchrun restarts the workers from the newest checkpoint, or, with no restart left, the job ends
            left = restarts_left(paths, current)
            if left > 0:
                return RunState(STARTING, f"{failed.reason}; torchrun restarts the workers from the newest "
                                f"checkpoint ({left} restart{'s' if left != 1 else ''} left, launcher.max_restarts)",
                                True, outcome=failed, **base)
            return RunState(STOPPING, f"{failed.reason}; no restart left (launcher.max_restarts): the job is "
                            "ending", True, outcome=failed, **base)
        live = live_outcome(current)
        if stop_requested(current) is not None or (live is not None and live.state != COMPLETED):
            return RunState(STOPPING, "the ranks save a checkpoint after their current step, then exit", True,
                            outcome=live, **base)
        if any(e.get("event") == "start" for e in current):
            return RunState(RUNNING, js.reason if backend.name != "local" else None, True, **base)
        return RunState(STARTING, "the job runs; the trainer has not started training yet", True, **base)
    if ended is not None:
        if ended.state == STOPPED and js.state_hint == CANCELLED:  # scancel'ed by hand: the ranks saw a SIGTERM
            ended = Outcome(CANCELLED, ended.step, ended.reason.replace("stopped", "cancelled", 1))
        return RunState(ended.state, ended.reason, False, outcome=ended, **base)
    if js.state_hint is not None:  # the backend knows how it ended (Slurm: CANCELLED, TIMEOUT, NODE_FAIL...)
        return RunState(js.state_hint, js.reason, False, **base)
    if not attempts and not current:
        return RunState(PENDING, "not started", False, **base)
    return RunState(FAILED, js.reason or run_dir_full(paths) or "the launcher is gone without a record of how the "
                    "run ended (killed?); `trainctl resume` continues from the newest valid checkpoint", False, **base)


@dataclass
class RunStatus:
    run_dir: str
    name: str
    backend: str
    state: str  # rundir/runstate.py
    job_id: str | None
    reason: str | None
    job_state: str | None  # the backend's own word (Slurm's JobState), when it has one
    eligible_at: str | None  # a pending requeue: when Slurm lets it start
    steps_done: int  # the last step the ranks finished (metrics.jsonl), committed or not
    steps_total: int | None
    attempts: int  # Slurm attempts (1 + requeues) or local launches
    starts: int  # trainer starts (torchrun restarts included)
    last_loss: float | None
    last_mfu: float | None
    nodes: str | None
    excluded_nodes: dict[str, str] = field(default_factory=dict)  # node -> why later jobs keep out of it
    steps_committed: int = 0  # the newest valid checkpoint's step: where a resume starts
    active: bool = field(default=False, repr=False)  # the backend's word; not part of `status --json`

    @property
    def steps_lost(self) -> int:
        """Steps run past the newest checkpoint of a run that ended without saving them (a kill, `cancel
        --force`, a second Ctrl-C, a crash): a resume runs them again. 0 while the run lives (its next save
        keeps them) and once it completed."""
        if self.active or self.state == COMPLETED:
            return 0
        return max(0, self.steps_done - self.steps_committed)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["active"]
        out["steps_lost"] = self.steps_lost
        return out



def is_run_dir(paths: RunPaths) -> bool:
    """A run directory: its job.json, or (job.json lost) its frozen spec and its events."""
    return paths.job.is_file() or (paths.spec.is_file() and paths.events.is_file())


def open_run(path: Path) -> RunPaths:
    paths = RunPaths(path.absolute())
    if not path.is_dir():
        raise UsageError(f"{path}: no such run directory", hint="give the directory `trainctl launch` created")
    if not is_run_dir(paths):
        raise UsageError(f"{path} is not a run directory (no {paths.job.name})",
                         hint="give the directory `trainctl launch` printed (e.g. runs/<name>-<time>)")
    return paths


def read_job_json(paths: RunPaths) -> dict[str, Any]:
    """The run's job record; DamagedJob (exit 2: what is intact, how to repair) when it does not parse."""
    from trainctl.launch.repair import DamagedJob, job_problem

    try:
        text = paths.job.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise DamagedJob(paths, "missing") from None
    except OSError as e:
        raise UsageError(f"{paths.job}: unreadable ({e.strerror})") from e
    job, problem = job_problem(text)
    if job is None:
        raise DamagedJob(paths, problem or "unreadable")
    return job


def spec_steps(paths: RunPaths) -> tuple[str | None, int | None]:
    """(name, train.steps) from the frozen spec."""
    data = read_yaml(paths.spec) or {}
    steps = (data.get("train") or {}).get("steps")
    return data.get("name"), steps if isinstance(steps, int) else None


def restarts_left(paths: RunPaths, attempt: list[dict[str, Any]]) -> int:
    """How many more times torchrun restarts the workers in this attempt: launcher.max_restarts of the frozen
    spec less the restarts its trainer starts recorded (0 when the spec cannot be read, and under srun, which
    starts each rank itself and restarts none)."""
    launcher = (read_yaml(paths.spec) or {}).get("launcher") or {}
    if launcher.get("mode") == "srun":
        return 0
    limit = launcher.get("max_restarts", 0)
    used = max((int(e.get("torchrun_restart") or 0) for e in attempt if e.get("event") == "start"), default=0)
    return max(0, limit - used) if isinstance(limit, int) else 0


def spec_world_size(paths: RunPaths) -> int | None:
    """The run's number of ranks, from its frozen spec (None when it cannot be read)."""
    from trainctl.errors import SpecError
    from trainctl.spec import load_spec

    try:
        return load_spec(paths.spec).world_size
    except (SpecError, OSError):
        return None


def _progress(paths: RunPaths) -> dict[str, Any]:
    """The RunStatus fields the run directory's own files give (spec, metrics, events, checkpoints), whatever
    job.json says."""
    name, total = spec_steps(paths)
    last = last_jsonl(paths.metrics) or {}
    return dict(run_dir=str(paths.root), name=name or paths.root.name, steps_done=int(last.get("step", 0) or 0),
                steps_committed=committed_step(paths.root),
                steps_total=total, starts=sum(1 for e in read_jsonl(paths.events) if e.get("event") == "start"),
                last_loss=last.get("loss"), last_mfu=last.get("mfu"))


def run_status(path: Path) -> RunStatus:
    from trainctl.launch import exclusions

    paths = open_run(path)
    job = read_job_json(paths)
    job_id = job.get("job_id")
    st = run_state(paths, job)
    return RunStatus(**_progress(paths), backend=st.backend, state=st.state,
                     job_id=str(job_id) if job_id is not None else None, reason=st.reason, job_state=st.job_state,
                     eligible_at=st.eligible_at, attempts=st.attempts, nodes=st.nodes, active=st.active,
                     excluded_nodes={n: str(v.get("reason")) for n, v in exclusions.read(paths).items()})


def damaged_status(path: Path, error: DamagedJob) -> RunStatus:
    """What `runs` lists of a run whose job.json is damaged: DAMAGED, with what the other files still say."""
    from trainctl.launch.repair import DAMAGED, recorded_backend

    paths = RunPaths(path.absolute())
    return RunStatus(**_progress(paths), backend=recorded_backend(read_jsonl(paths.events)) or "?", state=DAMAGED,
                     job_id=None,
                     reason=error.message, job_state=None, eligible_at=None, attempts=0, nodes=None)


def find_runs(base: Path) -> list[Path]:
    """Run directories directly under `base` (or `base` itself), newest first."""
    if is_run_dir(RunPaths(base)):
        return [base]
    if not base.is_dir():
        return []
    runs = [p for p in base.iterdir() if p.is_dir() and is_run_dir(RunPaths(p))]
    return sorted(runs, key=lambda p: p.stat().st_mtime, reverse=True)

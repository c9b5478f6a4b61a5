"""The launch backend interface: how a run is started, watched, cancelled and resubmitted. No torch.

Modelled on submitit's split of a core from its executors: the CLI commands (`launch`, `resume`, `status`,
`logs`, `cancel`, `runs`) talk to a `Backend` only, and each backend owns everything about its way of
running a job. `backend_for` picks one for a spec or a run directory; a new backend is one module with a
`Backend` subclass plus one line in `BACKENDS`.

Backends say what they do in `Line`s (words and style names, no rich here): the CLI renders them, so a
backend's messages reach the terminal at the moment they happen (a local run streams for hours between
"run dir ..." and "done").
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from trainctl.errors import UsageError
from trainctl.rundir.paths import RunPaths
from trainctl.spec.models import DEFAULT_GRACE_S

if TYPE_CHECKING:
    from trainctl.spec import RunSpec

TRAINER_MODULE = "trainctl.runtime"  # what every rank runs: python -m trainctl.runtime RUN_DIR
CALIBRATE_MODULE = "trainctl.runtime.workers.calibrate"  # what every rank runs for `trainctl calibrate`
PREFLIGHT_MODULE = "trainctl.runtime.workers.preflight"  # what every rank runs for `trainctl preflight`

# name -> "module:class"; imported on first use, so `trainctl launch` never loads a backend it does not use
BACKENDS: dict[str, str] = {
    "local": "trainctl.launch.local:LocalBackend",
    "slurm": "trainctl.launch.slurm.backend:SlurmBackend",
}
DEFAULT_BACKEND = "local"  # a job.json without "backend" (never written by trainctl) was a local run


@dataclass(frozen=True)
class Line:
    """One line for the person at the terminal: `parts` are plain text or (text, rich style name) pairs,
    joined as they are. `verbatim` lines (a command, a script) go to stdout exactly, for copy-paste."""

    parts: tuple[str | tuple[str, str], ...]
    verbatim: bool = False

    @property
    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p[0] for p in self.parts)


def note(*parts: str | tuple[str, str]) -> Line:
    return Line(parts)


def verbatim(text: str) -> Line:
    return Line((text,), verbatim=True)


Say = Callable[[Line], None]


@dataclass(frozen=True)
class JobState:
    """What `trainctl status` shows of a run's job. `state` is in Slurm's words for every backend
    (trainctl/launch/slurm/job_state.py owns them and which of them are still active)."""

    state: str
    reason: str | None
    attempts: int  # Slurm: 1 + requeues, over every job of the run; local: launches
    active: bool  # queued or running: `cancel` has something to stop, `logs -f` keeps following
    nodes: str | None = None
    pending: bool = False  # queued, not running yet (Slurm PENDING, a requeued job waiting)
    eligible_at: str | None = None  # a pending job held until a time (Slurm's BeginTime after a requeue)
    state_hint: str | None = None  # a run state only the backend knows (rundir/runstate.py): an ended job
    #                                with no trainer record of how (Slurm: CANCELLED before start, TIMEOUT...)


@dataclass(frozen=True)
class LogFiles:
    """Files to print for `trainctl logs`, oldest first; with `prefix`, only lines starting with it (the
    prefix removed)."""

    files: list[Path]
    prefix: str | None = None


def no_rank_logs(paths: RunPaths, rank: int, hint: str) -> UsageError:
    return UsageError(f"no log files for rank {rank} under {paths.logs}", hint=hint)


L = TypeVar("L")  # a backend's prepared launch (everything it will do, rendered before anything runs)
R = TypeVar("R")  # a backend's prepared relaunch of an existing run directory


class Backend(ABC, Generic[L, R]):
    """One way of running the trainer on every rank: local torchrun, Slurm, ..."""

    name: str

    # --- trainctl launch ---------------------------------------------------------------------------------
    @abstractmethod
    def prepare(self, spec: RunSpec, run_dir: Path | None, *, grace_s: int = DEFAULT_GRACE_S,
                module: str = TRAINER_MODULE, dry_run: bool = False) -> L:
        """Check what can be checked before anything exists (UsageError, exit 2) and render the launch.
        `grace_s`: warning before a time limit, for backends that have one. `module`: what every rank runs
        (`python -m MODULE RUN_DIR`): the trainer, or the calibration worker. `dry_run`: only printed, so a
        backend whose ranks run elsewhere warns about what it cannot check here instead of refusing."""

    @abstractmethod
    def dry_run(self, launch: L) -> list[Line]:
        """What `trainctl launch --dry-run` prints: the run directory it would create and what would run."""

    @abstractmethod
    def start(self, launch: L, say: Say, *, verbose: bool = False) -> int:
        """Create the run directory and start: run to the end here, or submit and return; the exit code
        (runstate.EXIT_CODE of how it ended, or 0 once submitted). `verbose`: show every rank's and the
        launcher's raw output as it comes, where this backend shows output at all."""

    # --- trainctl sweep: its runs are created first, then started (locally) or submitted as one array -----
    @abstractmethod
    def create(self, launch: L) -> RunPaths:
        """Create the run directory of a prepared launch without starting it."""

    def start_created(self, launch: L, say: Say, *, verbose: bool = False) -> int:
        """Start a launch whose run directory `create` made; the exit code as `start` gives it."""
        raise UsageError(f"the {self.name} backend starts a sweep's runs together, not one by one")

    # --- trainctl resume ---------------------------------------------------------------------------------
    @abstractmethod
    def require_not_active(self, paths: RunPaths) -> None:
        """Refuse (UsageError) while a job of this run may still be training into its directory."""

    @abstractmethod
    def prepare_resume(self, spec: RunSpec, paths: RunPaths) -> R:
        """Check and render the relaunch of an existing run directory with its (possibly changed) spec."""

    @abstractmethod
    def resume_details(self, relaunch: R) -> dict[str, Any]:
        """Extra fields for `trainctl resume --json` (e.g. the command that will run)."""

    @abstractmethod
    def resume_dry_run(self, relaunch: R) -> list[Line]:
        """What `trainctl resume --dry-run` prints after the checkpoint it would resume from."""

    @abstractmethod
    def resume(self, relaunch: R, say: Say, *, verbose: bool = False) -> int:
        """Start the run directory again (it resumes from its newest valid checkpoint); the exit code."""

    # --- trainctl status / runs / logs / cancel ----------------------------------------------------------
    @abstractmethod
    def job_state(self, paths: RunPaths, job: dict[str, Any], events: list[dict[str, Any]]) -> JobState:
        """The state of the run's job, from the backend (Slurm) or the run directory (job.json, events)."""

    @abstractmethod
    def log_files(self, paths: RunPaths, job: dict[str, Any], rank: int | None) -> LogFiles:
        """The run's console output (rank None) or one global rank's output; UsageError when a rank has none."""

    @abstractmethod
    def cancel(self, paths: RunPaths, job: dict[str, Any], *, force: bool = False) -> str:
        """Stop an active run the way its backend does (the ranks save after their current step; `force`: kill
        every process at once, losing the steps since the newest committed checkpoint); what was done, in
        one line."""


def backend_for(source: RunSpec | Mapping[str, Any] | str) -> Backend[Any, Any]:
    """The backend of a spec (its resolved launcher.backend), of a run directory (the job record read from
    its job.json), or by name."""
    if isinstance(source, str):
        name = source
    elif isinstance(source, Mapping):
        name = str(source.get("backend") or DEFAULT_BACKEND)
    else:
        name = source.backend
    where = BACKENDS.get(name)
    if where is None:
        raise UsageError(f"unknown launch backend {name!r}", hint=f"known backends: {', '.join(BACKENDS)}")
    module, _, cls = where.partition(":")
    backend: Backend[Any, Any] = getattr(importlib.import_module(module), cls)()
    return backend

"""Which run a checkpoint directory belongs to: its owner record, `DIR/.trainctl-owner.json`. No torch.

A checkpoint directory belongs to one run. `trainctl launch` creates it (or takes an empty one) and records the
run's id (job.json "run_id"), its run directory and the checkpoint directory's own path there. Another run
neither writes nor prunes there (retention would delete the owner's steps):

- a fresh launch refuses a checkpoint directory that is not empty (`new_run_problem`): a new run starts from its
  own initialisation (or `model.init_from`), never from another run's newest step;
- `trainctl resume` (`for_resume`) refuses a directory owned by another run id, or by the same id in another,
  still existing run directory (a run directory copied with `cp -a` whose absolute checkpoint.dir points at the
  original's). A directory that was itself copied or moved (the record names another path) is no run's live
  directory, and a run directory that was moved (the recorded one is gone) keeps its own: the record is
  rewritten for the run that resumes;
- every rank checks the record again at its start (`problem`), which covers Slurm requeues and torchrun
  restarts that no `trainctl` command saw.

A directory without a record (written before records existed) is adopted by the first resume of a run whose
records match: the directory is inside the run directory, or the run's events.jsonl names a checkpoint it
committed there. Removing the record hands the directory over deliberately.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainctl.checkpoint.format import OWNER, list_checkpoints
from trainctl.errors import UsageError
from trainctl.fileio import write_atomic
from trainctl.rundir.paths import RunPaths


def new_run_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Owner:
    run_id: str
    run_dir: str
    dir: str  # the checkpoint directory's own path when the record was written (a copy of it names another)

    def to_json(self) -> dict[str, str]:
        return {"run_id": self.run_id, "run_dir": self.run_dir, "dir": self.dir}


def owner_path(ckdir: Path) -> Path:
    return Path(ckdir) / OWNER


def read_owner(ckdir: Path) -> Owner | None:
    """The record (None without one); UsageError when it is damaged: whose the directory is is then unknown."""
    path = owner_path(ckdir)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Owner(run_id=str(data["run_id"]), run_dir=str(data["run_dir"]), dir=str(data["dir"]))
    except (FileNotFoundError, NotADirectoryError):  # no record (or no directory at all: the ranks say so)
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path} is damaged ({type(e).__name__}): which run this checkpoint directory belongs to "
                         "is unknown", hint=f"if it is this run's, remove {path} and run the command again") from None


def write_owner(ckdir: Path, run_id: str, run_dir: Path) -> None:
    """Record `run_id` (of `run_dir`) as the owner of `ckdir` (made here, with its parents: the CLI, not a rank)."""
    ckdir = Path(ckdir)
    ckdir.mkdir(parents=True, exist_ok=True)
    owner = Owner(run_id=run_id, run_dir=os.path.abspath(run_dir), dir=os.path.abspath(ckdir))
    write_atomic(owner_path(ckdir), json.dumps(owner.to_json(), indent=1) + "\n", fsync=True)


def _same(a: str | Path, b: str | Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _entries(ckdir: Path) -> list[str]:
    try:
        return sorted(os.listdir(ckdir))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _steps_word(ckdir: Path) -> str:
    steps = [i.step for i in list_checkpoints(ckdir) if i.valid]
    return f"checkpoints of step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}" if steps else "files"


def new_run_problem(ckdir: Path) -> UsageError | None:
    """A fresh launch's checkpoint directory must be missing or empty: refuse (one line, the fixes) one that holds
    anything, another run's checkpoints above all (the launch would start from them, or retention prune them)."""
    if not _entries(ckdir):
        return None
    owner = None
    with contextlib.suppress(UsageError):  # a damaged record: whose is unknown, the directory is not empty all the same
        owner = read_owner(ckdir)
    whose = f"run {owner.run_dir}" if owner is not None else "another run"
    go_on = f"; to continue that run: trainctl resume {owner.run_dir}" if owner is not None else ""
    return UsageError(f"checkpoint directory {ckdir} is not empty: it holds {_steps_word(ckdir)} of {whose}, and a new "
                      "run starts from its own initialisation, never from another run's checkpoints",
                      hint=f"give this run an empty one with --set checkpoint.dir=NEW{go_on}; to start from its "
                           "weights, set model.init_from to that run directory")


@dataclass(frozen=True)
class Claim:
    """What `trainctl resume` records before it starts the run (`apply`): the run's id, and the owner record
    of its checkpoint directory (None: it is already right)."""

    run_id: str
    write: bool
    note: str | None = None  # said once, when the directory is adopted

    def apply(self, ckdir: Path, run_dir: Path) -> None:
        if self.write:
            write_owner(ckdir, self.run_id, run_dir)


def for_resume(ckdir: Path, run_dir: Path, job: dict[str, Any], events: list[dict[str, Any]]) -> Claim:
    """Whether the run in `run_dir` (job.json `job`, its events) may write and prune `ckdir`; UsageError (one line:
    whose it is, and the fixes) when another run owns it. Changes nothing (Claim.apply does)."""
    owner = read_owner(ckdir)
    recorded = job.get("run_id")
    if not isinstance(recorded, str) or not recorded:
        # launched before run ids existed, or a job.json rebuilt by --repair: the record of this very run
        # directory gives it back; else a new one
        recorded = owner.run_id if owner is not None and _same(owner.run_dir, run_dir) else new_run_id()
    if owner is None:
        if not _entries(ckdir) or _inside(ckdir, run_dir) or _committed_there(ckdir, events):
            return Claim(recorded, write=True)
        raise UsageError(f"checkpoint directory {ckdir} holds {_steps_word(ckdir)} that this run never wrote there "
                         f"(its {Path(run_dir).name}/events.jsonl names none), and no owner record: resuming would "
                         "write and prune another run's checkpoints",
                         hint=f"give this run its own with trainctl resume {run_dir} --set checkpoint.dir=NEW")
    if not _same(owner.dir, ckdir):  # the directory itself was copied or moved here: no run's live one
        return Claim(recorded, write=True)
    if owner.run_id != recorded:
        raise UsageError(f"checkpoint directory {ckdir} belongs to another run, {owner.run_dir} (its owner record "
                         f"{OWNER}): resuming would write and prune that run's checkpoints",
                         hint=f"give this run its own with trainctl resume {run_dir} --set checkpoint.dir=NEW; to "
                              f"hand it to this run deliberately, remove {owner_path(ckdir)} once that run no "
                              "longer uses it")
    if _same(owner.run_dir, run_dir):
        return Claim(recorded, write=False)
    if _is_run(owner.run_dir, recorded):
        raise UsageError(f"checkpoint directory {ckdir} belongs to run {owner.run_dir}, of which {run_dir} is a copy: "
                         "resuming the copy would write and prune the original's checkpoints",
                         hint=f"give the copy its own: cp -a {ckdir} NEW, then trainctl resume {run_dir} --set "
                              f"checkpoint.dir=NEW (without the copy it starts from step 0); to hand it to the copy "
                              f"deliberately, remove {owner_path(ckdir)}")
    return Claim(recorded, write=True, note=f"checkpoint directory {ckdir} was run {owner.run_dir}'s, which is gone "
                                            "(moved here): it is this run's from now on")


def problem(ckdir: Path, run_dir: Path, job: dict[str, Any]) -> str | None:
    """A rank's check at its start: why this run must not write into `ckdir`, or None. Only a record that names
    another run counts: ranks started without a launcher (no run id) and directories without a record pass
    (`trainctl resume` adopts those)."""
    run_id = job.get("run_id")
    try:
        owner = read_owner(ckdir)
    except UsageError as e:
        return e.message
    if owner is None or not isinstance(run_id, str):
        return None
    if owner.run_id != run_id or (_same(owner.dir, ckdir) and not _same(owner.run_dir, run_dir)):
        return (f"checkpoint directory {ckdir} belongs to run {owner.run_dir} (its owner record {OWNER}), not to "
                f"{run_dir}: this run neither writes nor prunes there; `trainctl resume {run_dir}` says how to go on")
    return None


def _inside(ckdir: Path, run_dir: Path) -> bool:
    a, b = os.path.realpath(ckdir), os.path.realpath(run_dir)
    return a == b or a.startswith(b.rstrip("/") + "/")


def _committed_there(ckdir: Path, events: list[dict[str, Any]]) -> bool:
    where = os.path.realpath(ckdir)
    return any(e.get("event") == "checkpoint_committed" and isinstance(e.get("path"), str)
               and os.path.realpath(os.path.dirname(e["path"])) == where for e in events)


def _is_run(run_dir: str, run_id: str) -> bool:
    """Whether `run_dir` still holds the run `run_id` (its job.json says so)."""
    try:
        job = json.loads(RunPaths(Path(run_dir)).job.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(job, dict) and job.get("run_id") == run_id

"""`trainctl export RUN --format hf OUT`: what is checked before torch is imported, then the export itself.

Everything a user can get wrong is found here without torch, each as one line, exit 2: the run directory, the
format, OUT (new or empty), the checkpoint (the newest valid one or `--step N`, every file's checksum
verified), a model no transformers class matches. The export then runs in this process
(runtime/model/hf_weights.py imports torch lazily): one process reads the whole model, fp32, from the checkpoint's
DCP shards, whatever layout wrote them (docs/design/checkpoints.md, "Hugging Face weights").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainctl.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    find_step,
    latest_valid,
    resolve_checkpoint_dir,
)
from trainctl.errors import UsageError
from trainctl.fileio import require_writable
from trainctl.hf import format as hf_format
from trainctl.model_shape import ModelShape
from trainctl.rundir.paths import RunPaths
from trainctl.spec.models import ModelSpec

FORMATS = ("hf",)


@dataclass(frozen=True)
class ExportPlan:
    checkpoint: CheckpointInfo
    shape: ModelShape
    architecture: str
    out: Path


def plan_export(run: Path, step: int | None, fmt: str, out: Path) -> ExportPlan:
    """Every check that needs no torch; UsageError (exit 2) naming what to fix."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt}: unsupported export format", hint=f"formats: {', '.join(FORMATS)}")
    paths = RunPaths(run)
    if not run.is_dir():
        raise UsageError(f"{run}: no such run directory", hint="give the directory `trainctl launch` created")
    if not paths.spec.is_file():
        raise UsageError(f"{run}: not a run directory (no {paths.spec.name})",
                         hint="give the directory `trainctl launch` created")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out}: exists and is not an empty directory", hint="give a new (or empty) directory")
    require_writable(out.absolute().parent, f"OUT {out}")  # the model is written beside it, then renamed into place
    directory = resolve_checkpoint_dir(run)
    info = _checkpoint(run, directory, step)
    saved = (info.meta or {}).get("model")
    if not saved:
        raise UsageError(f"{info.path}: no model record in its manifest (not written by the trainctl trainer)")
    shape = ModelShape.from_spec(ModelSpec.model_validate(saved))
    lay = hf_format.ARCHITECTURES[hf_format.family(shape)]  # UsageError: no transformers class matches
    return ExportPlan(info, shape, lay, out)


def _checkpoint(run: Path, directory: Path, step: int | None) -> CheckpointInfo:
    """The checkpoint to export, its checksums verified: `step`, or the newest valid one."""
    try:
        if step is not None:
            return find_step(directory, step, deep=True)
    except CheckpointError as e:
        raise UsageError(e.message, hint=e.hint or "trainctl checkpoints RUN --deep lists the valid ones") from e
    skipped: list[CheckpointInfo] = []
    info = latest_valid(directory, deep=True, skipped=skipped)
    if info is not None:
        return info
    if skipped:
        raise UsageError(f"{directory}: no valid checkpoint (newest, step {skipped[0].step}: {skipped[0].reason})",
                         hint="trainctl checkpoints RUN --deep lists them")
    raise UsageError(f"{directory}: no checkpoint to export", hint=_why_none(run))


def _why_none(run: Path) -> str:
    """Why a run has no checkpoint, from its frozen schedule, the steps it ran and whether its latest attempt
    ended (its events): it saves none, or it has not reached (or stopped before) its first save."""
    from trainctl.rundir.paths import last_jsonl, read_jsonl, read_yaml
    from trainctl.rundir.runstate import attempt_begin, outcome, since

    paths = RunPaths(run)
    schedule = (read_yaml(paths.spec) or {}).get("checkpoint") or {}
    every_steps, every_minutes = schedule.get("every_steps"), schedule.get("every_minutes")
    if not every_steps and not every_minutes:
        return "the run saves none: set checkpoint.every_steps (a run also saves after its last step when it is set)"
    first = " or ".join(([f"step {every_steps} (checkpoint.every_steps)"] if every_steps else [])
                        + ([f"{every_minutes:g} minutes in (checkpoint.every_minutes)"] if every_minutes else []))
    reached = int((last_jsonl(paths.metrics) or {}).get("step", 0) or 0)
    events = sorted(read_jsonl(paths.events), key=lambda e: float(e.get("time", 0.0)))
    if outcome(since(events, attempt_begin(events))) is None:  # no end recorded: it trains still (or was killed)
        return (f"none saved yet: the run is at step {reached}, and its first save comes at {first}; export after "
                f"it (a run that is gone: `trainctl resume {run}` runs it on to a save)")
    when = "before its first step" if reached == 0 else f"at step {reached}"
    return (f"none was saved: the run stopped {when}, before its first save at {first}. Fix: `trainctl resume "
            f"{run}` runs it on to a save (a stop after a step also saves)")


def run_export(plan: ExportPlan) -> list[str]:
    """The export (imports torch); the files written into plan.out."""
    from trainctl.runtime.model.hf_weights import export_hf

    return export_hf(plan.checkpoint.path, plan.shape, plan.out)

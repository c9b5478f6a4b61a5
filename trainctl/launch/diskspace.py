"""Checkpoint disk space around a launch: the check before training, the line after a full disk. No torch.

Before training, `launch` and `resume` compare the free space of the checkpoint directory with what the run
will hold at its peak: keep_last committed checkpoints plus the one being written (retention deletes the
oldest only after the new one commits), each of the planner's size (trainctl.plan.checkpoint_size). What
valid checkpoints of the run already hold counts as theirs (a resume), up to keep_last of them. Short: a
warning, or under `--strict` a refusal (exit 2). docs/design/checkpoints.md, "Disk space".
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainctl.checkpoint import list_checkpoints, resolve_checkpoint_dir
from trainctl.checkpoint.space import DISK_FULL_EVENT, existing_ancestor, free_bytes, human_bytes
from trainctl.rundir.paths import RunPaths, read_jsonl

if TYPE_CHECKING:
    from trainctl.spec import RunSpec

RUN_STARTS = ("launch", "resume")  # events a launcher records when it starts an attempt


def space_problem(spec: RunSpec, run_dir: Path) -> str | None:
    """Why the checkpoint directory of `spec`'s run in `run_dir` is too small, in one line; None when it
    has room (or the run saves no checkpoints)."""
    ck = spec.checkpoint
    if not (ck.every_steps or ck.every_minutes):
        return None
    from trainctl.plan.checkpoint_size import checkpoint_bytes

    ckdir = resolve_checkpoint_dir(run_dir, spec)
    size = checkpoint_bytes(spec)
    peak = (ck.keep_last + 1) * size
    held = sorted((i for i in list_checkpoints(ckdir) if i.valid), key=lambda i: i.step)[-ck.keep_last:] \
        if ckdir.is_dir() else []
    already = sum(i.size_bytes for i in held)
    needed = max(size, peak - already)
    free = free_bytes(ckdir)
    if free >= needed:
        return None
    where = ckdir if ckdir.exists() else existing_ancestor(ckdir)
    kept = f", {len(held)} already there" if held else ""
    return (f"checkpoint directory {ckdir} has {human_bytes(free)} free (on {where}) but the run needs "
            f"{human_bytes(needed)}: keep_last {ck.keep_last} + 1 checkpoints of {human_bytes(size)}{kept}; "
            "free space, set checkpoint.dir elsewhere or lower checkpoint.keep_last")


FULL_BELOW = 1 << 20  # bytes free under which a run directory's disk counts as full (a launcher's records need less)


def run_dir_full(paths: RunPaths) -> str | None:
    """Why a run whose launcher left no record of its end most likely ended: its directory's disk is full now
    (the launcher could not write its record); None when it has room, or cannot be read."""
    try:
        free = free_bytes(paths.root)
    except OSError:
        return None
    if free >= FULL_BELOW:
        return None
    return (f"the run directory's disk is full ({human_bytes(free)} free on {paths.root}): the launcher could not "
            "record how the run ended; free space, then `trainctl resume` continues from the newest valid "
            "checkpoint")


def disk_full_event(paths: RunPaths) -> dict[str, Any] | None:
    """The `disk_full` event of the run's latest attempt, if a save of that attempt ran out of space."""
    found = None
    for e in read_jsonl(paths.events):
        if e.get("event") in RUN_STARTS:
            found = None
        elif e.get("event") == DISK_FULL_EVENT:
            found = e
    return found


def disk_full_line(paths: RunPaths) -> str | None:
    e = disk_full_event(paths)
    return str(e.get("message")) if e else None

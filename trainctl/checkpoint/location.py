"""Where a run's checkpoints live: the one resolution of the checkpoint directory. No torch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainctl.rundir.paths import RunPaths, read_yaml

if TYPE_CHECKING:
    from trainctl.spec import RunSpec


def resolve_checkpoint_dir(run_dir: Path, spec: RunSpec | None = None) -> Path:
    """RUN/checkpoints unless the spec sets checkpoint.dir (a relative one is relative to the run directory).

    Without `spec` the run's frozen spec.yaml is read for checkpoint.dir alone, leniently: listing the
    checkpoints of a run must work even when its spec no longer validates.
    """
    paths = RunPaths(Path(run_dir))
    configured = spec.checkpoint.dir if spec is not None else _frozen_checkpoint_dir(paths)
    if not configured:
        return paths.checkpoints
    d = Path(configured)
    return d if d.is_absolute() else paths.root / d


def _frozen_checkpoint_dir(paths: RunPaths) -> str | None:
    checkpoint = (read_yaml(paths.spec) or {}).get("checkpoint")
    return checkpoint.get("dir") if isinstance(checkpoint, dict) else None


def committed_step(run_dir: Path) -> int:
    """The step of a run's newest valid checkpoint (shallow check), where a resume starts; 0 for none."""
    from trainctl.checkpoint.format import CheckpointError, latest_valid

    try:
        info = latest_valid(resolve_checkpoint_dir(run_dir))
    except CheckpointError:  # the directory cannot be listed: nothing known to be committed
        return 0
    return info.step if info is not None else 0

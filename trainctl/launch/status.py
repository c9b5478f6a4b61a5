"""What `trainctl status` and `runs` show of a run directory. No torch.

The state is the run-state model's (launch/runstate.py: PENDING, STARTING, RUNNING, STOPPING, STOPPED,
CANCELLED, COMPLETED, FAILED, DIVERGED), the same for every backend; Slurm's own word for the job is shown
beside it. Progress (name, steps, loss, MFU, trainer starts) is read from the run directory.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainctl.errors import UsageError
from trainctl.launch.runstate import run_state
from trainctl.rundir import RunPaths, read_jsonl

TAIL_BYTES = 64 * 1024


@dataclass
class RunStatus:
    run_dir: str
    name: str
    backend: str
    state: str  # launch/runstate.py
    job_id: str | None
    reason: str | None
    job_state: str | None  # the backend's own word (Slurm's JobState), when it has one
    eligible_at: str | None  # a pending requeue: when Slurm lets it start
    steps_done: int
    steps_total: int | None
    attempts: int  # Slurm attempts (1 + requeues) or local launches
    starts: int  # trainer starts (torchrun restarts included)
    last_loss: float | None
    last_mfu: float | None
    nodes: str | None
    excluded_nodes: dict[str, str] = field(default_factory=dict)  # node -> why later jobs keep out of it
    active: bool = field(default=False, repr=False)  # the backend's word; not part of `status --json`

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["active"]
        return out


def open_run(path: Path) -> RunPaths:
    paths = RunPaths(path.absolute())
    if not path.is_dir():
        raise UsageError(f"{path}: no such run directory", hint="give the directory `trainctl launch` created")
    if not paths.job.exists():
        raise UsageError(f"{path} is not a run directory (no {paths.job.name})",
                         hint="give the directory `trainctl launch` printed (e.g. runs/<name>-<time>)")
    return paths


def read_job_json(paths: RunPaths) -> dict[str, Any]:
    try:
        return json.loads(paths.job.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{paths.job}: unreadable ({e})") from e


def last_jsonl(path: Path) -> dict[str, Any] | None:
    """The last complete JSON line of a (possibly huge, possibly torn) JSONL file, reading only its tail."""
    if not path.exists():
        return None
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - TAIL_BYTES))
        lines = f.read().splitlines()
    for raw in reversed(lines):
        with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
            rec = json.loads(raw)
            if isinstance(rec, dict):
                return rec
    return None


def spec_steps(paths: RunPaths) -> tuple[str | None, int | None]:
    """(name, train.steps) from the frozen spec, read as plain YAML (no validation needed here)."""
    import yaml

    try:
        data = yaml.safe_load(paths.spec.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return None, None
    steps = (data.get("train") or {}).get("steps")
    return data.get("name"), steps if isinstance(steps, int) else None


def spec_world_size(paths: RunPaths) -> int | None:
    """The run's number of ranks, from its frozen spec (None when it cannot be read)."""
    from trainctl.errors import SpecError
    from trainctl.spec import load_spec

    try:
        return load_spec(paths.spec).world_size
    except (SpecError, OSError):
        return None


def run_status(path: Path) -> RunStatus:
    from trainctl.launch import exclusions

    paths = open_run(path)
    job = read_job_json(paths)
    name, total = spec_steps(paths)
    events = read_jsonl(paths.events)
    last = last_jsonl(paths.metrics) or {}
    starts = sum(1 for e in events if e.get("event") == "start")
    job_id = job.get("job_id")
    st = run_state(paths, job)
    return RunStatus(run_dir=str(paths.root), name=name or paths.root.name, backend=st.backend, state=st.state,
                     job_id=str(job_id) if job_id is not None else None, reason=st.reason, job_state=st.job_state,
                     eligible_at=st.eligible_at, steps_done=int(last.get("step", 0) or 0), steps_total=total,
                     attempts=st.attempts, starts=starts, last_loss=last.get("loss"), last_mfu=last.get("mfu"),
                     nodes=st.nodes, active=st.active,
                     excluded_nodes={n: str(v.get("reason")) for n, v in exclusions.read(paths).items()})


def find_runs(base: Path) -> list[Path]:
    """Run directories directly under `base` (or `base` itself), newest first."""
    if RunPaths(base).job.exists():
        return [base]
    if not base.is_dir():
        return []
    runs = [p for p in base.iterdir() if RunPaths(p).job.is_file()]
    return sorted(runs, key=lambda p: p.stat().st_mtime, reverse=True)

"""The state of a run directory, for `trainctl status/runs/logs/cancel`. No torch.

What is read from the run directory (name, steps, loss, MFU, trainer starts) is the same for every
backend; the job's state comes from the run's backend (`launch/backend.py`), in Slurm's words for all of
them (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, REQUEUED, PREEMPTED, TIMEOUT, ...).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainctl.errors import UsageError
from trainctl.launch.backend import backend_for
from trainctl.rundir import RunPaths, read_jsonl

TAIL_BYTES = 64 * 1024


@dataclass
class RunStatus:
    run_dir: str
    name: str
    backend: str
    state: str
    job_id: str | None
    reason: str | None
    steps_done: int
    steps_total: int | None
    attempts: int  # Slurm attempts (1 + requeues) or local launches
    starts: int  # trainer starts (torchrun restarts included)
    last_loss: float | None
    last_mfu: float | None
    nodes: str | None
    active: bool = field(default=False, repr=False)  # the backend's word; not part of `status --json`

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["active"]
        return out


def open_run(path: Path) -> RunPaths:
    paths = RunPaths(path.absolute())
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


def run_status(path: Path) -> RunStatus:
    paths = open_run(path)
    job = read_job_json(paths)
    backend = backend_for(job)
    name, total = spec_steps(paths)
    events = read_jsonl(paths.events)
    last = last_jsonl(paths.metrics) or {}
    starts = sum(1 for e in events if e.get("event") == "start")
    job_id = job.get("job_id")
    st = backend.job_state(paths, job, events)
    return RunStatus(run_dir=str(paths.root), name=name or paths.root.name, backend=backend.name, state=st.state,
                     job_id=str(job_id) if job_id is not None else None, reason=st.reason,
                     steps_done=int(last.get("step", 0) or 0), steps_total=total, attempts=st.attempts,
                     starts=starts, last_loss=last.get("loss"), last_mfu=last.get("mfu"), nodes=st.nodes,
                     active=st.active)


def find_runs(base: Path) -> list[Path]:
    """Run directories directly under `base` (or `base` itself), newest first."""
    if RunPaths(base).job.exists():
        return [base]
    if not base.is_dir():
        return []
    runs = [p for p in base.iterdir() if RunPaths(p).job.is_file()]
    return sorted(runs, key=lambda p: p.stat().st_mtime, reverse=True)

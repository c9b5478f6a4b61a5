"""The state of a run directory, for `trainctl status/runs/logs/cancel`. No torch.

State is in Slurm's words (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, REQUEUED, PREEMPTED,
TIMEOUT, ...) for both backends: Slurm runs ask Slurm (scontrol, then the jobcomp log, then sacct);
local runs read job.json and whether the recorded launcher process still lives.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainctl.errors import UsageError
from trainctl.rundir import RunPaths, read_jsonl

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"}
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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def active(self) -> bool:
        return self.state not in TERMINAL and self.state != "UNKNOWN"


def open_run(path: Path) -> RunPaths:
    paths = RunPaths(path.absolute())
    if not paths.job.exists():
        raise UsageError(f"{path} is not a run directory (no job.json)",
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a recycled pid is not our launcher
        return b"trainctl" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


def launcher_pid(paths: RunPaths) -> int | None:
    """The local launcher's pid (the `launch` event's writer)."""
    for ev in reversed(read_jsonl(paths.events)):
        if ev.get("event") == "launch" and isinstance(ev.get("pid"), int):
            return int(ev["pid"])
    return None


def _local_state(paths: RunPaths, job: dict[str, Any]) -> tuple[str, str | None]:
    attempts = job.get("attempts") or []
    if not attempts:
        return "PENDING", "not started"
    last = attempts[-1]
    status = last.get("status")
    if status == "completed":
        return "COMPLETED", None
    if status == "interrupted":
        return "CANCELLED", f"exit code {last.get('exit_code')}"
    if status == "failed":
        return "FAILED", f"exit code {last.get('exit_code')}"
    pid = launcher_pid(paths)
    if pid is not None and _pid_alive(pid):
        return "RUNNING", None
    return "FAILED", "the launcher process is gone without recording an exit"


def run_status(path: Path) -> RunStatus:
    paths = open_run(path)
    job = read_job_json(paths)
    backend = str(job.get("backend", "local"))
    name, total = spec_steps(paths)
    events = read_jsonl(paths.events)
    last = last_jsonl(paths.metrics) or {}
    starts = sum(1 for e in events if e.get("event") == "start")
    job_id = job.get("job_id")
    nodes = None
    if backend == "slurm":
        if job_id is None:
            state, reason, attempts = "UNKNOWN", "never submitted (see events.jsonl)", 0
        else:
            from trainctl.launch import slurm

            info = slurm.job_state(str(job_id))
            state, reason, nodes = info["state"], info["reason"], info["nodes"]
            # Attempts of every job of the run (`trainctl resume` submits a new job into the same run dir).
            seen = {(str(e.get("job_id")), e.get("attempt")) for e in events if e.get("event") == "slurm_start"}
            earlier = sum(1 for j, _ in seen if j != str(job_id))
            attempts = max(len(seen), earlier + (info["restarts"] or 0) + 1 if info["restarts"] is not None else 0)
            if info["restarts"] and state == "PENDING":
                reason = f"requeued ({reason})" if reason else "requeued"
    else:
        state, reason = _local_state(paths, job)
        attempts = len(job.get("attempts") or [])
    return RunStatus(run_dir=str(paths.root), name=name or paths.root.name, backend=backend, state=state,
                     job_id=str(job_id) if job_id is not None else None, reason=reason,
                     steps_done=int(last.get("step", 0) or 0), steps_total=total, attempts=attempts,
                     starts=starts, last_loss=last.get("loss"), last_mfu=last.get("mfu"), nodes=nodes)


def find_runs(base: Path) -> list[Path]:
    """Run directories directly under `base` (or `base` itself), newest first."""
    if (base / "job.json").exists():
        return [base]
    if not base.is_dir():
        return []
    runs = [p for p in base.iterdir() if (p / "job.json").is_file()]
    return sorted(runs, key=lambda p: p.stat().st_mtime, reverse=True)


# --- logs -----------------------------------------------------------------------------------------------

def slurm_outputs(paths: RunPaths, job: dict[str, Any]) -> list[Path]:
    """The output file of every Slurm job of the run (first submission, then each resubmission)."""
    ids = [j["job_id"] for j in (job.get("slurm") or {}).get("jobs", []) if j.get("job_id") is not None]
    if job.get("job_id") is not None and job["job_id"] not in ids:
        ids.append(job["job_id"])
    return [paths.logs / f"slurm-{i}.out" for i in ids]


def rank_log_files(paths: RunPaths, job: dict[str, Any], rank: int) -> list[Path]:
    """torchrun's per-rank files for a global rank, oldest attempt first (torchrun mode, local or Slurm)."""
    if job.get("backend") == "slurm":
        placement = _placement(paths)
        where = placement.get(str(rank)) if placement else None
        if where is None:
            return []
        pattern = f"torchrun/*/{where['node']}/*/attempt_*/{where['local_rank']}/std*.log"
    else:
        pattern = f"*/attempt_*/{rank}/std*.log"
    files = [p for p in paths.logs.glob(pattern) if p.is_file()]
    return sorted(files, key=lambda p: (p.stat().st_mtime, p.name))


def _placement(paths: RunPaths) -> dict[str, Any] | None:
    try:
        data = json.loads((paths.root / "placement.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return {str(r["rank"]): r for r in data.get("ranks", [])}


def srun_label_prefix(rank: int) -> str:
    """`srun --label` prefixes every line with the task id (right-aligned), then ': '."""
    return f"{rank}: "

"""Slurm's job state names, what each means to trainctl, and a job's state. No torch.

These words are also the vocabulary `trainctl status` speaks for every backend: the local backend reports
its runs in them too (docs/ARCHITECTURE.md, "Layers": one owner per fact).

A job's state comes from the live record (`scontrol show job`), then the jobcomp log (the local test
cluster has no accounting; docs/design/checked-facts.md, "Checked facts: Slurm"), then `sacct`.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

from trainctl.launch.slurm.tools import ask_slurm

PENDING = "PENDING"
RUNNING = "RUNNING"
COMPLETED = "COMPLETED"
FAILED = "FAILED"
CANCELLED = "CANCELLED"
REQUEUED = "REQUEUED"
UNKNOWN = "UNKNOWN"  # ours: Slurm no longer knows the job, or it was never submitted

# Ended for good: nothing of the job runs or waits any more.
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED, "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                      "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"})
# Waiting to start again: the job resumes from the latest checkpoint by itself.
WAITING = frozenset({PENDING, REQUEUED, "REQUEUE_HOLD", "REQUEUE_FED"})


# How an ended job ended, in the run-state model's words (rundir/runstate.py), for a job whose trainer left
# no record of it (cancelled while pending, killed at its time limit, a node lost): the trainer's own
# events win when there are any.
RUN_STATE_OF = {COMPLETED: "FAILED", FAILED: "FAILED", CANCELLED: "CANCELLED", "TIMEOUT": "FAILED",
                "NODE_FAIL": "FAILED", "OUT_OF_MEMORY": "FAILED", "BOOT_FAIL": "FAILED", "DEADLINE": "FAILED",
                "PREEMPTED": "STOPPED", "SPECIAL_EXIT": "FAILED", UNKNOWN: "FAILED"}


def is_active(state: str) -> bool:
    """Queued, running, or anything else Slurm has not ended (an unknown job counts as ended)."""
    return state not in TERMINAL and state != UNKNOWN


def parse_kv(text: str) -> dict[str, str]:
    """`scontrol show job -o` / jobcomp.log line -> {Key: value} (values never contain spaces we need)."""
    out: dict[str, str] = {}
    for m in re.finditer(r"(\w+)=(\S*)", text):
        out.setdefault(m.group(1), m.group(2))
    return out


def scontrol_job(job_id: str) -> dict[str, str] | None:
    """The live record (pending, running, or finished within MinJobAge); None when Slurm forgot it."""
    proc = ask_slurm("scontrol", "show", "job", "-o", job_id)
    if proc is None or proc.returncode != 0 or "JobState=" not in proc.stdout:
        return None
    # JobName may contain spaces: take it separately, then parse the rest.
    line = proc.stdout.strip().splitlines()[0]
    return parse_kv(line)


def jobcomp_path() -> Path | None:
    """Where jobcomp/filetxt appends finished jobs (the local cluster; no sacct there)."""
    proc = ask_slurm("scontrol", "show", "config")
    if proc is None:
        return None
    cfg = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", proc.stdout, re.M))
    if cfg.get("JobCompType") == "jobcomp/filetxt" and cfg.get("JobCompLoc"):
        return Path(cfg["JobCompLoc"])
    return None


def jobcomp_record(job_id: str, path: Path | None = None) -> dict[str, str] | None:
    path = path if path is not None else jobcomp_path()
    if path is None or not path.exists():
        return None
    last = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(f"JobId={job_id} "):
                last = line
    return parse_kv(last) if last else None


def sacct_state(job_id: str) -> str | None:
    """Accounting, where the cluster has it (real clusters); None otherwise."""
    proc = ask_slurm("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State")
    if proc is None:
        return None
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    return lines[-1].split()[0] if proc.returncode == 0 and lines else None


def in_future(stamp: str | None) -> bool:
    """Whether a Slurm time stamp (2026-11-24T16:38:12, the controller's local time) is later than now;
    False for "Unknown", "None" or anything else."""
    try:
        return datetime.datetime.fromisoformat(stamp or "") > datetime.datetime.now()
    except ValueError:
        return False


def job_state(job_id: str) -> dict[str, Any]:
    """{'state': Slurm's word, 'reason', 'restarts', 'nodes', 'source'}: live record, then jobcomp.log,
    then sacct."""
    rec = scontrol_job(job_id)
    if rec is not None:
        return {"state": rec.get("JobState", UNKNOWN), "reason": rec.get("Reason"),
                "restarts": int(rec.get("Restarts", "0") or 0), "nodes": rec.get("NodeList"),
                "eligible": rec.get("EligibleTime"), "source": "scontrol"}
    rec = jobcomp_record(job_id)
    if rec is not None:
        return {"state": rec.get("JobState", UNKNOWN), "reason": None, "restarts": None,
                "nodes": rec.get("NodeList"), "source": "jobcomp"}
    state = sacct_state(job_id)
    if state is not None:
        return {"state": state, "reason": None, "restarts": None, "nodes": None, "source": "sacct"}
    return {"state": UNKNOWN, "reason": "Slurm no longer knows the job", "restarts": None, "nodes": None,
            "source": None}

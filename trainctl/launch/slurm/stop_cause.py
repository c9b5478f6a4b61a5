"""Why Slurm is ending an attempt, asked by the batch script when it gets SIGTERM. No torch.

`python -m trainctl.launch.slurm.stop_cause JOB_ID ATTEMPT NODELIST MESSAGES LINES` prints one phrase: "a node
failure (n2)", "preemption", "scontrol requeue", "the time limit" or "scancel". The batch script writes it to the
job's log and to its `slurm_stop` event, and `status` of a requeued job says it (launch/slurm/backend.py).

Slurm says it first: slurmstepd writes "*** JOB J ON n1 CANCELLED AT ... DUE TO NODE FAILURE ... ***" (JOB
REQUEUE, TIME LIMIT, PREEMPTION; nothing after a scancel) to the job's --error file, MESSAGES, before it signals
the batch script, and srun adds "srun: error: Node failure on n2"; LINES is how many lines the file had when the
attempt began. Without such a line (another Slurm, a file not written yet): a node of the allocation DOWN in sinfo
(on the test cluster a downed node is back within a second: ReturnToService=2 and its slurmd is alive), then the
job's record, which reads COMPLETING in every case when the batch script gets SIGTERM (Slurm 22.05,
slurm/README.md): a requeue has already raised Restarts above the attempt's SLURM_RESTART_COUNT.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from trainctl.launch.slurm.job_state import scontrol_job
from trainctl.launch.slurm.tools import ask_slurm
from trainctl.spec import time_limit

NODE_FAILURE = "a node failure"  # the phrase's start when a node of the allocation went down


def failed_nodes(nodelist: str) -> list[str]:
    """Nodes of the allocation Slurm holds down, failing or not responding, each with Slurm's reason."""
    proc = ask_slurm("sinfo", "-h", "-N", "-n", nodelist, "-o", "%N|%t|%E")
    if proc is None or proc.returncode != 0:
        return []
    out: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        node, state, reason = (line.split("|", 2) + ["", ""])[:3]
        if state.startswith(("down", "fail")) or state.endswith("*"):
            out[node] = f"{node} {state.rstrip('*') or 'down'}" + (f": {reason}" if reason not in ("", "none") else "")
    return list(out.values())


DUE_TO = {"NODE FAILURE": NODE_FAILURE, "JOB REQUEUE": "scontrol requeue", "TIME LIMIT": "the time limit",
          "PREEMPTION": "preemption"}


def slurm_says(messages: Path, from_line: int) -> str | None:
    """The cause in slurmstepd's words, from the lines of this attempt in the job's --error file."""
    try:
        lines = messages.read_text(encoding="utf-8", errors="replace").splitlines()[from_line:]
    except OSError:
        return None
    text = "\n".join(lines)
    m = re.search(r"\*\*\* JOB \S+ ON \S+ CANCELLED AT \S+ DUE TO ([A-Z ]+?)[,*]", text)
    if m is None or m.group(1).strip() not in DUE_TO:
        return None
    cause = DUE_TO[m.group(1).strip()]
    if cause == NODE_FAILURE:
        nodes = sorted(set(re.findall(r"Node failure on (\S+)", text)))
        return f"{cause} ({', '.join(nodes)})" if nodes else cause
    return cause


def stop_cause(job_id: str, attempt: int, nodelist: str, messages: Path, from_line: int) -> str:
    if (said := slurm_says(messages, from_line)) is not None:
        return said
    if failed := failed_nodes(nodelist):
        return f"{NODE_FAILURE} ({'; '.join(failed)})"
    rec = scontrol_job(job_id) or {}
    if rec.get("PreemptTime", "None") not in ("None", "Unknown", ""):
        return "preemption"
    if int(rec.get("Restarts", "0") or 0) > attempt:
        return "scontrol requeue"
    run, limit = (time_limit.seconds(rec.get(k, "")) for k in ("RunTime", "TimeLimit"))
    if run is not None and limit is not None and run >= limit:
        return "the time limit"
    return "scancel"


if __name__ == "__main__":
    job, attempt, nodes, messages, lines = sys.argv[1:6]
    cause = stop_cause(job, int(attempt or 0), nodes, Path(messages), int(lines or 0))
    print(re.sub(r'["\\\x00-\x1f]', " ", cause))  # the body of a JSON string

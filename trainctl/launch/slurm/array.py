"""A sweep on Slurm: one job array whose element i runs SWEEP/run-i's own batch script. No torch.

The runs' directories and scripts are made exactly as `launch` makes them (submit.create); the array's
script only picks the run by SLURM_ARRAY_TASK_ID, records the element's job id in that run's job.json, and
`exec`s the run's launch.sh, which then is the batch script: the stop warning (--signal=B:USR1), its own
`scontrol requeue $SLURM_JOB_ID` and every other part of the preemption/requeue chain work per element.

Until an element starts, its run's job.json names it ARRAY_TASK (`scontrol` and `scancel` take that);
once it starts, by its own job id, which is what the batch script records in events.jsonl and what %j
expands to in --output (so run-%a/logs/slurm-%j.out is the run's own log file).

    python -m trainctl.launch.slurm.array RUN_DIR    (in the element, before launch.sh)
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainctl.errors import RunError, UsageError
from trainctl.fileio import write_atomic
from trainctl.launch.create import now_iso, read_job, write_job
from trainctl.launch.slurm import NAME
from trainctl.launch.slurm.cluster import require_cluster_fits
from trainctl.launch.slurm.render import SlurmLaunch
from trainctl.launch.slurm.tools import run_slurm
from trainctl.rundir import sweep_record as rec
from trainctl.rundir.paths import RunPaths, record_event

# per run: these options name the run (its log files, its job name); every other one the array shares
RELATIVE = RunPaths(Path())  # the run directory's files relative to it
PER_RUN_OPTIONS = ("--output=", "--error=", "--job-name=")


def _shared(options: Sequence[str]) -> list[str]:
    return [o for o in options if not o.startswith(PER_RUN_OPTIONS)]


def check_shared_request(launches: Sequence[SlurmLaunch], overrides: Sequence[Sequence[str]]) -> None:
    """One job array asks Slurm for one allocation shape: refuse a grid that changes it (nodes, time...)."""
    first = _shared(launches[0].rendered.options)
    for launch, changed in zip(launches[1:], overrides[1:], strict=True):
        theirs = _shared(launch.rendered.options)
        if theirs != first:
            differ = sorted(set(theirs) ^ set(first))
            raise UsageError(f"grid point {', '.join(changed)} changes the Slurm request ({' '.join(differ)}): a "
                             "sweep's runs share one job array, which asks for one allocation shape",
                             hint="keep cluster.* and launcher.* fields that shape the job out of the grid "
                                  "(sweep them as separate sweeps)")


def array_options(root: Path, launches: Sequence[SlurmLaunch], *, job_name: str,
                  concurrency: int | None) -> list[str]:
    """The array's sbatch options: the runs' shared ones, each element's log in its run's logs/."""
    pattern = str(root).rstrip("/").replace("%", "%%") + "/" + rec.RUN_PREFIX + "%a/"
    last = len(launches) - 1
    return [f"--job-name={job_name}", *_shared(launches[0].rendered.options),
            f"--output={pattern}{RELATIVE.slurm_output('%j')}",
            f"--error={pattern}{RELATIVE.slurm_messages('%j')}",
            f"--array=0-{last}" + (f"%{concurrency}" if concurrency else "")]


def array_script(root: Path, python: str, count: int) -> str:
    q = shlex.quote
    return "\n".join([
        "#!/bin/bash",
        f"# trainctl sweep (slurm): a job array of {count} runs; element i runs {rec.RUN_PREFIX}i/launch.sh, the",
        "# run's own batch script (its stop warning, requeue and restarts), after recording its job id.",
        "set -u",
        f"SWEEP={q(str(root))}",
        f'RUN_DIR="$SWEEP/{rec.RUN_PREFIX}$SLURM_ARRAY_TASK_ID"',
        f"( cd \"$SWEEP\" && {q(python)} -m trainctl.launch.slurm.array \"$RUN_DIR\" ) ||",
        '    echo "trainctl: could not record job $SLURM_JOB_ID in $RUN_DIR/job.json" >&2',
        'exec "$RUN_DIR/launch.sh"',
        "",
    ])


def submit_array(root: Path, launches: Sequence[SlurmLaunch], *, job_name: str,
                 concurrency: int | None) -> str:
    """Write SWEEP/array.sh, submit it, and record the array in sweep.json and every run's job.json."""
    require_cluster_fits(launches[0].spec)
    script = root / rec.ARRAY_SCRIPT
    write_atomic(script, array_script(root, launches[0].request.python, len(launches)), executable=True)
    argv = ["sbatch", "--parsable", *array_options(root, launches, job_name=job_name, concurrency=concurrency),
            str(script)]
    proc = run_slurm(*argv, timeout=60)
    out = proc.stdout.strip()
    array_id = out.split(";")[0].strip()
    if proc.returncode != 0 or not array_id.isdigit():
        for launch in launches:
            record_event(RunPaths(launch.run_dir), "submit_failed", backend=NAME, error=(proc.stderr or out)[:500])
        raise RunError(f"sbatch failed (exit {proc.returncode}): {(proc.stderr or out).strip()}",
                       hint=f"the array script is {script}")
    record = rec.read_record(root)
    record.array = {"job_id": array_id, "script": rec.ARRAY_SCRIPT, "submit_command": argv, "submitted": now_iso()}
    rec.write_record(root, record)
    for i, launch in enumerate(launches):
        _record_job(RunPaths(launch.run_dir), f"{array_id}_{i}", array_id=array_id, event="submit")
    return array_id


def scancel_target(job: dict[str, Any]) -> str:
    """What scancel must name to reach the run's current job: an array element by its task (ARRAY_TASK):
    Slurm 22.05's scancel refuses an element's own job id ("Invalid job id specified") and still exits 0."""
    job_id = str(job["job_id"])
    for entry in (job.get("slurm") or {}).get("jobs", []):
        if str(entry.get("job_id")) == job_id and entry.get("array_task"):
            return str(entry["array_task"])
    return job_id


def _record_job(paths: RunPaths, job_id: str, *, array_id: str, event: str, task: str | None = None) -> None:
    """The run's current Slurm job (job.json `job_id`, `slurm.jobs`) and an event saying so."""
    job = read_job(paths)
    if job.get("job_id") == job_id:
        return  # a requeued element starts again under the same id
    sl = job.setdefault("slurm", {})
    job["job_id"] = job_id
    sl["job_id"] = job_id
    sl.setdefault("jobs", []).append({"job_id": job_id, "submitted": now_iso(), "array": array_id,
                                      **({"array_task": task} if task else {})})
    write_job(paths, job)
    record_event(paths, event, backend=NAME, job_id=job_id, array=array_id, mode=sl.get("mode"))


def never_started(job_id: str, events: Sequence[dict[str, Any]]) -> bool:
    """A job array element still named by its task (it never started) that was cancelled: Slurm forgets a
    pending task it cancels at once, without a completion record."""
    return "_" in job_id and any(e.get("event") == "cancel_requested" for e in events)


def record_element(run_dir: Path) -> None:
    """In an element: the run's job is now this element's own job id (the task name stays in slurm.jobs)."""
    paths = RunPaths(run_dir)
    array_id = os.environ["SLURM_ARRAY_JOB_ID"]
    job = read_job(paths)
    task = f"{array_id}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    if job.get("job_id") not in (task, os.environ["SLURM_JOB_ID"]):
        return  # the run was resubmitted on its own since (`trainctl resume RUN`): that job is its job now
    # the task's entry is replaced by the element's id: every job the run lists has its own log file
    jobs = [j for j in (job.get("slurm") or {}).get("jobs", []) if j.get("job_id") != task]
    job.setdefault("slurm", {})["jobs"] = jobs
    write_job(paths, job)
    _record_job(paths, os.environ["SLURM_JOB_ID"], array_id=array_id, event="array_element", task=task)


if __name__ == "__main__":
    record_element(Path(sys.argv[1]))

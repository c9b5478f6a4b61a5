"""Creating a Slurm run directory, submitting it (sbatch), resubmitting it (`trainctl resume`), scancel.
No torch."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainctl.errors import RunError, UsageError
from trainctl.fileio import write_atomic
from trainctl.launch.backend import TRAINER_MODULE
from trainctl.launch.create import create_run_dir, freeze_spec, now_iso, read_job, write_job
from trainctl.launch.slurm import NAME
from trainctl.launch.slurm.cluster import require_cluster_fits
from trainctl.launch.slurm.job_state import WAITING, is_active, job_state
from trainctl.launch.slurm.render import SlurmLaunch, commands_text, render_launch
from trainctl.launch.slurm.tools import run_slurm
from trainctl.rundir.paths import RunPaths, record_event
from trainctl.rundir.runstate import stop_in_flight


def create(launch: SlurmLaunch) -> RunPaths:
    """The run directory: spec.yaml, plan.json, launch.sh (the sbatch script), commands.txt, job.json."""
    argv = launch.submit_argv()
    paths = create_run_dir(launch.run_dir, launch.spec, backend=NAME, command=argv, env=dict(launch.request.env),
                           trains=launch.request.trainer_module == TRAINER_MODULE)
    write_atomic(paths.launch_script, launch.script, executable=True, fsync=True)
    write_atomic(paths.commands, commands_text(launch), fsync=True)
    job = read_job(paths)
    job["slurm"] = {"mode": launch.request.mode, "script": paths.launch_script.name,
                    "submit_command": argv, "options": launch.rendered.options,
                    # what `trainctl resume` needs to render the script again after a --set
                    "render": {"python": launch.default_python, "grace_s": launch.request.grace_s,
                               "trainer_module": launch.request.trainer_module},
                    "jobs": []}
    write_job(paths, job)
    return paths


def submit(launch: SlurmLaunch, paths: RunPaths) -> str:
    """sbatch --parsable; the job id is recorded in job.json and events.jsonl."""
    return _sbatch(paths, launch.submit_argv(), mode=launch.request.mode)


def _sbatch(paths: RunPaths, argv: list[str], *, mode: str, **event: Any) -> str:
    proc = run_slurm(*argv, timeout=60)
    out = proc.stdout.strip()
    job_id = out.split(";")[0].strip()  # --parsable: "ID" or "ID;cluster"
    if proc.returncode != 0 or not job_id.isdigit():
        record_event(paths, "submit_failed", backend=NAME, error=(proc.stderr or out).strip()[:500])
        raise RunError(f"sbatch failed (exit {proc.returncode}): {(proc.stderr or out).strip()}",
                       hint=f"the script is {paths.launch_script}; commands in {paths.commands}")
    job = read_job(paths)
    sl = job.setdefault("slurm", {})
    submitted = now_iso()
    job["job_id"] = job_id
    sl["job_id"] = job_id
    sl["submitted"] = submitted
    sl.setdefault("jobs", []).append({"job_id": job_id, "submitted": submitted, "command": argv,
                                      **({"resubmit_of": event["previous_job_id"]} if "previous_job_id" in event
                                         else {})})
    write_job(paths, job)
    record_event(paths, "submit", backend=NAME, job_id=job_id, mode=mode, **event)
    return job_id


ACTIVE_HINT = "wait for it to end, or stop it first: trainctl cancel {run}"


def require_not_active(paths: RunPaths) -> None:
    """Refuse to resubmit while the run's last job is still queued or running: two jobs would train into
    the same run directory (and `trainctl resume --from-step` would move checkpoints under a live job)."""
    job = read_job(paths)
    job_id = job.get("job_id")
    if job_id is None:
        return
    state = job_state(str(job_id))["state"]
    stopping = stop_in_flight(paths) if is_active(state) else None
    if stopping is not None:  # cancelled already: a second cancel changes nothing, the job is ending
        raise UsageError(f"Slurm job {job_id} of {paths.root} is {state}, still stopping: {stopping}",
                         hint=f"wait for it to end (`trainctl status {shlex.quote(str(paths.root))}` says when "
                              "it has), then run this again")
    if is_active(state):
        raise UsageError(f"Slurm job {job_id} of {paths.root} is {state}: it is still this run's job",
                         hint=ACTIVE_HINT.format(run=shlex.quote(str(paths.root)))
                         + (" (a REQUEUED/PENDING job resumes from the latest checkpoint by itself)"
                            if state in WAITING else ""))


def resubmit(paths: RunPaths, say: Callable[[str], None] | None = None) -> str:
    """Submit a Slurm run directory's launch.sh again; returns the new job id.

    The script needs no change to continue a run: every start of the trainer resumes from the newest valid
    checkpoint in the run directory, and the job appends to the same logs, metrics.jsonl and events.jsonl.
    When the frozen spec changed since the script was rendered (`trainctl resume --set ...`), the script is
    rendered again from it (the old one is kept as launch.prev-N.sh). The cluster is checked first (sinfo),
    and the submission is recorded in job.json (`job_id`, `slurm.jobs`) and as a `submit` event.
    """
    from trainctl.spec import load_spec

    paths = RunPaths(Path(paths.root).absolute())
    require_not_active(paths)
    job = read_job(paths)
    sl = job.get("slurm") or {}
    previous = job.get("job_id")
    spec = freeze_spec(load_spec(paths.spec))
    if spec.backend != NAME:
        raise UsageError(f"{paths.spec}: launcher.backend resolves to {spec.backend!r}, but this run was launched "
                         "on Slurm", hint=f"resume it with --set launcher.backend={NAME}")
    require_cluster_fits(spec)
    from trainctl.launch import exclusions

    # nodes its failures or persistent stragglers name are kept out of the new job (render reads the record)
    exclusions.update(paths, spec, say)
    argv = list(sl.get("submit_command") or [])
    mode = str(sl.get("mode") or spec.launcher.mode)
    render_args = sl.get("render")
    if render_args:
        launch = render_launch(spec, paths.root, grace_s=spec.launcher.grace_s,
                               python=render_args.get("python"),
                               trainer_module=str(render_args.get("trainer_module") or TRAINER_MODULE))
        current = paths.launch_script.read_text(encoding="utf-8") if paths.launch_script.exists() else None
        if current != launch.script or argv != launch.submit_argv():
            _replace_script(paths, launch, current)
            job = read_job(paths)  # _replace_script updated it
        argv, mode = launch.submit_argv(), launch.request.mode
    elif not argv or not paths.launch_script.exists():
        raise UsageError(f"{paths.root}: no recorded sbatch command or launch.sh to resubmit",
                         hint="the run directory is damaged; launch the spec again into a new run directory")
    return _sbatch(paths, argv, mode=mode, resubmit=True,
                   **({"previous_job_id": str(previous)} if previous is not None else {}))


def _replace_script(paths: RunPaths, launch: SlurmLaunch, current: str | None) -> None:
    """Write the re-rendered launch.sh and commands.txt, keeping the old script as launch.prev-N.sh."""
    kept = None
    if current is not None:
        n = 1
        while paths.previous_launch_script(n).exists():
            n += 1
        kept = paths.previous_launch_script(n)
        os.replace(paths.launch_script, kept)
    write_atomic(paths.launch_script, launch.script, executable=True, fsync=True)
    write_atomic(paths.commands, commands_text(launch), fsync=True)
    job = read_job(paths)
    sl = job.setdefault("slurm", {})
    sl.update({"mode": launch.request.mode, "submit_command": launch.submit_argv(),
               "options": launch.rendered.options})
    write_job(paths, job)
    record_event(paths, "launch_script_changed", previous=kept.name if kept else None,
                 reason="the frozen spec changed (trainctl resume --set)")


def cancel(job_id: str, signal: str | None = None) -> None:
    """scancel the job (with `signal`: send it to every process of the job instead)."""
    argv = ["scancel", *([f"--signal={signal}", "--full"] if signal else []), job_id]
    proc = run_slurm(*argv)
    if proc.returncode != 0:
        raise RunError(f"scancel {job_id} failed: {proc.stderr.strip() or proc.stdout.strip()}")

"""A spec -> the sbatch request and the rendered script: everything a Slurm launch will do, before anything
exists (what --dry-run prints). Every user value is vetted here. No torch."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from trainctl.data.prep import check_data
from trainctl.errors import UsageError
from trainctl.hf import init_source
from trainctl.launch import environment, exclusions, package_origin, secrets
from trainctl.launch.backend import DEFAULT_GRACE_S, TRAINER_MODULE
from trainctl.launch.create import check_run_dir, default_run_dir, freeze_spec
from trainctl.launch.slurm import NAME
from trainctl.launch.slurm.cluster import parse_time
from trainctl.launch.slurm.sbatch_template import CONTROL_CHARS, SbatchRender, SbatchRequest, render
from trainctl.rundir.paths import PLAN, SPEC, RunPaths
from trainctl.spec import RunSpec


@dataclass(frozen=True)
class SlurmLaunch:
    """Everything a Slurm launch will do, rendered before anything is created (what --dry-run prints)."""

    spec: RunSpec
    run_dir: Path
    request: SbatchRequest
    rendered: SbatchRender
    warnings: tuple[str, ...] = ()  # said before submitting and in the dry run (container visibility)
    default_python: str = sys.executable  # the interpreter without launcher.python (job.json, for resume)

    @property
    def script(self) -> str:
        return self.rendered.script

    def submit_argv(self) -> list[str]:
        return self.rendered.argv(str(RunPaths(self.run_dir).launch_script))


def _check_text(field: str, value: str | None) -> None:
    if value is not None and CONTROL_CHARS.search(value):
        raise UsageError(f"{field} = {value!r} contains a newline or control character",
                         hint=f"remove it from {field}: Slurm options and paths must be one plain line")


def _check_args(field: str, args: list[str]) -> None:
    for a in args:
        _check_text(field, a)
        if not a.startswith("-"):
            raise UsageError(f"{field} item {a!r} is not an option",
                             hint=f"give each {field} item as one --option=value word, e.g. '--reservation=r1'")


def plan_slurm(spec: RunSpec, run_dir: Path | None = None, *, grace_s: int = DEFAULT_GRACE_S,
               python: str | None = None, trainer_module: str = TRAINER_MODULE,
               dry_run: bool = False) -> SlurmLaunch:
    """Validate what can be checked without the cluster (exit 2 on a problem) and render the script.
    `dry_run`: the data the job reads lives on the cluster's filesystem, often not mounted where the script
    is rendered, so a dry run warns about data it cannot read here instead of refusing."""
    if spec.backend != NAME:
        raise UsageError(f"launcher.backend = {spec.launcher.backend!r} resolves to {spec.backend!r}, not {NAME}",
                         hint=f"use --set launcher.backend={NAME}")
    spec = freeze_spec(spec)
    root = (run_dir or default_run_dir(spec)).absolute()
    check_run_dir(root, spec if trainer_module == TRAINER_MODULE else None)
    return render_launch(spec, root, grace_s=grace_s, python=python, trainer_module=trainer_module,
                         dry_run=dry_run)


def render_launch(spec: RunSpec, root: Path, *, grace_s: int, python: str | None,
                   trainer_module: str, dry_run: bool = False) -> SlurmLaunch:
    """Vet every user value of the spec and render the script for the run directory `root`."""
    unchecked: list[str] = []
    try:
        check_data(spec)
    except UsageError as e:
        if not dry_run:
            raise
        unchecked.append(f"not checked here: {e}; `launch` refuses until this machine can read it")
    init_source.check(spec, root)  # the weights it starts from fit its model (exit 2 naming the field)
    c, lz = spec.cluster, spec.launcher
    for name, value in (("name", spec.name), ("cluster.partition", c.partition), ("cluster.account", c.account),
                        ("cluster.qos", c.qos), ("cluster.time", c.time), ("cluster.constraint", c.constraint),
                        ("cluster.exclude", c.exclude), ("cluster.mem", c.mem), ("run directory", str(root))):
        _check_text(name, value)
    if "\\" in str(root):  # sbatch expands no %j at all in an --output path with a backslash
        raise UsageError(f"run directory {str(root)!r} contains a backslash, which Slurm's --output cannot take",
                         hint="pass a --run-dir without backslashes")
    _check_args("launcher.srun_args", lz.srun_args)
    _check_args("launcher.sbatch_args", lz.sbatch_args)
    for k, v in lz.env.items():  # the names themselves are the spec rules' (spec/rules.py)
        _check_text(f"launcher.env.{k}", v)
    for field_name, value in lz.nccl.model_dump().items():
        _check_text(f"launcher.nccl.{field_name}", value)
    _check_text("launcher.python", lz.python)
    container = lz.container
    if container is not None:
        _check_text("launcher.container.image", container.image)
        _check_text("launcher.container.workdir", container.workdir)
        for i, mount in enumerate(container.mounts):
            _check_text(f"launcher.container.mounts[{i}]", mount)
    environment.check_setup(lz.setup)
    for field_name, args in (("launcher.sbatch_args", lz.sbatch_args), ("launcher.srun_args", lz.srun_args)):
        blocked = secrets.export_conflicts(args, lz.env_passthrough)
        if blocked:
            raise UsageError(f"{field_name} {blocked}: keeps {', '.join(lz.env_passthrough)} "
                             "(launcher.env_passthrough) from the job, which receives it only through the "
                             "submitting environment",
                             hint="drop --export, or use --export=ALL")
    if c.time is not None and parse_time(c.time) is None:
        raise UsageError(f"cluster.time = {c.time!r} is not a Slurm time",
                         hint="use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 12:00:00)")
    default_python = python or sys.executable
    python = lz.python or default_python  # launcher.python wins over the recorded default
    req = SbatchRequest(
        run_dir=str(root), job_name=spec.name, nodes=c.nodes, gpus_per_node=c.gpus_per_node,
        mode=lz.mode, python=python, request_gpus=c.gpu != "cpu",
        cpus_per_rank=c.cpus_per_task, mem=c.mem, time=c.time, partition=c.partition, account=c.account,
        qos=c.qos, constraint=c.constraint,
        exclude=exclusions.merged(c.exclude, list(exclusions.read(RunPaths(root)))),  # and the run's record
        max_restarts=lz.max_restarts, grace_s=grace_s, min_nodes=c.min_nodes if c.elastic else None,
        start_retries=lz.start_retries,
        srun_args=tuple(lz.srun_args), sbatch_args=tuple(lz.sbatch_args),
        env={**package_origin.rank_variables(python), **environment.spec_variables(spec)},
        passthrough=tuple(lz.env_passthrough),
        trainer_module=trainer_module, setup=tuple(lz.setup),
        container_image=container.image if container else None,
        container_mounts=tuple(container.mounts) if container else (),
        container_workdir=container.workdir if container else None,
        header=f"trainctl launch (slurm, {lz.mode} mode): "
               f"{f'{c.min_nodes}-' if c.elastic else ''}{c.nodes} node(s) x {c.gpus_per_node} rank(s); "
               f"{SPEC} and {PLAN} are next to this script",
    )
    return SlurmLaunch(spec=spec, run_dir=root, request=req, rendered=render(req),
                       warnings=(*unchecked, *environment.container_warnings(spec, root, python)),
                       default_python=default_python)


def commands_text(launch: SlurmLaunch) -> str:
    """The exact command lines, as plain text a person can paste into a shell."""
    return ("# submission (run from anywhere; every value is quoted for a POSIX shell)\n"
            f"{shlex.join(launch.submit_argv())}\n\n"
            "# the training step the batch script runs ($VARS are set by the script)\n"
            f"{' '.join(launch.rendered.step)}\n")


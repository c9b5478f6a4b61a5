"""`trainctl launch`: create the run directory and run the bundled trainer (local torchrun, or Slurm)."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from trainctl.cli.app import app
from trainctl.cli.console import make_console
from trainctl.cli.options import OptionalSpecArg, SetOpt, read_spec
from trainctl.errors import EXIT_OK


@app.command()
def launch(
    spec: Path | None = OptionalSpecArg,
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Run directory to create (default "
                                        "runs/<name>-<YYYYmmdd-HHMMSS>); must not exist or be empty."),
    set_: list[str] = SetOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the run directory and command; run nothing."),
    grace: int = typer.Option(300, "--grace", help="Slurm: seconds before the time limit at which the ranks "
                              "are told to checkpoint and the job requeues itself (--signal=B:USR1@GRACE)."),
) -> None:
    """Launch a run: freeze the spec into a run directory and start the trainer on every rank."""
    from trainctl.launch import local  # launch layer: no torch, imported only when launching

    console = make_console()
    run = read_spec(spec, set_)
    if run.backend == "slurm":
        from trainctl.cli.launch_slurm import launch_slurm

        launch_slurm(run, run_dir, dry_run=dry_run, grace_s=grace, console=console)
        return
    plan = local.plan_local(run, run_dir)
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items())
    if dry_run:
        console.print(f"run dir (not created): {plan.run_dir}", soft_wrap=True)
        print(f"{env} {shlex.join(plan.command)}")
        return
    paths = local.create(plan)
    console.print(f"[bold]run dir[/bold] {paths.root}", soft_wrap=True)
    console.print(f"[dim]{plan.nproc} ranks, {env}; per-rank logs in {paths.logs}[/dim]", soft_wrap=True)
    status = local.run(plan, paths)
    if status == EXIT_OK:
        console.print(f"[green]done[/green] metrics: {paths.metrics}", soft_wrap=True)
    else:
        console.print(f"[red]run failed[/red]; rank logs under {paths.logs} "
                      f"(console copy in {paths.logs / 'launcher.log'})", soft_wrap=True)
    raise typer.Exit(status)

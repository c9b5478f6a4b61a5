"""`trainctl resume RUN`: relaunch a run from its newest valid checkpoint (or --from-step N). No torch."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import typer

from trainctl.cli.app import app
from trainctl.cli.console import make_console
from trainctl.cli.options import JsonOpt, SetOpt
from trainctl.errors import EXIT_OK


@app.command()
def resume(
    run: Path = typer.Argument(..., help="Run directory to continue (made by `trainctl launch`).", show_default=False),
    from_step: int | None = typer.Option(None, "--from-step", min=0, help="Resume from this checkpoint step; "
                                         "newer checkpoints are moved aside (step-N.abandoned-<time>)."),
    set_: list[str] = SetOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would be resumed and how; change nothing."),
    as_json: bool = JsonOpt,
) -> None:
    """Resume a run from its latest valid checkpoint with the backend it used, appending to its run directory."""
    from trainctl.launch import resume as rs

    console = make_console(stderr=as_json)
    plan = rs.plan_resume(run, from_step, set_)
    for i in plan.skipped:
        console.print(f"[yellow]skipping invalid checkpoint[/yellow] step {i.step} ({i.path.name}): {i.reason}",
                      soft_wrap=True)
    if plan.checkpoint is None:
        console.print(f"[yellow]no valid checkpoint in {plan.checkpoint_dir}[/yellow]: the run restarts from step 0 "
                      "(appending to its run directory)", soft_wrap=True)
    else:
        console.print(f"[bold]resuming[/bold] {plan.paths.root} from step {plan.checkpoint.step} "
                      f"({plan.checkpoint.path})", soft_wrap=True)
    for change in plan.layout_changes():
        console.print(f"layout change: {change} (model, optimizer and data position are resharded at load)")
    if plan.abandon:
        console.print(f"checkpoints after step {from_step} are moved aside: {[i.step for i in plan.abandon]}",
                      soft_wrap=True)
    if plan.backend == "slurm":
        from trainctl.launch import slurm

        if as_json:
            print(json.dumps(plan.to_json(), indent=2))
        if dry_run:
            return
        rs.prepare(plan)
        job_id = slurm.resubmit(plan.paths)
        console.print(f"submitted job {job_id}", soft_wrap=True)
        return
    from trainctl.launch import local

    launch = local.plan_local(plan.spec, plan.paths.root, existing=True)
    if as_json:
        print(json.dumps({**plan.to_json(), "command": launch.command, "env": launch.env}, indent=2))
    if dry_run:
        if not as_json:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in launch.env.items())
            print(f"{env} {shlex.join(launch.command)}")
        return
    rs.prepare(plan)
    status = local.run(launch, plan.paths, kind="resume")
    if status == EXIT_OK:
        console.print(f"[green]done[/green] metrics: {plan.paths.metrics}", soft_wrap=True)
    elif rs.stopped_for_requeue(plan.paths):
        console.print("[yellow]stopped by a signal after a checkpoint[/yellow]; run `trainctl resume` again "
                      "to continue", soft_wrap=True)
    else:
        console.print(f"[red]run failed[/red]; rank logs under {plan.paths.logs}", soft_wrap=True)
    raise typer.Exit(status)


__all__ = ["resume"]

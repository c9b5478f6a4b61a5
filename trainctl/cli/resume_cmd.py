"""`trainctl resume RUN`: relaunch a run from its newest valid checkpoint (or --from-step N). No torch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from trainctl.cli.app import app
from trainctl.cli.console import escape, make_console, sayer, show
from trainctl.cli.jsonout import print_json
from trainctl.cli.options import JsonOpt, SetOpt, StrictOpt, VerboseOpt, check_before_training, say_held_back
from trainctl.fileio import require_writable, write_errors_as_usage
from trainctl.terminal import prose

if TYPE_CHECKING:
    from rich.console import Console


@app.command()
def resume(
    run: Path = typer.Argument(..., help="Run directory to continue (made by `trainctl launch`).", show_default=False),
    from_step: int | None = typer.Option(None, "--from-step", min=0, help="Resume from this checkpoint step; "
                                         "newer checkpoints are moved aside (step-N.abandoned-<time>)."),
    set_: list[str] = SetOpt,
    accept_data_change: bool = typer.Option(False, "--accept-data-change", help="Continue although a data file "
                                            "changed since the checkpoint (recorded in events.jsonl and job.json)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would be resumed and how; change nothing."),
    repair: bool = typer.Option(False, "--repair", help="Damaged records (empty, truncated, missing) are rebuilt "
                                "first from what survives: spec.yaml from job.json's record or the newest valid "
                                "checkpoint's copy, plan.json and launch.sh from the spec, job.json from spec.yaml, "
                                "launch.sh and events.jsonl (the damaged one kept beside it)."),
    as_json: bool = JsonOpt,
    strict: bool = StrictOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Resume a run from its latest valid checkpoint with the backend it used, appending to its run directory."""
    from trainctl.launch import resume as rs
    from trainctl.launch.backend import backend_for
    from trainctl.rundir.sweep_record import is_sweep_dir

    if is_sweep_dir(run):  # every run of the sweep that needs it (cli/sweep_cmd.py)
        from trainctl.cli.sweep_cmd import resume_sweep

        return resume_sweep(run, dry_run, verbose)
    console = make_console(stderr=as_json)
    if repair:
        _repair(console, run, dry_run)
    plan = rs.plan_resume(run, from_step, set_, accept_data_change=accept_data_change)
    for note in plan.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}", soft_wrap=True)
    say_held_back(console, plan.held_back)
    for i in plan.skipped:
        console.print(f"[yellow]skipping invalid checkpoint[/yellow] step {i.step} ({escape(i.path.name)}): "
                      f"{escape(i.reason)}", soft_wrap=True)
    if plan.checkpoint is None:
        console.print(f"[yellow]no valid checkpoint in {escape(str(plan.checkpoint_dir))}[/yellow]: the run restarts "
                      "from step 0 (appending to its run directory)", soft_wrap=True)
    else:
        console.print(f"[bold]resuming[/bold] {escape(str(plan.paths.root))} from step {plan.checkpoint.step} "
                      f"({plan.checkpoint.path})", soft_wrap=True)
    for change in plan.layout_changes():
        console.print(f"layout change: {escape(change)} (model, optimizer and data position are resharded at load)")
    for change in plan.hand_edits:  # used as a --set would be: said, kept (spec.prev-<n>.yaml) and recorded
        console.print(f"spec change (spec.yaml edited by hand): {escape(change)}", soft_wrap=True)
    for change in plan.spec_changes:
        console.print(f"spec change: {escape(change)}", soft_wrap=True)
    if plan.data and not plan.data_changes:  # what "unchanged" was judged by, and what it cannot see
        from trainctl.data.identity import UNCHANGED_BY

        console.print(f"data: {len(plan.data)} token file(s) unchanged since "
                      f"{f'checkpoint step {plan.checkpoint.step}' if plan.checkpoint else 'the launch'} "
                      f"({UNCHANGED_BY})", soft_wrap=True)
    for change in plan.data_changes:
        console.print(f"[yellow]data change[/yellow] (--accept-data-change): {escape(change)}", soft_wrap=True)
    for warning in plan.warnings:
        prose(console, escape(warning), "[yellow]warning[/yellow]: ")
    if plan.abandon:
        console.print(f"checkpoints after step {from_step} are moved aside: {[i.step for i in plan.abandon]}",
                      soft_wrap=True)
    check_before_training(console, plan.spec, plan.paths.root, strict)
    backend = backend_for(plan.backend)
    relaunch = backend.prepare_resume(plan.spec, plan.paths)
    if as_json:
        print_json({**plan.to_json(), **backend.resume_details(relaunch)})
    if dry_run:
        if not as_json:
            for line in backend.resume_dry_run(relaunch):
                show(console, line)
        return
    with write_errors_as_usage(f"run directory {plan.paths.root}"):
        rs.prepare(plan)
    raise typer.Exit(backend.resume(relaunch, sayer(console), verbose=verbose))


def _repair(console: Console, run: Path, dry_run: bool) -> None:
    """--repair: rebuild every damaged record (spec.yaml, plan.json, launch.sh, job.json) from what survives, or
    say that they are intact; --dry-run says what it would rebuild and stops there, since the rest of the plan
    needs the records."""
    from trainctl.launch import repair
    from trainctl.launch.status import open_run

    paths = open_run(run)
    paths.refuse_links()  # the repair writes there: never through a symbolic link
    plan = repair.plan_repair(paths)
    lost = f"; nothing to rebuild {', '.join(plan.lost)} from: its history is lost" if plan.lost else ""
    if plan.nothing:
        console.print(f"{paths.spec.name}, {paths.plan.name}, {paths.launch_script.name} and {paths.job.name} are "
                      f"intact: nothing to repair{escape(lost)}", soft_wrap=True)
        return
    what = [f.words() for f in plan.fixes]
    if plan.job is not None:
        what.append(f"job.json ({plan.job.job['backend']} backend, {len(plan.job.job.get('attempts') or [])} "
                    f"attempt(s)) from {', '.join(plan.job.sources)} ({plan.job_why})")
    if dry_run:
        console.print(f"--dry-run: would rebuild {escape('; '.join(what))}{escape(lost)}; nothing changed",
                      soft_wrap=True)
        raise typer.Exit(0)
    require_writable(paths.root, f"run directory {paths.root}")
    with write_errors_as_usage(f"run directory {paths.root}"):
        kept = repair.apply_repair(paths, plan)
    console.print(f"[bold]rebuilt[/bold] {escape('; '.join(what))}"
                  + (f"; the damaged job.json is kept as {escape(kept.name)}" if kept else "") + escape(lost),
                  soft_wrap=True)


__all__ = ["resume"]

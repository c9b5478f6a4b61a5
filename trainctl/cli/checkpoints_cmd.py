"""`trainctl checkpoints RUN`: list a run's checkpoints with size, validity and why. No torch."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.table import Table

from trainctl.checkpoint import describe_layout, list_checkpoints, newest_valid, resolve_checkpoint_dir
from trainctl.cli.app import app
from trainctl.cli.console import make_console
from trainctl.cli.jsonout import print_json
from trainctl.cli.options import JsonOpt
from trainctl.errors import UsageError
from trainctl.rundir import RunPaths
from trainctl.units import size


@app.command()
def checkpoints(
    run: Path = typer.Argument(..., help="Run directory.", show_default=False),
    deep: bool = typer.Option(False, "--deep", help="Also verify every file's checksum (reads everything)."),
    directory: Path | None = typer.Option(None, "--dir", help="Checkpoints directory (default: from the run)."),
    as_json: bool = JsonOpt,
) -> None:
    """List a run's checkpoints: step, size, validity (and why not), milestone, layout, time."""
    if directory is None:
        paths = RunPaths(run)
        if not run.is_dir():
            raise UsageError(f"{run}: no such run directory", hint="give the directory `trainctl launch` created")
        if not (paths.spec.is_file() or paths.job.is_file() or paths.checkpoints.is_dir()):
            raise UsageError(f"{run}: not a run directory (no {paths.spec.name}, {paths.job.name} or "
                             f"{paths.checkpoints.name}/)",
                             hint="give the directory `trainctl launch` created, or a checkpoints directory "
                                  "with --dir")
        directory = resolve_checkpoint_dir(run)
    elif not directory.is_dir():
        raise UsageError(f"--dir {directory}: no such directory", hint="give the run's checkpoint directory")
    infos = list_checkpoints(directory, deep=deep)
    latest = newest_valid(infos)  # what `trainctl resume` would load (shallow check unless --deep)
    if as_json:
        print_json({"directory": str(directory), "latest_valid": latest.step if latest else None,
                    "checkpoints": [i.to_json() for i in infos]})
        return
    con = make_console()
    if not infos:
        con.print(f"no checkpoints in {directory}")
        return
    table = Table(title=f"checkpoints in {directory}")
    for col in ("step", "size", "valid", "milestone", "layout", "time", "note"):
        table.add_column(col, justify="right" if col in ("step", "size") else "left", no_wrap=col != "note")
    for i in infos:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.time)) if i.time else "-"
        note = "latest" if latest is not None and i.path == latest.path else (i.reason or "")
        table.add_row(str(i.step), size(i.size_bytes), "[green]yes[/green]" if i.valid else "[red]no[/red]",
                      "yes" if i.milestone else "", describe_layout(i.meta.get("layout")), when, note)
    con.print(table)


__all__ = ["checkpoints"]

"""`trainctl checkpoints RUN`: list a run's checkpoints with size, validity and why. No torch."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from trainctl.cli.app import app
from trainctl.cli.console import Col, escape, fitted_table, make_console
from trainctl.cli.jsonout import print_json
from trainctl.cli.options import JsonOpt
from trainctl.errors import UsageError
from trainctl.terminal import prose
from trainctl.units import size


@app.command()
def checkpoints(
    run: Path = typer.Argument(..., help="Run directory.", show_default=False),
    deep: bool = typer.Option(False, "--deep", help="Also verify every file's checksum (reads everything)."),
    directory: Path | None = typer.Option(None, "--dir", help="Checkpoints directory (default: from the run)."),
    as_json: bool = JsonOpt,
) -> None:
    """List a run's checkpoints: step, size, validity (and why not), milestone, layout, time."""
    from trainctl.checkpoint import describe_layout, list_checkpoints, newest_valid, resolve_checkpoint_dir
    from trainctl.rundir.paths import RunPaths

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
                    "checksums_verified": deep,
                    "checkpoints": [i.to_json() for i in infos]})
        return
    con = make_console()
    if not infos:
        con.print(f"no checkpoints in {escape(str(directory))}")
        return
    columns = [Col("step", "key", "right"), Col("size", justify="right"), Col("valid", "key"), Col("milestone"),
               Col("layout"), Col("time"), Col("note", "prose")]
    # A shallow check sees the commit marker and every file's size, not flipped bytes: its "yes" says so.
    valid = "[green]yes[/green]" if deep else "[green]yes[/green] (not verified)"
    rows = [[str(i.step), size(i.size_bytes), valid if i.valid else "[red]no[/red]", "yes" if i.milestone else "",
             describe_layout(i.meta.get("layout")), _when(i.time),
             "latest" if latest is not None and i.path == latest.path else escape(i.reason or "")] for i in infos]
    table = fitted_table(con, columns, rows, title=f"checkpoints in {escape(str(directory))}")
    con.print(table)
    if not deep:
        prose(con, "[dim]Only `--deep` verifies checksums (it reads every file); this listing checks each "
                   "checkpoint's commit marker, manifest and file sizes.[/dim]")


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


__all__ = ["checkpoints"]

"""`trainctl sweep`, and the sweep directory as one thing for `status`, `cancel` and `resume` (each of those
commands hands a sweep directory to this module). No torch."""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from trainctl.cli.app import app
from trainctl.cli.console import Col, escape, fitted_table, make_console, sayer
from trainctl.cli.jsonout import print_json
from trainctl.cli.options import OptionalSpecArg, SetOpt, StrictOpt, VerboseOpt, check_before_training
from trainctl.errors import EXIT_OK, EXIT_STOPPED

if TYPE_CHECKING:
    from trainctl.api import SweepStatus


@app.command()
def sweep(
    spec: Path | None = OptionalSpecArg,
    grid: list[str] = typer.Option(None, "--grid", "-g", metavar="KEY=V1,V2", help="A spec field and the values "
                                   "to sweep it over, e.g. --grid train.lr=1e-4,3e-4 (repeatable: the runs are "
                                   "every combination)."),
    sweep_file: Path | None = typer.Option(None, "--sweep-file", help="A YAML file `grid: {KEY: [V1, V2], ...}`, "
                                           "for larger designs (with --grid: both, each key once)."),
    sweep_dir: Path | None = typer.Option(None, "--sweep-dir", help="Sweep directory to create (default "
                                          "runs/sweep-<name>-<YYYYmmdd-HHMMSS>); must not exist or be empty."),
    set_: list[str] = SetOpt,
    max_parallel: int | None = typer.Option(None, "--max-parallel", help="Slurm: at most this many runs at once "
                                            "(the job array's %K limit; default: no limit)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the grid and print the runs; create nothing."),
    strict: bool = StrictOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Launch one run per point of a grid of spec overrides, under one sweep directory.

    Each run is an ordinary run directory (SWEEP/run-<i>): `status`, `cancel`, `resume` and `mfu-report` take it
    alone, or the sweep directory for all its runs. Locally the runs go one after another; on Slurm they are
    one job array. A grid the spec refuses stops here, every mistake at once, before anything is created."""
    from trainctl.launch import sweep as sw
    from trainctl.launch.create import default_run_dir
    from trainctl.spec import load_spec

    console = make_console()
    spec_path = spec if spec is not None else _default_spec()
    default = default_run_dir(load_spec(spec_path, set_ or []))  # runs/<name>-<time>
    root = sweep_dir or default.with_name(f"sweep-{default.name}")
    prepared = sw.prepare(spec_path, set_ or [], grid or [], sweep_file, root, concurrency=max_parallel,
                          dry_run=dry_run)
    for launch in prepared.launches:
        check_before_training(console, launch.spec, launch.run_dir, strict)
    say = sayer(console)
    sw.say_plan(prepared, say)
    if dry_run:
        if prepared.record.backend == "slurm":  # what would be submitted: one job array
            from trainctl.launch.slurm import array

            options = array.array_options(prepared.root, prepared.launches, job_name=prepared.points[0].spec.name,
                                          concurrency=max_parallel)
            console.print("[bold]submit with[/bold]")
            print(shlex.join(["sbatch", "--parsable", *options, str(prepared.root / "array.sh")]))
        return
    sw.create(prepared)
    if prepared.record.backend == "local":
        raise typer.Exit(sw.run_local(prepared, say, verbose=verbose))
    from trainctl.launch.slurm import array

    array_id = array.submit_array(prepared.root, prepared.launches, job_name=prepared.points[0].spec.name,
                                  concurrency=max_parallel)
    console.print(f"[bold]submitted[/bold] Slurm job array {array_id} ({len(prepared.points)} runs"
                  + (f", at most {max_parallel} at once" if max_parallel else "") + ")")
    console.print(f"follow it:  trainctl status {escape(str(prepared.root))}")
    raise typer.Exit(EXIT_OK)


def _default_spec() -> Path:
    from trainctl.cli.options import default_spec_path

    return default_spec_path()


def show_status(st: SweepStatus, json_: bool) -> None:
    """`trainctl status SWEEP`: one row per run, with its grid values (api.status owns the figures)."""
    from trainctl.cli.run_cmds import _fmt_mfu, _fmt_steps

    if json_:
        print_json(st.to_json())
        return
    record, root = st.record, st.path
    console = make_console()
    array = f", Slurm job array {record.array['job_id']}" if record.array.get("job_id") else ""
    console.print(f"[bold]sweep[/bold] {escape(str(root))} ({record.backend}{array}): {len(st.runs)} runs",
                  soft_wrap=True)
    columns = [Col("run", "key"), *[Col(k) for k in record.grid], Col("state", "key"), Col("job"), Col("steps"),
               Col("loss"), Col("MFU", "prose")]
    table = []
    for run, rs in st.runs:
        if isinstance(rs, Exception):
            table.append([run.dir, *[escape(run.values[k]) for k in record.grid], "?", "-", "-", "-",
                          escape(str(rs).splitlines()[0])])
            continue
        loss = f"{rs.last_loss:.4f}" if isinstance(rs.last_loss, float) else "-"
        table.append([run.dir, *[escape(run.values[k]) for k in record.grid], rs.state, rs.job_id or "-",
                      _fmt_steps(rs), loss, _fmt_mfu(rs.last_mfu)])
    from rich import box

    console.print(fitted_table(console, columns, table, box=box.SIMPLE, show_edge=False))


def resume_sweep(root: Path, dry_run: bool, verbose: bool) -> None:
    """`trainctl resume SWEEP`: resume every run that has not completed and is not active, as `resume RUN` does
    (locally one after another, until the sweep is cancelled; on Slurm each is submitted again)."""
    from trainctl import api
    from trainctl.cli.resume_cmd import resume
    from trainctl.launch import sweep as sw
    from trainctl.rundir.runstate import COMPLETED, DIVERGED, FAILED
    from trainctl.rundir.tune_record import is_tune_dir

    st = api.status(root)
    assert isinstance(st, api.SweepStatus)
    record, rows = st.record, st.runs
    # a tune's failed layout is a result (a row saying so), not work left: `resume TUNE/run-i` retries it alone
    done = (COMPLETED, FAILED, DIVERGED) if is_tune_dir(root) else (COMPLETED,)
    todo = [run for run, st in rows if isinstance(st, Exception) or (st.state not in done and not st.active)]
    console = make_console()
    if not todo:
        console.print(f"sweep {escape(str(root))}: every run has completed or is active; nothing to resume")
        _finish_tune(root, record.backend, dry_run)
        return
    if not dry_run:
        sw.record_start(root, "resume")
    codes: list[int] = []
    for run in todo:
        if not dry_run and record.backend == "local" and sw.cancelled(root):
            console.print(f"[yellow]not resumed[/yellow] {run.dir}: the sweep was cancelled")
            codes.append(sw.EXIT_STOPPED)
            continue
        where = ", ".join(f"{k}={v}" for k, v in run.values.items())
        console.print(f"[bold]{escape(run.dir)}[/bold] ({escape(where)})")
        began = time.time()
        try:
            resume(run=root / run.dir, from_step=None, set_=[], accept_data_change=False, dry_run=dry_run,
                   repair=False, as_json=False, strict=False, verbose=verbose)
            codes.append(EXIT_OK)
        except typer.Exit as e:
            codes.append(e.exit_code)
        if not dry_run and record.backend == "local":
            sw.stop_all_after(root, root / run.dir, codes[-1], began)
    if EXIT_STOPPED not in codes:
        _finish_tune(root, record.backend, dry_run)
    raise typer.Exit(sw.sweep_exit(codes))


def _finish_tune(root: Path, backend: str, dry_run: bool) -> None:
    """A tune directory (rundir/tune_record.py) resumed: once its runs have ended, its table and spec
    (cli/tune_cmd.py's `finish`; on Slurm after waiting for the resubmitted runs)."""
    from trainctl.rundir.tune_record import is_tune_dir

    if dry_run or not is_tune_dir(root):
        return
    from trainctl.cli.tune_cmd import finish, wait_for_runs

    if backend != "local" and not wait_for_runs(root):
        raise typer.Exit(EXIT_STOPPED)
    raise typer.Exit(finish(root))

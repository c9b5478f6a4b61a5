"""`trainctl status`, `logs`, `cancel`, `runs`: look after launched runs (Slurm or local). No torch."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from trainctl.cli.app import app
from trainctl.cli.console import Col, escape, fitted_table, make_console
from trainctl.cli.jsonout import print_json
from trainctl.cli.options import JsonOpt
from trainctl.errors import TrainctlError, UsageError
from trainctl.terminal import printable

if TYPE_CHECKING:
    from trainctl.launch.status import RunStatus

STATE_COLOR = {"COMPLETED": "green", "RUNNING": "cyan", "STARTING": "cyan", "PENDING": "yellow",
               "STOPPING": "yellow", "STOPPED": "yellow", "CANCELLED": "yellow"}
RunArg = typer.Argument(..., help="Run directory (printed by `trainctl launch`).", show_default=False)
FOLLOW_POLL_S = 0.5


def _fmt_mfu(mfu: float | None) -> str:
    if not isinstance(mfu, (int, float)) or not math.isfinite(mfu):
        return "-"
    # above 100% is an accounting bug (wrong peak, wrong FLOP count), never a result
    return f"{mfu:.1%}" if mfu <= 1.0 else f"{mfu:.1%} (above 100%: a bug in the peak or FLOP count)"


def _fmt_steps(st: RunStatus) -> str:
    """Steps done of the total; for a run that ended with steps past its newest checkpoint, the committed steps
    first and the ones a resume runs again."""
    def of_total(n: int) -> str:
        return f"{n}/{st.steps_total}" if st.steps_total else str(n)

    if not st.steps_lost:
        return of_total(st.steps_done)
    return (f"{of_total(st.steps_committed)} committed ({st.steps_done} run; {st.steps_lost} will be run again)")


@app.command()
def status(run: Path = RunArg, json_: bool = JsonOpt) -> None:
    """State of a run in Slurm's words, steps done, attempts, the last MFU, and the rest projected from what it
    measured (ETA, days, GPU-hours, the gap to the plan)."""
    from trainctl import api
    from trainctl.rundir.runstate import RUNNING, STARTING

    st = api.status(run)
    if isinstance(st, api.SweepStatus):  # a sweep (or tune): a table of its runs (cli/sweep_cmd.py)
        from trainctl.cli.sweep_cmd import show_status

        return show_status(st, json_)
    proj = _projection(run, training=st.state in (STARTING, RUNNING))  # not while Slurm queues it
    if json_:
        print_json({**st.to_json(), "projection": proj})
        return
    console = make_console()
    color = STATE_COLOR.get(st.state, "red")
    job = f" job {st.job_id}" + (f" {st.job_state}" if st.job_state and st.job_state != st.state else "") \
        if st.job_id else ""
    console.print(f"[bold]{escape(st.name)}[/bold] ({st.backend}{escape(job)}): [{color}]{st.state}[/{color}]"
                  + (f" - {escape(st.reason)}" if st.reason and st.reason != "None" else ""), soft_wrap=True)
    loss = (f", loss {st.last_loss:.4f}" + (f" (step {st.steps_done})" if st.steps_lost else "")
            if isinstance(st.last_loss, float) else "")
    console.print(f"steps {_fmt_steps(st)}{loss}, MFU {_fmt_mfu(st.last_mfu)}, "
                  f"attempts {st.attempts}, trainer starts {st.starts}"
                  + (f", nodes {escape(st.nodes)}" if st.nodes and st.nodes != "(null)" else ""), soft_wrap=True)
    if proj is not None:
        from trainctl.report.projection import lines

        for line in lines(proj):
            console.print(escape(line), soft_wrap=True)
    for node, why in st.excluded_nodes.items():
        console.print(f"[yellow]excluded[/yellow] {escape(node)} from later jobs of this run: {escape(why)}",
                      soft_wrap=True)
    console.print(f"[dim]{escape(st.run_dir)}[/dim]", soft_wrap=True)


def _projection(run: Path, *, training: bool) -> dict[str, Any] | None:
    """The rest of the run projected from what it measured (report/projection.py); None before its first step
    (load_run refuses a run with nothing to report, which status still describes)."""
    from trainctl.report.load import load_run
    from trainctl.report.projection import projection_of

    try:
        return projection_of(load_run(run), training=training)
    except TrainctlError:
        return None


@app.command()
def runs(base: Path = typer.Argument(Path("runs"), help="Directory holding run directories."),
         json_: bool = JsonOpt) -> None:
    """List run directories with backend, state, steps done and last MFU."""
    from rich import box

    from trainctl.launch.repair import DamagedJob
    from trainctl.launch.status import damaged_status, find_runs, run_status

    if not base.is_dir():
        raise UsageError(f"{base}: no such directory", hint="give the directory that holds run directories "
                         "(`trainctl launch` makes them under runs/)")
    found = []
    for p in find_runs(base):
        try:
            found.append(run_status(p))
        except DamagedJob as e:  # listed, not hidden: `trainctl status RUN` says how to repair it
            found.append(damaged_status(p, e))
        except UsageError:
            continue
    if not found:
        raise UsageError(f"no run directories under {base}", hint="`trainctl launch` makes them under runs/")
    if json_:
        print_json([s.to_json() for s in found])
        return
    console = make_console()
    columns = [Col("run", "key"), Col("name"), Col("backend"), Col("job"), Col("state", "key"), Col("steps"),
               Col("MFU", "prose")]
    rows = [[escape(Path(s.run_dir).name), escape(s.name), s.backend, s.job_id or "-", s.state,
             _fmt_steps(s), _fmt_mfu(s.last_mfu)] for s in found]
    console.print(fitted_table(console, columns, rows, box=box.SIMPLE, show_edge=False))


@app.command()
def cancel(run: Path = RunArg,
           force: bool = typer.Option(False, "--force", help="Kill every process of the run now, a save in flight "
                                      "included (the newest committed checkpoint stays; the steps since it are "
                                      "lost). On Slurm: scancel --signal=KILL, which Slurm carries out as its "
                                      "cancel, SIGKILL after its KillWait.")) -> None:
    """Cancel a run: scancel its Slurm job, or stop the local launcher (SIGTERM, as Ctrl-C would): every rank saves
    a checkpoint after its current step. Asking again while it stops changes nothing; --force kills. A sweep (or
    tune) directory: every active run of it, and none of its runs starts after."""
    from trainctl import api

    for line in api.cancel(run, force=force):
        print(printable(line))


@app.command()
def logs(run: Path = RunArg,
         follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until the run ends."),
         rank: int | None = typer.Option(None, "--rank", help="Only this global rank's output.")) -> None:
    """Print a run's log: the Slurm output file (or the local console log), or one rank's output."""
    from trainctl.launch.backend import backend_for
    from trainctl.launch.status import open_run, read_job_json, spec_world_size

    paths = open_run(run)
    job = read_job_json(paths)
    if rank is not None:
        world = spec_world_size(paths)
        if world is not None and not 0 <= rank < world:
            raise UsageError(f"--rank {rank}: the run has {world} rank{'s' if world != 1 else ''} "
                             f"(0-{world - 1})", hint="give a global rank of the run")
    found = backend_for(job).log_files(paths, job, rank)
    files, prefix = found.files, found.prefix
    if not files or not any(f.exists() for f in files) and not follow:
        raise UsageError(f"no log yet for {paths.root}", hint="the job may still be pending; try `-f`")
    out = sys.stdout
    shown = 0
    for f in files[:-1]:  # earlier jobs or attempts, oldest first
        if f.exists():
            shown += _print_file(f, prefix, out)
    shown += _print_file(files[-1], prefix, out, follow=follow, run=paths.root if follow else None)
    if not shown:
        what = f"rank {rank}" if rank is not None else "the run"
        print(f"{what} printed nothing ({len(files)} log file{'s' if len(files) != 1 else ''}, all empty)",
              file=sys.stderr)


def _print_file(path: Path, prefix: str | None, out, follow: bool = False, run: Path | None = None) -> int:
    """Print a log file (lines with `prefix` only, without it), following it while the run is active; how
    many lines it printed."""
    from trainctl.launch.status import run_status

    pos = 0
    shown = 0
    pending = b""
    while True:
        if path.exists():
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
            data = pending + chunk
            lines = data.split(b"\n")
            pending = lines.pop()  # an unfinished last line waits for its end
            for raw in lines:
                line = raw.decode("utf-8", errors="replace")
                if prefix is None:
                    out.write(line + "\n")
                    shown += 1
                elif line.lstrip().startswith(prefix):
                    out.write(line.lstrip()[len(prefix):] + "\n")
                    shown += 1
            out.flush()
        if not follow:
            if pending and (prefix is None or pending.decode(errors="replace").lstrip().startswith(prefix)):
                out.write(pending.decode("utf-8", errors="replace") + "\n")
                shown += 1
            return shown
        assert run is not None
        if not run_status(run).active:
            follow = False  # one last read after the end
            time.sleep(FOLLOW_POLL_S)
            continue
        try:
            time.sleep(FOLLOW_POLL_S)
        except KeyboardInterrupt:
            return shown

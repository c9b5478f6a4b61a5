"""`trainctl calibrate [SPEC]`: measure the cluster the spec describes (or refit from a finished run) and write
a calibration profile for the planner. No torch here: the measuring runs on the ranks."""

from __future__ import annotations

from pathlib import Path

import typer

from trainctl.cli.app import app
from trainctl.cli.console import escape, make_console, sayer
from trainctl.cli.options import OptionalSpecArg, SetOpt, read_spec, say_held_back
from trainctl.errors import UsageError
from trainctl.fileio import require_writable, write_errors_as_usage


@app.command()
def calibrate(
    spec: Path | None = OptionalSpecArg,
    set_: list[str] = SetOpt,
    out: Path | None = typer.Option(None, "--out", "-o", help="Profile to write (default: calibration-<name>.json "
                                    "in the working directory, calibration-<name>-from-<run>.json with "
                                    "--from-run); replaced atomically."),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Run directory of the measuring job (default "
                                        "runs/calibrate/<name>-<YYYYmmdd-HHMMSS>)."),
    from_run: Path | None = typer.Option(None, "--from-run", metavar="RUN", help="Measure nothing: refit the compute "
                                         "rate from a finished run's step times (its spec is the run's)."),
    base: Path | None = typer.Option(None, "--base", metavar="PROFILE", help="With --from-run: keep this profile's "
                                     "links and per-TP compute shape, re-levelled to the run, and refit the links' "
                                     "latency per kind the run timed apart (TP waits, gradient sync)."),
) -> None:
    """Measure matmul rates, collectives and a layer on the spec's cluster; write the planner's profile."""
    from trainctl.launch.calibrate import calibrate as measure
    from trainctl.launch.calibrate import default_out
    from trainctl.launch.secrets import credential_names
    from trainctl.plan.calibration import profile as prof

    console = make_console()
    if from_run is not None:
        if spec is not None or set_:
            raise UsageError("--from-run refits the run's own spec: drop SPEC and --set")
        from trainctl.report.refit import refit
        from trainctl.rundir.paths import RunPaths
        from trainctl.spec import load_spec

        run_spec = load_spec(RunPaths(from_run).spec) if RunPaths(from_run).spec.is_file() else None
        if run_spec is None:
            raise UsageError(f"{from_run}: no {RunPaths(from_run).spec.name}: not a run directory",
                             hint="give a directory `trainctl launch` created")
        base_profile = prof.load(base) if base is not None else None
        if base_profile is not None:
            prof.check(base_profile, run_spec)
        target = out or default_out(run_spec, from_run)
        if base is not None and target.resolve() == base.resolve():
            raise UsageError(f"--out {target} is the --base profile: the refit would replace the measurements "
                             "it keeps", hint="give another --out (the default names the refit after the run)")
        require_writable(target.absolute().parent, f"--out {target}")
        with write_errors_as_usage(f"--out {target}"):
            prof.save(target, refit(from_run, base_profile))
        written = prof.load(target)
    elif base is not None:
        raise UsageError("--base goes with --from-run")
    else:
        run = read_spec(spec, set_)
        say_held_back(console, credential_names(run.launcher.env))
        target = out or default_out(run)
        require_writable(target.absolute().parent, f"--out {target}")  # before the measuring, not after it
        console.print(f"[bold]calibrating[/bold] {escape(run.name)}: {run.world_size} ranks "
                      f"({run.cluster.gpus_per_node} per node, cluster.gpu {run.cluster.gpu}) with the {run.backend} "
                      "backend")
        written = measure(run, target, run_dir, sayer(console))
    console.print(f"[bold]profile[/bold] {escape(str(target))}: {escape(prof.summary(written.data))}")
    console.print(escape(f"use it: trainctl plan SPEC --calibration {target}  (or cluster.calibration: {target})"))


__all__ = ["calibrate"]

"""`trainctl launch`: create the run directory and run the bundled trainer (local torchrun, or Slurm)."""

from __future__ import annotations

from pathlib import Path

import typer

from trainctl.cli.app import app
from trainctl.cli.console import make_console, sayer, show
from trainctl.cli.options import (
    OptionalSpecArg,
    SetOpt,
    StrictOpt,
    VerboseOpt,
    check_before_training,
    read_spec,
    say_held_back,
)
from trainctl.launch.backend import DEFAULT_GRACE_S, backend_for
from trainctl.launch.create import default_run_dir
from trainctl.launch.secrets import credential_names


@app.command()
def launch(
    spec: Path | None = OptionalSpecArg,
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Run directory to create (default "
                                        "runs/<name>-<YYYYmmdd-HHMMSS>); must not exist or be empty."),
    set_: list[str] = SetOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the run directory and command; run nothing."),
    strict: bool = StrictOpt,
    grace: int = typer.Option(DEFAULT_GRACE_S, "--grace", help="Slurm: seconds before the time limit at which the "
                              "ranks are told to checkpoint and the job requeues itself (--signal=B:USR1@GRACE)."),
    verbose: bool = VerboseOpt,
) -> None:
    """Launch a run: freeze the spec into a run directory and start the trainer on every rank.

    Locally it runs to the end here: Ctrl-C makes every rank save a checkpoint after its current step and stop
    (exit 75; `trainctl resume RUN` continues); a second Ctrl-C kills at once."""
    console = make_console()
    run = read_spec(spec, set_)
    say_held_back(console, credential_names(run.launcher.env))
    backend = backend_for(run)
    launch = backend.prepare(run, run_dir, grace_s=grace)
    check_before_training(console, run, run_dir or default_run_dir(run), strict)
    if dry_run:
        for line in backend.dry_run(launch):
            show(console, line)
        return
    raise typer.Exit(backend.start(launch, sayer(console), verbose=verbose))

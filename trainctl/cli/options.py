"""Options shared by every command that reads a spec."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from trainctl.errors import SpecError, UsageError

if TYPE_CHECKING:  # a command's --help builds no spec model: imported where a spec is read
    from rich.console import Console

    from trainctl.spec import RunSpec

SetOpt = typer.Option(
    None, "--set", "-s", metavar="KEY=VALUE",
    help="Override a spec field, e.g. --set parallel.tp=4 (repeatable).",
)
JsonOpt = typer.Option(False, "--json", help="Print machine-readable JSON instead of tables.")
StrictOpt = typer.Option(False, "--strict", help="Refuse (exit 2) what would otherwise be a warning: too little "
                         "free space for the checkpoints (keep_last + 1 of the planned size), a GPU spec on a "
                         "machine without GPUs.")


VerboseOpt = typer.Option(False, "--verbose", "-v", help="Show everything torchrun and every rank print, as it "
                          "comes (tracebacks, torchrun's log lines); they are always in the run's logs.")

OptionalSpecArg = typer.Argument(
    None, help="Run spec YAML (see recipes/); default: the embedded tiny CPU recipe.", show_default=False
)


def default_spec_path() -> Path:
    """The embedded quickstart recipe (tiny GPT, TP=2 x PP=2 x DP=2 on 8 CPU ranks)."""
    return Path(__file__).resolve().parents[1] / "spec" / "tiny-cpu.yaml"


def require_extras(spec: RunSpec, source: str | None = None) -> None:
    """Refuse (exit 2) a spec that switches on a tracking sink whose library is not installed."""
    from trainctl.launch.extras import missing_extras

    problems = missing_extras(spec)
    if problems:
        raise SpecError(problems, source)


def check_before_training(console: Console, spec: RunSpec, run_dir: Path, strict: bool) -> None:
    """Before training: refuse a sink that is not installed; warn (refuse under --strict, exit 2) when the
    checkpoint directory is too small or, for a multi-node run, node-local, or when a spec for GPUs would train
    on this machine's CPU."""
    from trainctl.checkpoint.storage import storage_problem
    from trainctl.cli.console import escape
    from trainctl.launch.device_check import cpu_fallback_problem
    from trainctl.launch.diskspace import space_problem

    require_extras(spec)
    for problem in (cpu_fallback_problem(spec), space_problem(spec, run_dir), storage_problem(spec, run_dir)):
        if problem is None:
            continue
        if strict:
            raise UsageError(problem)
        console.print(f"[yellow]warning:[/yellow] {escape(problem)} (--strict refuses)", soft_wrap=True)


def say_held_back(console: Console, names: list[str]) -> None:
    """Say that these launcher.env credentials reach the ranks without being written (launch/secrets.py)."""
    for name in names:
        console.print(f"[yellow]note:[/yellow] launcher.env.{name} looks like a credential: the ranks get its value "
                      "through the environment and it is not written to the run directory (spec.yaml lists it "
                      f"under launcher.env_passthrough, so `trainctl resume` needs {name} exported)", soft_wrap=True)


def read_spec(path: Path | None, overrides: list[str] | None) -> RunSpec:
    from trainctl import api

    return api.load(path if path is not None else default_spec_path(), overrides or [])

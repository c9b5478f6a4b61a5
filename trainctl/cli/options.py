"""Options shared by every command that reads a spec."""

from __future__ import annotations

from pathlib import Path

import typer

from trainctl.spec import RunSpec, load_spec

SpecArg = typer.Argument(..., help="Run spec YAML (see recipes/).", show_default=False)
SetOpt = typer.Option(
    None, "--set", "-s", metavar="KEY=VALUE",
    help="Override a spec field, e.g. --set parallel.tp=4 (repeatable).",
)
JsonOpt = typer.Option(False, "--json", help="Print machine-readable JSON instead of tables.")


def read_spec(path: Path, overrides: list[str] | None) -> RunSpec:
    return load_spec(path, overrides or [])

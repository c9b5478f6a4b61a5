"""`trainctl validate` and `trainctl schema`."""

from __future__ import annotations

from pathlib import Path

import typer

from trainctl.cli.app import app
from trainctl.cli.console import escape, make_console
from trainctl.cli.jsonout import print_json
from trainctl.cli.options import JsonOpt, OptionalSpecArg, SetOpt, default_spec_path, read_spec, require_extras


@app.command()
def validate(spec: Path | None = OptionalSpecArg, set_: list[str] = SetOpt, as_json: bool = JsonOpt) -> None:
    """Check a run spec; print it with every default filled in."""
    from trainctl.spec import resolved_dict, time_limit

    path = spec if spec is not None else default_spec_path()
    run = read_spec(path, set_)
    require_extras(run, str(path))
    # Legal but probably unintended (stderr, so --json stays one document); `plan` lists the same warning.
    if (line := time_limit.grace_warning(run.cluster.time, run.launcher.grace_s)) is not None:
        make_console(stderr=True).print(f"[yellow]warning:[/yellow] {escape(line)}")
    if as_json:
        print_json(resolved_dict(run))
        return
    make_console().print(f"[green]ok[/green] {escape(str(path))}: {escape(run.name)} — world {run.world_size:,} = "
                    f"tp {run.parallel.tp} x {f'cp {run.parallel.cp} x ' if run.parallel.cp > 1 else ''}"
                    f"pp {run.parallel.pp} x dp {run.dp}")


@app.command()
def schema() -> None:
    """Print the JSON Schema of the run spec (for editor completion and checking)."""
    from trainctl.spec.models import RunSpec

    print_json(RunSpec.model_json_schema(by_alias=True))


__all__ = ["validate", "schema", "typer"]

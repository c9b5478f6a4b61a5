"""The `trainctl` command: typer app, error handling and exit codes.

Each command group lives in its own module and registers itself on `app`; this module must stay
cheap to import (no torch, no numpy) so `trainctl --help` and `trainctl plan` start fast.
"""

from __future__ import annotations

import sys

import typer

from trainctl import terminal
from trainctl.errors import EXIT_USAGE, TrainctlError

app = typer.Typer(
    name="trainctl",
    help="Plan, launch, resume and measure Megatron-style training runs on Slurm and torchrun.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    # click's plain help: typer 0.29's rich help shows a `<bool>` placeholder after every flag
    rich_markup_mode=None,
)

_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        from trainctl import __version__

        print(f"trainctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
          version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                       callback=_version)) -> None:
    _state["debug"] = debug


def _register() -> None:
    # Imported for their side effect of adding commands to `app`.
    from trainctl.cli import (  # noqa: F401
        calibrate_cmd,
        checkpoints_cmd,
        data_cmd,
        export_cmd,
        hardware_cmd,
        launch_cmd,
        plan_cmd,
        preflight_cmd,
        report_cmd,
        resume_cmd,
        run_cmds,  # noqa: F401  (status, logs, cancel, runs)
        spec_cmd,
    )


def main(argv: list[str] | None = None) -> None:
    from trainctl.cli import completion

    _register()
    try:
        if (asked := completion.named_shell(sys.argv[1:] if argv is None else argv)) is not None:
            completion.answer(*asked)
            return
        # standalone mode: click prints usage errors itself and exits 2.
        app(args=argv, prog_name="trainctl", standalone_mode=True)
    except TrainctlError as e:
        if _state["debug"]:
            raise
        _print_error(e.message, e.hint)
        sys.exit(e.exit_code)
    except OSError as e:  # a file the command could not read or write that no check foresaw: one line, not a traceback
        if _state["debug"] or isinstance(e, BrokenPipeError):  # a closed pipe (`| head`) is no error of ours
            raise
        from trainctl.fileio import os_error_line

        _print_error(f"{os_error_line(e)} (--debug shows where)")
        sys.exit(EXIT_USAGE)


def _print_error(message: str, hint: str | None = None) -> None:
    text = "".join(f"error: {line}\n" for line in message.splitlines() or [message])
    terminal.write(sys.stderr, text + (f"hint: {hint}\n" if hint else ""))

"""The `trainctl` command: typer app, error handling and exit codes.

Each command group lives in its own module and registers itself on `app`; this module must stay
cheap to import (no torch, no numpy) so `trainctl --help` and `trainctl plan` start fast.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import typer

from trainctl import terminal
from trainctl.cli.completion import COMPLETE_VAR
from trainctl.errors import EXIT_RUN_FAILED, EXIT_USAGE, TrainctlError

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


# The module that adds each command to `app` (a test holds this table to what the modules register). A call
# names one command, so only its module is imported: typer builds a click command for every registered one
# on each call, and the other modules' imports would be paid for nothing.
COMMAND_MODULES = {
    "calibrate": "calibrate_cmd", "checkpoints": "checkpoints_cmd", "export": "export_cmd",
    "hardware": "hardware_cmd", "preflight": "preflight_cmd", "launch": "launch_cmd", "plan": "plan_cmd",
    "mfu-report": "report_cmd", "resume": "resume_cmd", "status": "run_cmds", "runs": "run_cmds",
    "cancel": "run_cmds", "logs": "run_cmds", "validate": "spec_cmd", "schema": "spec_cmd", "data": "data_cmd",
    "sweep": "sweep_cmd", "tune": "tune_cmd",
}


def command_named(argv: Sequence[str]) -> str | None:
    """The command a call names: the first word after the root options (which are all flags)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _register(argv: Sequence[str] | None = None) -> None:
    """Add the command `argv` names to `app`, or every command (help, completion, a word that is no command)."""
    import importlib

    name = None if argv is None or os.environ.get(COMPLETE_VAR) else command_named(argv)
    modules = [COMMAND_MODULES[name]] if name in COMMAND_MODULES else list(dict.fromkeys(COMMAND_MODULES.values()))
    for module in modules:  # imported for their side effect of adding commands to `app`
        importlib.import_module(f"trainctl.cli.{module}")


def main(argv: list[str] | None = None) -> None:
    from trainctl.cli import completion

    args = sys.argv[1:] if argv is None else argv
    _register(args)
    try:
        if (asked := completion.named_shell(args)) is not None:
            completion.answer(*asked)
            return
        # standalone mode: click prints usage errors itself and exits 2.
        app(args=argv, prog_name="trainctl", standalone_mode=True)
    except TrainctlError as e:
        if _state["debug"]:
            raise
        _print_error(e.message, e.hint, notes=e.notes)
        sys.exit(e.exit_code)
    except OSError as e:  # a file the command could not read or write that no check foresaw: one line, not a traceback
        if _state["debug"] or isinstance(e, BrokenPipeError):  # a closed pipe (`| head`) is no error of ours
            raise
        from trainctl.fileio import os_error_line

        _print_error(f"{os_error_line(e)} (--debug shows where)")
        sys.exit(EXIT_USAGE)
    except Exception as e:  # a bug of ours: one line and where its traceback went, not the traceback
        if _state["debug"]:
            raise
        where = _save_traceback(args)
        first = str(e).splitlines()[0] if str(e) else ""
        _print_error(f"internal error (a bug in trainctl): {type(e).__name__}" + (f": {first}" if first else ""),
                     hint=(f"the traceback is in {where}; please report it" if where else
                           "run it again with --debug to see the traceback"))
        sys.exit(EXIT_RUN_FAILED)


def _save_traceback(args: Sequence[str]) -> str | None:
    """The traceback being handled, written to a new file under $XDG_STATE_HOME/trainctl (~/.local/state) or,
    where that cannot be written, the temporary directory; its path, or None when neither can be written."""
    import tempfile
    import time
    import traceback

    from trainctl import __version__

    text = (f"trainctl {__version__}, {time.strftime('%Y-%m-%d %H:%M:%S')}\nargs: {list(args)}\n\n"
            + traceback.format_exc())
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    for folder in (os.path.join(state, "trainctl"), tempfile.gettempdir()):
        try:
            os.makedirs(folder, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix=f"crash-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".txt",
                                        dir=folder)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            return path
        except OSError:
            continue
    return None


def _print_error(message: str, hint: str | None = None, notes: list[str] | None = None) -> None:
    text = "".join(f"error: {line}\n" for line in message.splitlines() or [message])
    text += "".join(f"note: {line}\n" for line in notes or [])
    terminal.write(sys.stderr, terminal.printable(text + (f"hint: {hint}\n" if hint else "")))

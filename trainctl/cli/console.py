"""The one way CLI commands make a rich Console.

Lines never wrap by default (``soft_wrap``): a run directory path or a job id cut in two breaks copy-paste
and every script that greps our output. Tables fit the width, and so does prose that holds no such token
(`trainctl.prose`: the plan's notes and warnings, wrapped with a hanging indent). The width is the
terminal's, or COLUMNS when set; when stdout is not a terminal and COLUMNS is not set (CI logs, pipes) rich
assumes 80 columns, and tables get 120 so they stay readable in logs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from trainctl import terminal

if TYPE_CHECKING:
    from trainctl.launch.backend import Line

MIN_PIPED_WIDTH = 120


def make_console(*, stderr: bool = False) -> Console:
    probe = Console(stderr=stderr)  # rich reads COLUMNS itself
    asked = os.environ.get("COLUMNS", "").strip().isdigit()
    width = probe.width if probe.is_terminal or asked else max(MIN_PIPED_WIDTH, probe.width)
    return Console(stderr=stderr, soft_wrap=True, highlight=False, width=width)


def show(console: Console, line: Line) -> None:
    """Print a launch backend's line: styled parts through rich, verbatim lines to stdout exactly."""
    if line.verbatim:
        terminal.write(sys.stdout, line.text + "\n")
        return
    with terminal.guarded(console.file):  # a terminal that closed under a run must not end its launcher
        console.print("".join(escape(p) if isinstance(p, str) else f"[{p[1]}]{escape(p[0])}[/{p[1]}]"
                              for p in line.parts))


def sayer(console: Console) -> Callable[[Line], None]:
    """`show` on this console, as the `say` callback backends report through."""
    return lambda line: show(console, line)

"""The one way CLI commands make a rich Console.

Lines never wrap (``soft_wrap``): a run directory path or a job id cut in two breaks copy-paste and
every script that greps our output. When stdout is not a terminal (CI logs, pipes) rich assumes 80
columns; tables get at least 120 so they stay readable in logs.
"""

from __future__ import annotations

from rich.console import Console

MIN_PIPED_WIDTH = 120


def make_console(*, stderr: bool = False) -> Console:
    probe = Console(stderr=stderr)
    width = probe.width if probe.is_terminal else max(MIN_PIPED_WIDTH, probe.width)
    return Console(stderr=stderr, soft_wrap=True, highlight=False, width=width)

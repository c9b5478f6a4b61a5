"""The width of the terminal a local launch prints to, handed to the ranks. No torch.

The ranks' stdout goes through torchrun to the launcher, so no rank sees the terminal: the launcher puts the
terminal's width in TRAINCTL_COLUMNS when it starts torchrun, and rank 0 prints its per-step line in a compact
form when that is narrower than COMPACT_BELOW. Without a terminal (a pipe, a log, Slurm) the variable is unset
and the line keeps its full form.
"""

from __future__ import annotations

import os
import shutil
import sys

COLUMNS_VARIABLE = "TRAINCTL_COLUMNS"
COMPACT_BELOW = 100  # the full step line is about 150 characters: under this many columns it would wrap


def launch_variables() -> dict[str, str]:
    """{TRAINCTL_COLUMNS: width} when the launcher prints to a terminal or COLUMNS says the width; else {}."""
    if not (sys.stdout.isatty() or os.environ.get("COLUMNS", "").strip().isdigit()):
        return {}
    return {COLUMNS_VARIABLE: str(shutil.get_terminal_size().columns)}


def compact() -> bool:
    """Whether the step line must fit a terminal narrower than COMPACT_BELOW (the launcher said so)."""
    value = os.environ.get(COLUMNS_VARIABLE, "").strip()
    return value.isdigit() and int(value) < COMPACT_BELOW

"""The one way CLI commands make a rich Console.

Lines never wrap by default (``soft_wrap``): a run directory path or a job id cut in two breaks copy-paste
and every script that greps our output. Tables fit the width, and so does prose that holds no such token
(`trainctl.terminal`: the plan's notes and warnings, wrapped with a hanging indent). The width is the
terminal's, or COLUMNS when set; when stdout is not a terminal and COLUMNS is not set (CI logs, pipes) rich
assumes 80 columns, and tables get 120 so they stay readable in logs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from trainctl import terminal
from trainctl.terminal import escape as escape  # the one escape of shown text; commands import it from here

if TYPE_CHECKING:  # rich is imported on first use: `--help` prints through typer and never loads it
    from rich.console import Console
    from rich.table import Table

    from trainctl.launch.backend import Line

MIN_PIPED_WIDTH = 120
PROSE_MIN_WIDTH = 20  # an explaining column narrower than this reads as a column of word fragments


def make_console(*, stderr: bool = False) -> Console:
    from rich.console import Console

    probe = Console(stderr=stderr)  # rich reads COLUMNS itself
    asked = os.environ.get("COLUMNS", "").strip().isdigit()
    width = probe.width if probe.is_terminal or asked else max(MIN_PIPED_WIDTH, probe.width)
    # emoji off: a path or name with ':word:' in it prints as written (rich would draw ':thumbs_up:' as an emoji),
    # and rich's table of emoji codes is never imported
    return Console(stderr=stderr, soft_wrap=True, highlight=False, width=width, emoji=False)


def show(console: Console, line: Line) -> None:
    """Print a launch backend's line: styled parts through rich, verbatim lines to stdout exactly."""
    if line.verbatim:
        terminal.write(sys.stdout, terminal.printable(line.text) + "\n")
        return
    with terminal.guarded(console.file):  # a terminal that closed under a run must not end its launcher
        console.print("".join(escape(p) if isinstance(p, str) else f"[{p[1]}]{escape(p[0])}[/{p[1]}]"
                              for p in line.parts))


def sayer(console: Console) -> Callable[[Line], None]:
    """`show` on this console, as the `say` callback backends report through."""
    return lambda line: show(console, line)


@dataclass(frozen=True)
class Col:
    """A table column and what it is for when the width runs short: `key` names the row (never cut, never
    wrapped: a step, a run directory), `prose` explains it (wraps at words, keeps PROSE_MIN_WIDTH), `other`
    gives up width first (wraps between words; folds a word, a number too, only where nothing else is left)."""

    header: str
    role: Literal["key", "prose", "other"] = "other"
    justify: Literal["left", "right"] = "left"


def fitted_table(console: Console, columns: Sequence[Col], rows: Iterable[Sequence[str]],
                 **table_options: Any) -> Table:
    """A table of `rows` (rich markup) that fits the console's width without losing what names or explains a
    row: the widest column that may give width gives it first (`_narrowed`), `key` columns never. Rich alone
    shrinks only the wrappable columns and may squeeze the one explaining column to nothing."""
    from rich.cells import cell_len
    from rich.table import Table
    from rich.text import Text

    rows = [list(r) for r in rows]
    table = Table(**table_options)
    for c in columns:
        table.add_column(c.header, justify=c.justify, no_wrap=c.role == "key", overflow="fold")
    for r in rows:
        table.add_row(*r)
    cells = [[Text.from_markup(c.header, emoji=False)] + [Text.from_markup(r[i], emoji=False) for r in rows]
             for i, c in enumerate(columns)]
    natural = [max(t.cell_len for t in col) for col in cells]
    words = [max((cell_len(w) for t in col for w in t.plain.split()), default=1) for col in cells]
    # what the borders and the padding take: rich's own count (private, no public equivalent)
    room = console.width - table._extra_width - sum(table._get_padding_width(i) for i in range(len(columns)))
    widths = _narrowed(natural, words, [c.role for c in columns], room)
    if widths != natural:
        for column, w in zip(table.columns, widths, strict=True):
            column.width = w
    return table


def _narrowed(natural: list[int], words: list[int], roles: list[str], room: int) -> list[int]:
    """Column widths summing to at most `room` where a `key` column can stay whole: one character at a time,
    from the widest column that is not a `key` and is above its floor. The floors: a `prose` column keeps
    PROSE_MIN_WIDTH, an `other` one its longest word; one character where those leave too little room."""
    widths = list(natural)
    usual = [w if role == "key" else min(w, PROSE_MIN_WIDTH if role == "prose" else word)
             for w, word, role in zip(natural, words, roles, strict=True)]
    last = [w if role == "key" else 1 for w, role in zip(natural, roles, strict=True)]
    for floors in (usual, last):
        while sum(widths) > room:
            shrinkable = [i for i in range(len(widths)) if widths[i] > floors[i]]
            if not shrinkable:
                break
            widths[max(shrinkable, key=lambda i: widths[i])] -= 1
    return widths

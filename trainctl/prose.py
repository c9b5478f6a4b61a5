"""Sentences wrapped to a rich console's width, continuation lines indented under the text. No torch.

The CLI's consoles never wrap by themselves (cli/console.py: a path or a job id cut in two breaks copy-paste),
so prose that holds no such token (notes, warnings, explanations) is wrapped here, at spaces.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text


def prose(console: Console, text: str, lead: str = "") -> None:
    """`lead` + `text` (both rich markup), wrapped to the console's width; later lines start under `text`."""
    head = Text.from_markup(lead)
    body = Text.from_markup(text)
    for i, line in enumerate(body.wrap(console, max(20, console.width - head.cell_len))):
        line.rstrip()
        console.print(Text.assemble(head if i == 0 else " " * head.cell_len, line), soft_wrap=True)

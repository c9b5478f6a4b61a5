"""The person's terminal: writes to it that survive its going away, its width handed to the ranks, and prose
wrapped to a console's width. No torch.

A terminal that closes (a pty whose other side is gone: EIO), or a pipe whose reader quit (`trainctl launch |
head`: EPIPE), must not end a launcher that still has ranks to stop and a run to record. The first write that
fails so puts /dev/null in place of that stream's file descriptor: every later write to it, rich's, print's,
a traceback's and the interpreter's last flush at exit included, then goes nowhere instead of failing.

The ranks' stdout goes through torchrun to the launcher, so no rank sees the terminal: the launcher puts the
terminal's width in TRAINCTL_COLUMNS when it starts torchrun, and rank 0 prints its per-step line in a compact
form when that is narrower than COMPACT_BELOW. Without a terminal (a pipe, a log, Slurm) the variable is unset
and the line keeps its full form.

What trainctl shows of text it did not write (a run's name, a path, a value from a spec or a run directory a
stranger made) goes through `printable` (or `escape`, for rich markup) first: a control character in it is
shown as an escape (`\\x1b`), never sent, so a name cannot clear the screen, retitle the window or overwrite a
line (carriage return, backspace). Newlines and tabs stay: they are how our own messages are laid out.

The CLI's consoles never wrap by themselves (cli/console.py: a path or a job id cut in two breaks copy-paste),
so prose that holds no such token (notes, warnings, explanations) is wrapped here (`prose`), at spaces.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.console import Console

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


# C0 controls but newline and tab, DEL, and the C1 controls (U+0080..U+009F: U+009B is a one-character CSI)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with every control character but newline and tab written as a Python escape (ESC as `\\x1b`)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def escape(text: str) -> str:
    """`text` as rich markup that prints as written: `printable`, with rich's markup characters escaped."""
    from rich.markup import escape as rich_escape  # imported here: `trainctl --help` never loads rich

    return rich_escape(printable(text))


GONE = (errno.EIO, errno.EPIPE, errno.ENXIO, errno.EBADF)  # the terminal or the pipe's reader went away


def write(stream: TextIO, text: str) -> None:
    """Write and flush `text`; when the terminal is gone, drop it (and all that follows on this stream)."""
    try:
        stream.write(text)
        stream.flush()
    except OSError as e:
        if e.errno not in GONE:
            raise
        detach(stream)


def detach(stream: TextIO) -> None:
    """/dev/null in place of the stream's file descriptor, and of stdout's or stderr's where it is the same
    terminal (the stream objects stay usable)."""
    with contextlib.suppress(OSError, ValueError):
        fd = stream.fileno()
        gone = os.fstat(fd)
        same = [fd, *(other for other in (1, 2) if other != fd and _same_file(other, gone))]
        null = os.open(os.devnull, os.O_WRONLY)
        for each in same:
            os.dup2(null, each)
        os.close(null)


def _same_file(fd: int, st: os.stat_result) -> bool:
    try:
        other = os.fstat(fd)
    except OSError:
        return False
    return (other.st_dev, other.st_ino, other.st_rdev) == (st.st_dev, st.st_ino, st.st_rdev)


@contextlib.contextmanager
def guarded(stream: TextIO) -> Iterator[None]:
    """For writers that are not ours (rich's Console.print): a gone terminal detaches the stream."""
    try:
        yield
    except OSError as e:
        if e.errno not in GONE:
            raise
        detach(stream)


def prose(console: Console, text: str, lead: str = "") -> None:
    """`lead` + `text` (both rich markup), wrapped to the console's width; later lines start under `text`."""
    from rich.text import Text  # imported here: the ranks use this module and print no prose

    head = Text.from_markup(lead, emoji=False)
    body = Text.from_markup(text, emoji=False)
    for i, line in enumerate(body.wrap(console, max(20, console.width - head.cell_len))):
        line.rstrip()
        console.print(Text.assemble(head if i == 0 else " " * head.cell_len, line), soft_wrap=True)

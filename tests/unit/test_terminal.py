"""Writes to a terminal that went away (trainctl/terminal.py) and the handler check the launcher signals by
(launch/procs.handles), on a real pty and real processes."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys

from trainctl import terminal
from trainctl.launch.procs import handles


def test_a_write_to_a_closed_pty_is_dropped_and_so_is_all_that_follows() -> None:
    master, slave = pty.openpty()
    copy = os.dup(slave)  # the stream's descriptor; `slave` stays as the same terminal on another one
    stream = os.fdopen(copy, "w")
    terminal.write(stream, "seen\n")
    assert os.read(master, 100) == b"seen\r\n"
    os.close(master)  # the terminal goes away: the next write fails with EIO
    terminal.write(stream, "lost\n")
    terminal.write(stream, "lost too\n")
    assert os.path.samefile(f"/proc/self/fd/{copy}", os.devnull)  # detached: every later write goes nowhere
    stream.close()
    os.close(slave)


def test_handles_tells_a_handler_from_the_default_action() -> None:
    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: None); "
            "print('ready', flush=True); time.sleep(60)")
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        assert handles(proc.pid, signal.SIGTERM)
        assert not handles(proc.pid, signal.SIGUSR2)  # never installed: its default action would kill it
        proc.kill()
    assert not handles(proc.pid, signal.SIGTERM)  # gone


def test_a_name_with_colons_prints_as_written_not_as_an_emoji(capsys) -> None:
    """rich draws ':thumbs_up:' as an emoji by default; a run directory or data path may hold such a word."""
    from trainctl.cli.console import Col, fitted_table, make_console

    name = "/data/run:thumbs_up:1"
    console = make_console()
    console.print(name)
    console.print(fitted_table(console, [Col("run", role="key")], [[name]]))
    terminal.prose(console, name, lead="dir ")
    assert capsys.readouterr().out.count(name) == 3

"""The `trainctl` command as a user runs it, in its own process: the one helper every test drives the CLI with.
(Tests that need the process while it runs, to signal it or read it line by line, start it with Popen and
`TRAINCTL` themselves.)"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from paths import REPO

TRAINCTL = [sys.executable, "-m", "trainctl"]
CONSOLE_SCRIPT = Path(sys.executable).with_name("trainctl")  # the installed command: not `python -m`, which imports ./


def trainctl(*args: str, cwd: Path | str = REPO, env: Mapping[str, str | None] | None = None,
             inherit_env: bool = True, prefix: Sequence[str] = (), installed: bool = False,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`trainctl ARGS` run from `cwd` (the repository unless told) with no terminal on stdin; its exit status and
    its stdout and stderr as text.

    env: variables set over this process's environment (a None value removes one); with inherit_env=False,
    the whole environment. prefix: a command the CLI runs under (e.g. setpriv dropping a capability).
    installed: run the installed console script, as a user who cloned the repository does, instead of
    `python -m trainctl` (which imports from `cwd`: see clone_parent).
    timeout: seconds before the test fails as hung; a command that trains for longer says so."""
    base = dict(os.environ) if inherit_env else {}
    merged = {k: v for k, v in {**base, **(env or {})}.items() if v is not None}
    command = [str(CONSOLE_SCRIPT)] if installed else TRAINCTL
    return subprocess.run([*prefix, *command, *args], cwd=cwd, env=merged, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def clone_parent(tmp_path: Path) -> Path:
    """A directory whose `./trainctl/` is a git clone of the project (a folder without the package's __init__.py),
    where a user who cloned the repository and installed it stands: a launch from there must not import it."""
    parent = tmp_path / "parent"
    (parent / "trainctl").mkdir(parents=True)
    (parent / "trainctl" / "pyproject.toml").write_text("[project]\nname = 'trainctl'\n")
    return parent

"""`trainctl --show-completion SHELL` and `--install-completion SHELL`: the script of the shell named.

typer's two options are flags that always detect the shell from the parent process, so a shell named after
them was left unread and, run from bash, `--show-completion zsh` printed bash's script. A shell named right
after either option is handled here, before typer parses; a bare option keeps typer's detection. The scripts
are typer's own, the ones its completion handler (the _TRAINCTL_COMPLETE variable) answers.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainctl.errors import UsageError

SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")
SHOW, INSTALL = "--show-completion", "--install-completion"
PROG = "trainctl"
COMPLETE_VAR = "_TRAINCTL_COMPLETE"


def named_shell(argv: Sequence[str]) -> tuple[str, str] | None:
    """(option, shell) where the root options before any command hold `--show-completion SHELL` or
    `--install-completion SHELL` (or OPTION=SHELL); None otherwise."""
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            return None  # a command: its own arguments are not ours
        option, eq, value = arg.partition("=")
        if option not in (SHOW, INSTALL):
            continue
        if eq:
            return option, value
        if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return option, argv[i + 1]
        return None
    return None


def answer(option: str, shell: str) -> None:
    """Print (SHOW) or install (INSTALL) the completion script of `shell`; UsageError for another word."""
    if shell not in SHELLS:
        raise UsageError(f"{option} {shell}: not a shell trainctl completes", hint=f"name one of {', '.join(SHELLS)}")
    from typer._completion_shared import get_completion_script, install  # typer's scripts, matching its handler

    if option == SHOW:
        print(get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=shell))
        return
    _, path = install(shell=shell, prog_name=PROG, complete_var=COMPLETE_VAR)
    print(f"{shell} completion installed in {path}; it takes effect in a new shell")

"""`trainctl --show-completion SHELL` prints the script that SHELL loads, and loaded there it completes
`trainctl la` to `launch`: bash always, zsh and fish where installed. The script is asked for from bash, as
a bash user writes it to a file for another shell (typer alone detected the asking shell and printed bash's
script for every name)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Each shell loads the script (SCRIPT) as a user's rc file would, then asks what `trainctl la<TAB>` offers.
LOAD_AND_COMPLETE = {
    # bash calls the function with the command, the word and the previous word, COMP_WORDS/COMP_CWORD set
    "bash": 'source "$SCRIPT"; complete -p trainctl; '
            'COMP_WORDS=(trainctl la); COMP_CWORD=1; _trainctl_completion trainctl la trainctl; '
            'printf "%s\\n" "${COMPREPLY[@]}"',
    # zsh: compinit's compdef registers the function; _arguments (what it hands the candidates to inside a
    # completion widget) prints them here
    "zsh": 'autoload -Uz compinit && compinit -u -D; source "$SCRIPT"; '
           'print -r -- "registered: $_comps[trainctl]"; _arguments() { print -r -- "$@" }; '
           'words=(trainctl la); CURRENT=2; _trainctl_completion',
    "fish": "source $SCRIPT; complete -C'trainctl la'",
}
SHELL_COMMAND = {"bash": ["bash", "--norc", "--noprofile", "-c"], "zsh": ["zsh", "-f", "-c"],
                 "fish": ["fish", "--no-config", "-c"]}


def _in_shell(shell: str, script: str, home: Path, **variables: str) -> subprocess.CompletedProcess[str]:
    bin_dir = str(Path(sys.executable).parent)  # this environment's `trainctl`
    env = {**os.environ, "HOME": str(home), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), **variables}
    return subprocess.run([*SHELL_COMMAND[shell], script], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_script_loads_and_completes_in_its_shell(shell: str, tmp_path: Path):
    if shell != "bash" and shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    script = tmp_path / f"trainctl.{shell}"
    made = _in_shell("bash", f"trainctl --show-completion {shell} > {script}", tmp_path)
    assert made.returncode == 0, made.stderr
    out = _in_shell(shell, LOAD_AND_COMPLETE[shell], tmp_path, SCRIPT=str(script))
    assert out.returncode == 0, out.stderr
    offered = [line.split("\t")[0] for line in out.stdout.splitlines()]
    if shell == "bash":
        assert "complete -o default -F _trainctl_completion trainctl" in offered
        assert "launch" in offered, out.stdout
    elif shell == "zsh":
        assert "registered: _trainctl_completion" in offered, out.stdout
        assert any('"launch":' in line for line in offered), out.stdout
    else:
        assert "launch" in offered, (out.stdout, out.stderr)


def test_completion_for_a_shell_it_does_not_know_is_one_line(tmp_path: Path):
    out = _in_shell("bash", "trainctl --show-completion tcsh", tmp_path)
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["error: --show-completion tcsh: not a shell trainctl completes",
                                       "hint: name one of bash, zsh, fish, powershell, pwsh"]

"""What the ranks start in besides what each launcher sets itself: the spec's variables (launcher.nccl's
NCCL_* names, then launcher.env), launcher.setup's shell lines and the bash that runs them, and which paths
a container must see. No torch. (docs/design/launch.md, "Containers and environment")

Setup lines are the user's shell, written verbatim; everything trainctl adds around them is its own text or
shell-quoted. Each line runs as its own brace group in the current shell (so `export` and `source` reach
what follows, and a multi-line item such as an `if` block stays whole), and its status is checked: a failing
line stops the run before the trainer starts, with a `setup_failed` event naming it.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

from trainctl.checkpoint.location import resolve_checkpoint_dir
from trainctl.errors import UsageError
from trainctl.rundir.paths import shell_fresh_line
from trainctl.rundir.runstate import SETUP_FAILED
from trainctl.spec import RunSpec

TASK_FAIL = "trainctl_setup_failed"  # the shell function a task's setup calls on a failing line


def spec_variables(spec: RunSpec) -> dict[str, str]:
    """Every variable the spec sets for the ranks: launcher.nccl's, then launcher.env (a rule keeps them apart)."""
    return {**spec.launcher.nccl.variables(), **spec.launcher.env}


def guarded(lines: Sequence[str], on_fail: str) -> list[str]:
    """bash lines running each setup line, then `ON_FAIL INDEX STATUS` when it fails."""
    out: list[str] = []
    for i, line in enumerate(lines):
        out += ["{ " + line, f'}} || {on_fail} {i} "$?"']
    return out


def check_setup(lines: Sequence[str]) -> None:
    """Refuse (exit 2) a setup line that is not a complete shell command: in the batch script an unclosed
    quote would swallow the rest of the script. `bash -n` parses without running anything."""
    for i, line in enumerate(lines):
        script = "\n".join(guarded([line], "false")) + "\n"
        try:
            proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return  # no bash here: the job's own shell reports it
        if proc.returncode != 0:
            why = (proc.stderr.strip().splitlines() or ["syntax error"])[-1].removeprefix("bash: ")
            raise UsageError(f"launcher.setup[{i}] = {line!r} is not a complete shell command ({why})",
                             hint="close every quote, bracket and block within the one item")


def task_setup(lines: Sequence[str], events: Path | str) -> list[str]:
    """bash lines that run the setup where the batch script's `event` function does not exist (a task of the
    step, local torchrun's shell): a failing line is appended to `events` as a setup_failed event, said on
    stderr, and ends the shell with its status."""
    node = "${SLURMD_NODENAME:-$(hostname)}"
    target = shlex.quote(str(events))
    return [
        f"{TASK_FAIL}() {{  # INDEX STATUS: one line of {Path(events).name}, one line on stderr, exit",
        f'    printf {shell_fresh_line(target)}'
        f'\'{{"time":%s,"event":"{SETUP_FAILED}","item":%d,"exit_code":%d,"host":"%s","pid":%d}}\\n\' '
        f'"$(date +%s.%N)" "$1" "$2" "{node}" "$$" >>{target}',
        f'    echo "trainctl: launcher.setup[$1] failed (status $2) on {node}" >&2',
        '    exit "$2"',
        "}",
        *guarded(lines, TASK_FAIL),
    ]


def exec_after_setup(lines: Sequence[str], events: Path | str) -> str:
    """A `bash -c` script: the setup, then `exec "$@"` (the command keeps the shell's pid)."""
    return "\n".join([*task_setup(lines, events), 'exec "$@"'])


def container_warnings(spec: RunSpec, run_dir: Path, python: str) -> list[str]:
    """Paths the step needs that no launcher.container.mounts entry shows at the same path inside the
    container. A warning, not an error: the site's enroot configuration may mount them (home, scratch)."""
    c = spec.launcher.container
    if c is None:
        return []
    same = [Path(src) for src, _, dst in (_mount_paths(m) for m in c.mounts) if Path(src) == Path(dst)]
    needed = [("the run directory", run_dir), ("the checkpoint directory", resolve_checkpoint_dir(run_dir, spec))]
    needed += [("data", Path(s.path).absolute()) for s in spec.data.sources()]
    if python.startswith("/"):
        needed.append(("launcher.python", Path(python)))
    out = []
    for what, path in needed:
        if any(path == m or m in path.parents for m in same):
            continue
        fix = (f"mount {path.parent}, or set launcher.python to the image's interpreter" if what == "launcher.python"
               else f"add {path}:{path} to launcher.container.mounts")
        out.append(f"{what} {path} is not under a launcher.container.mounts entry mounted at the same path: the "
                   f"container sees it only if the site's enroot configuration mounts it ({fix})")
    return out


def _mount_paths(mount: str) -> tuple[str, str, str]:
    """(src, flags, dst) of SRC[:DST[:FLAGS]]; pyxis's short form SRC mounts it at the same path."""
    src, _, rest = mount.partition(":")
    dst, _, flags = rest.partition(":")
    return src, flags, dst or src

"""What the ranks start in, seen from inside them (launcher.setup and launcher.python tests, local and Slurm).

`Probe.setup` are launcher.setup lines that export TRAINCTL_PROBE (computed by the shell, so the line ran as
code), put a directory holding a sitecustomize.py on PYTHONPATH, and record where they ran (the Slurm step
id: unset in the batch script, 0 in a task). Every python started with that directory on its path runs the
sitecustomize at start-up, and a rank (RANK set) writes `rank-<RANK>-<pid>` holding the TRAINCTL_PROBE and
NCCL_DEBUG it sees (JSON): the variables reached the rank's own environment. `Probe.python` is a
launcher.python that records the TRAINCTL_PROBE it was started with and the module it runs, then execs this
interpreter."""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

PROBE_VALUE = "setup 42"  # what `$((6 * 7))` in the setup line makes of it


@dataclass(frozen=True)
class Probe:
    root: Path

    @property
    def setup(self) -> list[str]:
        q = shlex.quote
        return ['export TRAINCTL_PROBE="setup $((6 * 7))"',
                f"export PYTHONPATH={q(str(self.root / 'site'))}${{PYTHONPATH:+:$PYTHONPATH}}",
                f'echo "${{SLURM_STEP_ID:-none}}" >> {q(str(self.root / "setup-ran"))}']

    @property
    def python(self) -> str:
        return str(self.root / "python")

    def where_setup_ran(self) -> list[str]:
        return (self.root / "setup-ran").read_text().split()

    def python_saw(self, module: str = "torch.distributed.run") -> list[str]:
        """The TRAINCTL_PROBE of each start of launcher.python that ran `-m module`."""
        lines = (self.root / "python-ran").read_text().splitlines()
        return [seen for seen, _, m in (ln.partition("|") for ln in lines) if m == module]

    def ranks_saw(self) -> dict[int, dict[str, str | None]]:
        """RANK -> the variables its process started with (one entry per rank process)."""
        return {int(p.name.split("-")[1]): json.loads(p.read_text()) for p in sorted(self.root.glob("rank-*"))}


def make_probe(root: Path) -> Probe:
    site = root / "site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(
        "import json, os\n"
        "if 'RANK' in os.environ:  # a rank (torchrun and the batch shell's python have none)\n"
        f"    with open(os.path.join({str(root)!r}, f\"rank-{{os.environ['RANK']}}-{{os.getpid()}}\"), 'w') as f:\n"
        "        json.dump({k: os.environ.get(k) for k in ('TRAINCTL_PROBE', 'NCCL_DEBUG')}, f)\n")
    wrapper = root / "python"
    record = shlex.quote(str(root / "python-ran"))
    wrapper.write_text(f'#!/bin/sh\nprintf "%s|%s\\n" "${{TRAINCTL_PROBE:-}}" "$2" >> {record}\n'
                       f'exec {shlex.quote(sys.executable)} "$@"\n')
    wrapper.chmod(0o755)
    return Probe(root)

"""What `trainctl --help` costs: the modules it imports. Help, completion and every command's --help load the
CLI's own modules and the base layer; the spec models (pydantic classes built at import), the planner, the
launcher, the reports, YAML, rich's tables, numpy and torch wait for a command that needs them."""

from __future__ import annotations

import json
import subprocess
import sys

from paths import REPO

# every module of trainctl the help may import: the CLI and the base layer
HELP_MAY_IMPORT = ("trainctl.cli", "trainctl.errors", "trainctl.fileio", "trainctl.terminal", "trainctl.units")
NEVER_FOR_HELP = ("torch", "numpy", "yaml", "rich.table", "trainctl.spec.models")

PROBE = r"""
import contextlib, io, json, sys
from trainctl.cli.app import _register, app, main

def run(argv):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)

run(["--help"])
first = sorted(sys.modules)
_register()
import typer.main
for name in sorted(typer.main.get_command(app).commands):  # every command's and group's own --help
    run([name, "--help"])
run(["--show-completion", "bash"])
print(json.dumps({"help": first, "all": sorted(sys.modules)}))
"""


def imported() -> dict[str, list[str]]:
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_help_and_every_commands_help_import_only_the_cli_and_the_base_layer() -> None:
    mods = imported()
    for case in ("help", "all"):
        ours = [m for m in mods[case] if m.startswith("trainctl.")]
        assert "trainctl.cli.plan_cmd" in ours  # the commands were registered
        assert [m for m in ours if not m.startswith(HELP_MAY_IMPORT)] == [], case
        assert [m for m in mods[case] if m.split(".")[0] in NEVER_FOR_HELP or m in NEVER_FOR_HELP] == [], case

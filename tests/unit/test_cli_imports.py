"""What `trainctl --help` costs: the modules it imports. Help, completion and every command's --help load the
CLI's own modules and the base layer; the spec models (pydantic classes built at import), the planner, the
launcher, the reports, YAML, rich's tables, numpy and torch wait for a command that needs them."""

from __future__ import annotations

import json
import subprocess
import sys

from paths import REPO

from trainctl.cli.app import COMMAND_MODULES, _register, app

# every module of trainctl the help may import: the CLI and the base layer
HELP_MAY_IMPORT = ("trainctl.cli", "trainctl.errors", "trainctl.fileio", "trainctl.terminal", "trainctl.units")
NEVER_FOR_HELP = ("torch", "numpy", "yaml", "rich.console", "rich.table", "trainctl.spec.models")

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


def test_the_command_table_names_the_module_that_registers_each_command() -> None:
    _register()
    registered = {(c.name or c.callback.__name__): c.callback.__module__ for c in app.registered_commands}
    for group in app.registered_groups:
        registered[group.name] = {c.callback.__module__ for c in group.typer_instance.registered_commands}.pop()
    assert registered == {name: f"trainctl.cli.{module}" for name, module in COMMAND_MODULES.items()}


def test_a_command_imports_only_its_own_command_module() -> None:
    probe = ("import contextlib, io, sys\nfrom trainctl.cli.app import main\n"
             "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
             "    main(['--debug', 'plan', '--help'])\n"
             "print(sorted(m for m in sys.modules if m.startswith('trainctl.cli.') and m.endswith(('_cmd', '_cmds'))))")
    r = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["['trainctl.cli.plan_cmd']"]

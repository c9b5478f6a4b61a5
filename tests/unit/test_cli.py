"""The CLI as a user runs it: exit codes, one-line errors, and no torch on the fast paths."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cli_utils import trainctl
from paths import REPO as ROOT

TINY = str(ROOT / "recipes" / "tiny-cpu.yaml")

# Runs the CLI in-process, then reports which heavy modules the command imported.
_PROBE = """
import sys
from trainctl.cli.app import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
else:
    code = 0
heavy = [m for m in ("torch", "numpy") if m in sys.modules]
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


def probed(*args: str) -> subprocess.CompletedProcess[str]:
    """`trainctl ARGS` run by _PROBE, its stderr ending in the heavy modules the command imported."""
    return subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("args", [["--help"], ["validate", TINY], ["plan", TINY], ["plan", "--auto", TINY],
                                  ["hardware"], ["schema"]])
def test_fast_commands_do_not_import_torch(args):
    out = probed(*args)
    assert out.returncode == 0, out.stderr
    assert "HEAVY=\n" in out.stderr or out.stderr.rstrip().endswith("HEAVY="), out.stderr[-500:]


def test_validate_ok():
    out = trainctl("validate", TINY)
    assert out.returncode == 0 and "tp 2 x pp 2 x dp 2" in out.stdout


def test_output_lines_never_wrap_on_a_narrow_terminal(tmp_path):
    # CI logs and pipes are 80 columns to rich; a long path once split "dp 2" across two lines.
    deep = tmp_path.joinpath(*["a-long-directory-name"] * 6)
    deep.mkdir(parents=True)
    spec = deep / "tiny.yaml"
    spec.write_text(Path(TINY).read_text())
    out = trainctl("validate", str(spec), env={"COLUMNS": "40"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n") == 1 and str(spec) in out.stdout and "dp 2" in out.stdout


def test_validate_json_is_the_resolved_spec():
    out = trainctl("validate", TINY, "--json")
    data = json.loads(out.stdout)
    assert data["parallel"]["dp"] == 2 and data["model"]["ffn_hidden"] == 256


@pytest.mark.parametrize(
    "args, needle",
    [
        (["validate", TINY, "--set", "parallel.dp=3"], "parallel.dp = 3"),
        (["validate", "missing.yaml"], "missing.yaml: no such file"),
        (["validate", TINY, "--set", "parallel.typo=1"], "parallel.typo: unknown key"),
        (["validate", TINY, "--set", "nonsense"], "expected KEY.PATH=VALUE"),
    ],
)
def test_spec_errors_exit_2_with_one_clear_line(args, needle):
    out = trainctl(*args)
    assert out.returncode == 2
    # one error line; a rule the error keeps from judging says so on a note line (dp 3: the batch rules)
    lines = [ln for ln in out.stderr.strip().splitlines() if not ln.startswith("note: ")]
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_checkpoints_of_a_directory_that_is_not_a_run_exits_2(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("not a run")
    cases = [([str(tmp_path)], "not a run directory (no spec.yaml, job.json or checkpoints/)"),
             ([str(tmp_path / "missing")], "no such run directory"),
             ([str(tmp_path), "--dir", str(tmp_path / "missing")], "no such directory")]
    for args, needle in cases:
        for extra in ([], ["--json"]):
            out = trainctl("checkpoints", *args, *extra)
            assert out.returncode == 2 and out.stdout == "", (args, out.stdout)
            errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
            assert len(errors) == 1 and needle in errors[0], out.stderr
    # a run directory that has no checkpoints yet is a run: an empty list, exit 0
    (tmp_path / "spec.yaml").write_text(Path(TINY).read_text())
    out = trainctl("checkpoints", str(tmp_path))
    assert out.returncode == 0 and "no checkpoints in" in out.stdout, out.stderr


def test_usage_error_exits_2():
    out = trainctl("resume")
    assert out.returncode == 2 and "Missing argument" in out.stderr


def test_plan_and_validate_without_a_spec_take_the_embedded_recipe_as_launch_does(tmp_path: Path):
    # from an empty directory: the default is the package's own recipe, the quickstart's
    out = trainctl("validate", cwd=tmp_path)
    assert out.returncode == 0 and "tiny-cpu" in out.stdout and "tiny-cpu.yaml" in out.stdout, out.stderr
    default, named = trainctl("plan", "--json", cwd=tmp_path), trainctl("plan", TINY, "--json")
    assert default.returncode == 0, default.stderr
    assert json.loads(default.stdout) == json.loads(named.stdout)


def test_debug_shows_traceback():
    out = trainctl("--debug", "validate", "missing.yaml")
    assert out.returncode != 0 and "Traceback" in out.stderr


# A command with a bug in it, added to the real app: what no check foresaw still ends in one line.
_BUG = """
import sys
from trainctl.cli.app import app, main


@app.command("bug")
def bug() -> None:
    raise RuntimeError("[/x] broke\\nits second line")


main(sys.argv[1:])
"""


def test_a_bug_prints_one_line_and_keeps_its_traceback(tmp_path: Path) -> None:
    """An exception trainctl did not foresee: one line naming it, exit 1, and the traceback in a file under
    $XDG_STATE_HOME/trainctl that the line names (a rich MarkupError in `status` printed 40 lines of traceback);
    --debug prints the traceback instead."""
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", _BUG, "bug"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    first, hint = r.stderr.splitlines()
    assert first == "error: internal error (a bug in trainctl): RuntimeError: [/x] broke", r.stderr
    assert hint.startswith(f"hint: the traceback is in {tmp_path / 'trainctl'}/crash-") and hint.endswith(
        ".txt; please report it"), hint
    saved = Path(hint.removeprefix("hint: the traceback is in ").removesuffix("; please report it")).read_text()
    assert "args: ['bug']" in saved and "Traceback (most recent call last)" in saved
    assert "RuntimeError: [/x] broke\nits second line" in saved
    debug = subprocess.run([sys.executable, "-c", _BUG, "--debug", "bug"], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=120)
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr, debug.stderr


def test_schema_is_json_schema_with_sections():
    data = json.loads(trainctl("schema").stdout)
    assert {"model", "parallel", "train", "cluster"} <= set(data["properties"])


def test_hardware_table_shows_whole_numbers_intact():
    # Regression: stripping trailing zeros turned a 40 GB A100 into "4" and 80 GB into "8".
    out = trainctl("hardware")
    row = next(line for line in out.stdout.splitlines() if "a100-40gb" in line)
    assert [c.strip() for c in row.split("│")][1:6] == ["a100-40gb", "312", "156", "19.5", "40"]


def test_every_independent_spec_error_is_reported_at_once():
    """A world-size mistake no longer hides the model-vs-TP ones (they need no dp); tp's misfits are one line."""
    out = trainctl("validate", str(ROOT / "recipes" / "llama3-8b.yaml"), "--set", "parallel.tp=3",
                   "--set", "parallel.dp=16")
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "parallel.tp = 3: model.heads=32 is not divisible by tp; model.kv_heads=8 is not "
    "divisible by tp. Fix: use a tp that fits them all: 1, 2, 4, 8" in lines[0], out.stderr
    # (tp 2 with dp 16 fills the 32 GPUs: the world size is tp's mistake, not dp's.) A world-size mistake of dp's
    # own is its line, and the batch rules it leaves without a dp say they were not checked
    out = trainctl("validate", str(ROOT / "recipes" / "llama3-8b.yaml"), "--set", "parallel.dp=3")
    assert [ln.split(": ", 2)[2][:40] for ln in out.stderr.splitlines()] == [
        "parallel.dp = 3: tp*pp*dp = 2*1*3 = 6 bu", "train.global_batch: not checked: its div"], out.stderr


def test_one_validate_names_every_mistake_of_a_spec_one_line_each(tmp_path):
    """tp 3, warmup past steps, global_batch 15 and gpu `cpuu` in one file: one `validate` names all four, each
    once. global_batch's divisibility by micro_batch*dp used to wait for tp to be fixed (tp*pp*dp was off, and
    the batch rules returned); now every rule that uses tp is judged with each tp the model allows (1, 2, 4), and
    a problem counts when it stands with all of them that let its rule judge: dp 2 with tp 2 fills the 8 ranks,
    so 15 over micro_batch*dp = 2*2 = 4 is a mistake of its own, while tp*pp*dp = 12 is tp's (no line)."""
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: tiny-cpu\nmodel: {preset: tiny}\n"
                    "parallel: {tp: 3, pp: 2, dp: 2, zero: 1, sequence_parallel: true, micro_batch: 2, "
                    "schedule: 1f1b}\n"
                    "train: {global_batch: 15, steps: 20, lr: 1.0e-3, warmup: 30, precision: fp32, seed: 1234}\n"
                    "data: {synthetic: true}\ncheckpoint: {every_steps: 10, keep_last: 2}\n"
                    "cluster: {nodes: 1, gpus_per_node: 8, gpu: cpuu}\nlauncher: {backend: local, mode: torchrun}\n")
    out = trainctl("validate", str(spec))
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert all(ln.startswith(f"error: {spec}: ") for ln in lines), out.stderr  # nothing else: no note, no trace
    assert [ln.split(": ", 2)[2].split(":", 1)[0] for ln in lines] == [
        "parallel.tp = 3", "cluster.gpu = 'cpuu'", "train.global_batch = 15", "train.warmup = 30"], out.stderr
    assert "Fix: use a tp that fits them all: 1, 2, 4 (of these, 2 also fits every other rule that uses tp)" in lines[0]
    assert "not divisible by micro_batch*dp = 2*2 = 4. Fix: use a multiple of 4, e.g. 12 or 16" in lines[2]
    # a rule another mistake keeps from judging says so: with dp 3 no tp the model allows fills 8 ranks, so the
    # batch rules have no dp to judge with
    out = trainctl("validate", str(spec), "--set", "parallel.dp=3")
    notes = [ln for ln in out.stderr.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and f"note: {spec}: train.global_batch: not checked:" in notes[0], out.stderr
    assert any("parallel.dp = 3: tp*pp*dp = 1*2*3 = 6" in ln for ln in out.stderr.splitlines()), out.stderr


def test_field_errors_and_cross_section_rules_are_reported_in_one_pass():
    """A field error (train.lr), an unknown key and a nested typo no longer hide the rules about the fields
    that did validate: tp=3 gets its one line (heads and kv_heads), all in one run."""
    out = trainctl("validate", TINY, "--set", "parallel.tp=3", "--set", "train.lr=-1", "--set", "train.foo=1",
                   "--set", "model.moe.num_expert=3", "--set", "data.blend=[{path: /b.bin, wieght: 1}]")
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    for needle in ("train.lr = -1: Input should be greater than 0", "train.foo: unknown key",
                   "model.moe.num_expert: unknown key. Fix: did you mean `num_experts`?",
                   "data.blend.0.wieght: unknown key. Fix: did you mean `weight`?",
                   "parallel.tp = 3: model.heads=4 is not divisible by tp; model.kv_heads=4 is not divisible by tp"):
        assert sum(needle in ln for ln in lines) == 1, (needle, out.stderr)
    assert not any(ln.split(": ", 2)[-1].startswith("train.lr = 0.") for ln in lines), "a rule judged a default"
    # a field set aside is no ground for rules about it: tp=0 is one line, not also the world size with tp=1
    out = trainctl("validate", TINY, "--set", "parallel.tp=0")
    assert [ln for ln in out.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: {TINY}: parallel.tp = 0: Input should be greater than or equal to 1. Fix: use a value >= 1"]
    # nor for a section's own check: train.steps = 0 set aside is not also "give exactly one of train.steps and
    # train.tokens", which the section's check says of the stand-in (no steps)
    out = trainctl("validate", TINY, "--set", "train.steps=0")
    assert [ln for ln in out.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: {TINY}: train.steps = 0: Input should be greater than or equal to 1. Fix: use a value >= 1"]


def test_plan_counts_read_as_numbers_and_words():
    """16,384 GPUs on 2,048 nodes (separators), a Young/Daly interval of ~1 step (not "~1 steps")."""
    out = trainctl("plan", str(ROOT / "recipes" / "llama3-405b.yaml"), "--set", "checkpoint.mtbf_hours=0.2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("llama3-405b: 16,384 GPUs = tp 8 x pp 16 x dp 128 on 2,048 nodes x 8 h100-sxm")
    assert "(~1 step)" in out.stdout and "(~1 steps)" not in out.stdout


def test_a_bound_fix_agrees_with_its_rule_and_names_null():
    out = trainctl("validate", TINY, "--set", "train.grad_clip=0")
    assert out.returncode == 2
    assert "Fix: use a value > 0.0 (null turns clipping off)" in out.stderr


def test_version_and_help_without_type_placeholders():
    from trainctl import __version__

    out = trainctl("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"trainctl {__version__}"
    commands = [["--help"], ["plan", "--help"], ["launch", "--help"], ["resume", "--help"], ["status", "--help"],
                ["mfu-report", "--help"], ["data", "check", "--help"], ["checkpoints", "--help"]]
    for args in commands:
        out = trainctl(*args)
        assert out.returncode == 0, args
        assert "<bool>" not in out.stdout, (args, out.stdout)


def test_shell_completion_installs_and_completes(tmp_path: Path):
    user = {"HOME": str(tmp_path), "SHELL": "/bin/bash"}
    # the script click's handler sources for each shell (`--show-completion SHELL` and each shell loading
    # it: tests/unit/test_completion_shells.py)
    for shell in ("bash", "zsh", "fish"):
        out = trainctl(env={**user, "_TRAINCTL_COMPLETE": f"source_{shell}"})
        assert out.returncode == 0 and "trainctl" in out.stdout, (shell, out.stderr)
    # installed from a bash, as a user types it there (the `exit` keeps bash from exec'ing the command: bash
    # stays its parent, the shell it detects)
    out = subprocess.run(["bash", "-c", f"{shlex.quote(sys.executable)} -m trainctl --install-completion; exit $?"],
                         capture_output=True, text=True, env={**os.environ, **user}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / ".bash_completions" / "trainctl.sh").exists()
    assert "trainctl.sh" in (tmp_path / ".bashrc").read_text()
    # what bash asks while the user types `trainctl pl<TAB>` and `trainctl plan --au<TAB>`
    for words, cword, expect in (("trainctl pl", "1", "plan"), ("trainctl plan --au", "2", "--auto")):
        out = trainctl(env={**user, "_TRAINCTL_COMPLETE": "complete_bash", "COMP_WORDS": words,
                            "COMP_CWORD": cword})
        assert expect in out.stdout.split(), (words, out.stdout, out.stderr)

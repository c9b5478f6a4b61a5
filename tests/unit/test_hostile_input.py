"""What a spec, a `--set` or a hand-made run directory gives trainctl that it must not act on, through the real
CLI (docs/FAILURES.md, "Before anything runs"): an environment variable name that is shell code, a credential's
value, a file that never ends or never opens, terminal escape sequences in a run's name, a key given twice.
Each refusal is one line naming the field or file and the fix (exit 2); nothing here launches a run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_utils import trainctl
from paths import TINY_RECIPE

from trainctl.launch import secrets
from trainctl.spec.loader import MAX_SPEC_BYTES, safe_load

ESC_NAME = "a\x1b]0;owned\x07b\x1b[2J\r"  # sets the window title, clears the screen, returns to column 0


def one_error(out) -> str:
    """The one `error:` line of a refused command (exit 2, no traceback, nothing else on stderr)."""
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: "), line
    return line


# --- item 1: a launcher.env name is an environment variable name, on every backend --------------------------

@pytest.mark.parametrize("backend", ["local", "slurm"])
def test_an_env_name_that_is_shell_code_is_refused_before_anything_runs(tmp_path: Path, backend: str) -> None:
    marker = tmp_path / "ran"
    spec = tmp_path / "spec.yaml"
    spec.write_text(TINY_RECIPE.read_text().replace("launcher: {backend: local, mode: torchrun}",
                                                    f"launcher:\n  backend: {backend}\n"
                                                    f"  env:\n    'BAR;touch {marker}': v\n"))
    # was, locally: `export BAR;touch ...=v` in RUN/launch.sh, and printed so by --dry-run
    for args in (["launch", str(spec), "--dry-run", "--run-dir", str(tmp_path / "run")],
                 *([["launch", str(spec), "--run-dir", str(tmp_path / "run")]] if backend == "local" else [])):
        line = one_error(trainctl(*args))
        assert f"launcher.env = 'BAR;touch {marker}': not an environment variable name. Fix: use letters, " \
               "digits and underscores" in line, line
    assert not marker.exists() and not (tmp_path / "run").exists()


# --- item 2: every documented credential pattern stays out of --dry-run's output ----------------------------

def credential_examples() -> dict[str, str]:
    """One name per pattern of trainctl/launch/secrets.py (each name matching that pattern only), with a value
    found nowhere else."""
    names = ([f"MY{p}1" for p in secrets.CREDENTIAL_ANYWHERE] + [f"X_{w}" for w in secrets.CREDENTIAL_WORDS]
             + [f"GH{e}" for e in secrets.CREDENTIAL_WORD_ENDINGS] + ["SecretKey", "mypassword1", "hf_token"])
    return {n: f"value-{i}-{os.urandom(4).hex()}" for i, n in enumerate(names)}


def test_every_credential_pattern_is_documented_and_matched() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "launching.md").read_text()
    for pattern in (*secrets.CREDENTIAL_ANYWHERE, *secrets.CREDENTIAL_WORDS, *secrets.CREDENTIAL_WORD_ENDINGS):
        assert pattern in doc, pattern  # the one list and what the user reads agree
    assert all(secrets.looks_like_credential(n) for n in credential_examples())


@pytest.mark.parametrize("backend", ["local", "slurm"])
def test_dry_run_prints_no_credential_value(tmp_path: Path, backend: str) -> None:
    examples = credential_examples()
    sets = [x for n, v in examples.items() for x in ("--set", f"launcher.env.{n}={v}")]
    layout = [] if backend == "local" else ["--set", "launcher.backend=slurm", "--set", "cluster.nodes=2",
                                            "--set", "cluster.gpus_per_node=4"]
    out = trainctl("launch", str(TINY_RECIPE), "--dry-run", "--run-dir", str(tmp_path / "run"), *layout, *sets,
                   "--set", "launcher.env.MY_SETTING=visible-setting")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    shown = out.stdout + out.stderr
    assert [v for v in examples.values() if v in shown] == []
    for name in examples:
        assert f"launcher.env.{name} looks like a credential" in shown, name
    assert "visible-setting" in shown  # what is not a credential is shown as before


# --- item 3: a spec is a regular file of at most 1 MiB -------------------------------------------------------

@pytest.mark.parametrize(("command", "spec"), [(["validate"], "fifo"), (["validate"], "/dev/zero"),
                                               (["plan"], "/dev/zero"), (["launch", "--dry-run"], "fifo")])
def test_a_device_or_a_fifo_as_the_spec_is_refused_at_once(tmp_path: Path, command: list[str], spec: str) -> None:
    if spec == "fifo":
        spec = str(tmp_path / "spec.yaml")
        os.mkfifo(spec)
    line = one_error(trainctl(command[0], spec, *command[1:], timeout=60))  # was: a FIFO waited for a writer for
    if spec == "/dev/zero":  # ever, /dev/zero was read until memory ran out
        assert "/dev/zero: is a character device, not a spec file. Fix: pass the path of a .yaml file" in line, line
    else:
        assert f"{spec}: is a named pipe (FIFO), not a spec file. Fix: pass the path of a .yaml file" in line, line


def test_a_calibration_profile_that_is_a_device_is_refused_at_once() -> None:
    out = trainctl("plan", str(TINY_RECIPE), "--calibration", "/dev/zero", timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out
    assert out.stderr.splitlines()[0] == "error: calibration profile /dev/zero: is a character device, not a " \
                                         "profile file", out.stderr


def test_a_spec_is_read_up_to_1_mib(tmp_path: Path) -> None:
    text = TINY_RECIPE.read_text()
    at_limit = tmp_path / "at-limit.yaml"
    at_limit.write_text(text + "#" * (MAX_SPEC_BYTES - len(text.encode()) - 1) + "\n")
    assert at_limit.stat().st_size == MAX_SPEC_BYTES == 1 << 20
    assert trainctl("validate", str(at_limit)).returncode == 0
    over = tmp_path / "over.yaml"
    over.write_text(at_limit.read_text() + "\n")
    line = one_error(trainctl("validate", str(over)))
    assert f"{over}: file is larger than 1 MiB (1,048,576 bytes), the most a spec may be" in line, line


def test_a_run_directory_whose_spec_is_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text(json.dumps({"backend": "local", "attempts": []}))
    os.mkfifo(run / "spec.yaml")
    line = one_error(trainctl("resume", str(run), timeout=60))
    assert f"{run / 'spec.yaml'}: is a named pipe (FIFO), not a spec file" in line, line
    assert trainctl("status", str(run), timeout=60).returncode == 0  # shown without the spec's fields


# --- item 5: what a name holds is shown, never acted on --------------------------------------------------

def test_control_characters_in_a_spec_name_are_refused_and_shown_escaped(tmp_path: Path) -> None:
    out = trainctl("validate", str(TINY_RECIPE), "--set", f"name={ESC_NAME}")
    line = one_error(out)
    assert "name = 'a\\x1b]0;owned\\x07b\\x1b[2J\\r': holds control characters" in line, line
    assert "\x1b" not in out.stdout + out.stderr


def test_status_and_runs_show_a_hand_made_name_escaped(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "hand"
    run.mkdir(parents=True)
    (run / "spec.yaml").write_text(json.dumps({"name": ESC_NAME}))  # JSON is YAML: the escapes stay escapes
    (run / "job.json").write_text(json.dumps({"backend": "local", "attempts": []}))
    shown = "a\\x1b]0;owned\\x07b\\x1b[2J\\x0d"
    for args in (["status", str(run)], ["runs", str(tmp_path / "runs")]):
        out = trainctl(*args, env={"COLUMNS": "200"})
        assert out.returncode == 0, out
        assert not any(c in out.stdout + out.stderr for c in "\x1b\x07\r"), repr(out.stdout)
        assert shown in out.stdout, out.stdout


# --- item 18: a key given twice is refused with both lines ---------------------------------------------------

def test_a_section_given_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(TINY_RECIPE.read_text() + "train:\n  lr: 0.5\n")
    first = 1 + next(i for i, ln in enumerate(TINY_RECIPE.read_text().splitlines()) if ln.startswith("train:"))
    last = len(TINY_RECIPE.read_text().splitlines()) + 1
    line = one_error(trainctl("validate", str(spec)))  # was: ok, the first train: section dropped
    assert line == (f"error: {spec}: key 'train' is given twice in one mapping, at line {first} and at line "
                    f"{last}; YAML would keep only the second. Fix: keep one (merge the two)"), line


def test_a_key_given_twice_in_a_set_value_or_a_section_is_refused(tmp_path: Path) -> None:
    line = one_error(trainctl("validate", str(TINY_RECIPE), "--set", "train={lr: 0.1, lr: 0.5}"))
    assert "--set 'train={lr: 0.1, lr: 0.5}': key 'lr' is given twice in one mapping, at line 1, columns 2 " \
           "and 11" in line, line
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: t\nmodel:\n  preset: tiny\n  layers: 2\n  layers: 4\n")
    line = one_error(trainctl("validate", str(spec)))
    assert "key 'layers' is given twice in one mapping, at line 4 and at line 5" in line, line


def test_a_merge_key_may_be_overridden() -> None:
    assert safe_load("base: &b {x: 1, y: 1}\nm:\n  <<: *b\n  x: 2\n") == {"base": {"x": 1, "y": 1},
                                                                         "m": {"x": 2, "y": 1}}

"""tracking: and train.profile: in the spec: defaults, rules with their fix, the extras check of the CLI, and
the metrics line's scalars."""

from __future__ import annotations

import subprocess
import sys

import pytest
from paths import REPO as ROOT
from spec_utils import one_problem

from trainctl.spec import load_spec_text

BASE = """
name: t
model: {layers: 2, hidden: 64, heads: 4, vocab: 256, seq_len: 32}
parallel: {dp: 4}
train: {global_batch: 8, steps: 10}
cluster: {nodes: 1, gpus_per_node: 4, gpu: cpu}
"""


def test_off_by_default_and_switches() -> None:
    spec = load_spec_text(BASE)
    assert spec.tracking.tensorboard is False and spec.tracking.wandb is None and spec.train.profile is None
    spec = load_spec_text(BASE, overrides=["tracking.tensorboard=true", "tracking.wandb=true",
                                           "train.profile.start_step=3"])
    assert spec.tracking.tensorboard and spec.tracking.wandb.mode == "offline"
    assert (spec.train.profile.start_step, spec.train.profile.last_step, spec.train.profile.ranks) == (3, 4, [0])
    assert load_spec_text(BASE, overrides=["tracking.wandb=false"]).tracking.wandb is None


@pytest.mark.parametrize(("overrides", "expected"), [
    (["train.profile.start_step=0"], "s.yaml: train.profile.start_step = 0: not a step of the run (1..train.steps = "
                                     "10). Fix: pick a step from 1 to 10"),
    (["train.profile.start_step=11"], "train.profile.start_step = 11: not a step of the run"),
    (["train.profile.start_step=3", "train.profile.steps=0"],
     "train.profile.steps = 0: a trace needs at least one step. Fix: use 1 or more"),
    (["train.profile.start_step=8", "train.profile.steps=4"],
     "train.profile.steps = 4: the window 8..11 runs past train.steps = 10. Fix: use steps <= 3, or an earlier "
     "start_step"),
    (["train.profile.start_step=3", "train.profile.ranks=[0,4]"],
     "train.profile.ranks = [4]: not ranks of this job (world size 4: ranks 0..3). Fix: use global ranks from 0 to 3"),
    (["train.profile.start_step=3", "train.profile.ranks=[]"], "train.profile.ranks = []: no rank would write a trace"),
    (["train.profile.start_step=3", "train.profile.ranks=[1,1]"], "train.profile.ranks = [1, 1]: a rank is listed "
                                                                  "twice"),
    (["tracking.wandb.mode=cloud"], "tracking.wandb.mode"),
])
def test_profile_and_tracking_rules_name_the_fix(overrides: list[str], expected: str) -> None:
    assert expected in one_problem(BASE, *overrides)


def test_a_window_ending_on_the_last_step_is_valid() -> None:
    spec = load_spec_text(BASE, overrides=["train.profile.start_step=9", "train.profile.steps=2",
                                           "train.profile.ranks=[0,3]"])
    assert spec.train.profile.last_step == 10


# The CLI in-process with tensorboard and wandb made unimportable (a None in sys.modules is Python's own way to
# block an import), reporting which of them, or torch, the command imported.
_PROBE = """
import sys
for name in sys.argv[1].split(","):
    if name:
        sys.modules[name] = None
from trainctl.cli.app import main
try:
    main(sys.argv[2:])
except SystemExit as e:
    code = e.code
else:
    code = 0
print("IMPORTED=" + ",".join(m for m in ("torch", "tensorboard", "wandb") if sys.modules.get(m) is not None),
      file=sys.stderr)
sys.exit(code)
"""
ON = ["--set", "tracking.tensorboard=true", "--set", "tracking.wandb.project=p"]
TINY = str(ROOT / "recipes" / "tiny-cpu.yaml")


def probe(blocked: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _PROBE, blocked, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_validate_with_tracking_on_finds_the_libraries_without_importing_them() -> None:
    out = probe("", "validate", TINY, *ON)
    assert out.returncode == 0, out.stderr
    assert out.stderr.rstrip().endswith("IMPORTED="), out.stderr[-500:]


@pytest.mark.parametrize("command", [["validate", TINY], ["launch", TINY, "--dry-run"]])
def test_a_missing_extra_is_one_line_naming_it_exit_2(command: list[str], tmp_path) -> None:
    if command[0] == "launch":
        command = [*command, "--run-dir", str(tmp_path / "run")]
    out = probe("tensorboard,wandb", *command, *ON)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    source = f"{TINY}: " if command[0] == "validate" else ""
    assert errors == [
        f"error: {source}tracking.tensorboard = True: the tensorboard package is not installed here. Fix: pip "
        "install 'trainctl[tensorboard]', or set tracking.tensorboard: false",
        f"error: {source}tracking.wandb = {{'project': 'p', 'entity': None, 'mode': 'offline'}}: the wandb package "
        "is not installed here. Fix: pip install 'trainctl[wandb]', or set tracking.wandb: null"]
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


def test_scalars_are_every_finite_number_of_the_metrics_line() -> None:
    from trainctl.runtime.observe.tracking import scalars

    rec = {"step": 7, "steps": 10, "time": 1.5e9, "loss": 2.5, "lr": 1e-3, "grad_norm": float("nan"), "mfu": 0.4,
           "tokens": 256, "peak_source": "catalog", "skipped": True, "profiled": True,
           "moe": {"imbalance": 1.2, "tokens_per_expert": [3, 4]}, "memory": {"per_rank": [{"weights": 1}],
                                                                            "max": {"weights": 10}}}
    assert scalars(rec) == {"train/loss": 2.5, "train/lr": 1e-3, "perf/mfu": 0.4, "perf/tokens": 256.0,
                            "moe/imbalance": 1.2, "memory/max/weights": 10.0}

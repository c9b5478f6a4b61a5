"""Checkpoints do not depend on the precision (docs/design/trainer.md, "FP8 training"): the tiny CPU recipe on two
ranks (DP2 with ZeRO-1: bf16 parameters over an fp32 master) launched in bf16 through the CLI, resumed with
`--set train.precision=fp8`, trained on in FP8 and resumed back in bf16. Each resume loads the master weights the
other precision saved, bit for bit (the ranks started at the checkpoint's own step load and write what they
loaded: the CLI refuses a resume with nothing to train), and training goes on from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_utils import trainctl
from resume_utils import set_spec
from trainer_utils import final_weights, metrics, run_trainer

pytestmark = pytest.mark.slow

# 2 ranks of the embedded tiny recipe (its layouts are the equivalence matrix's concern); bf16 autocast on the CPU
# (low_precision_on_cpu), so the bf16 run keeps bf16 parameters and an fp32 master under ZeRO-1, as on a GPU
RANKS = 2
LAYOUT = ["--set", "parallel.tp=1", "--set", "parallel.pp=1", "--set", "parallel.sequence_parallel=false",
          "--set", f"cluster.gpus_per_node={RANKS}", "--set", "train.low_precision_on_cpu=true",
          "--set", "checkpoint.every_steps=2"]
DUMP = {"TRAINCTL_DUMP_WEIGHTS": "1"}  # the trainer writes the fp32 master, gathered, at its end


def _ok(r, what: str) -> None:
    assert r.returncode == 0, f"{what} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def _weights(run: Path, keep_as: str) -> dict[str, torch.Tensor]:
    w = final_weights(run)
    (run / "final_weights").rename(run / keep_as)
    return w


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == torch.float32 for k in a)


def _load_only(run: Path, precision: str) -> dict[str, torch.Tensor]:
    """The weights the ranks in `precision` load from the newest checkpoint, at train.steps already."""
    set_spec(run, train={"precision": precision})
    _ok(run_trainer(run, RANKS), f"{precision} load")
    return _weights(run, f"w-{precision}-loaded")


def _resume(run: Path, precision: str, steps: int, what: str) -> None:
    r = trainctl("resume", str(run), "--set", f"train.precision={precision}", "--set", f"train.steps={steps}",
                 env=DUMP, timeout=600)
    _ok(r, what)


def test_bf16_checkpoint_resumes_in_fp8_and_back_with_the_master_weights_bitwise(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = trainctl("launch", "--run-dir", str(run), *LAYOUT, "--set", "train.precision=bf16", "--set",
                 "train.steps=4", env=DUMP, timeout=600)
    _ok(r, "bf16 launch")
    saved_bf16 = _weights(run, "w-bf16-4")
    _bitwise(_load_only(run, "fp8"), saved_bf16)
    _resume(run, "fp8", 6, "fp8 training")  # steps 5-6 in FP8, a checkpoint at 6
    saved_fp8 = _weights(run, "w-fp8-6")
    report = trainctl("mfu-report", str(run), env={"COLUMNS": "200"})
    _ok(report, "mfu-report")
    assert "fp8 run, FP8 emulated on the CPU: MFU against the measured matmul rate" in report.stdout, report.stdout
    _bitwise(_load_only(run, "bf16"), saved_fp8)
    _resume(run, "bf16", 8, "bf16 training on")
    assert not all(torch.equal(saved_fp8[k], w) for k, w in _weights(run, "w-bf16-8").items())
    steps = [m["step"] for m in metrics(run)]
    assert steps == list(range(1, 9)), steps
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics(run))
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    changed = [e["overrides"] for e in events if e.get("event") == "spec_changed"]
    assert ["train.precision=fp8" in o for o in changed] == [True, False], changed

"""train.compile: the compiled blocks train the same model as the eager ones, and their checkpoints are the
eager model's (state-dict keys unchanged), so a run may switch compile on or off across a resume."""

from __future__ import annotations

from pathlib import Path

import pytest
from resume_utils import set_spec, stop_after
from trainer_utils import losses, make_run, max_rel_diff, metrics, run_trainer

LLAMA = {"model": {"preset": "tiny-llama", "seq_len": 32}, "train": {"steps": 4}, "checkpoint": {"every_steps": 2}}


@pytest.mark.slow
def test_compiled_blocks_match_eager_and_resume_eager(tmp_path: Path) -> None:
    eager, world = make_run(tmp_path, "eager", **LLAMA)
    assert run_trainer(eager, world, dump=False).returncode == 0
    compiled, _ = make_run(tmp_path, "compiled", **{**LLAMA, "train": {"steps": 4, "compile": True}})
    r = run_trainer(compiled, world, env=stop_after(2), dump=False)  # compiled steps 1-2, a checkpoint at 2
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in metrics(compiled)] == [1, 2]
    set_spec(compiled, train={"compile": False})
    r = run_trainer(compiled, world, dump=False)  # eager steps 3-4 from the compiled run's checkpoint
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in metrics(compiled)] == [1, 2, 3, 4]
    # inductor fuses and reorders fp32 reductions: rounding, not bits
    assert max_rel_diff(losses(compiled), losses(eager)) < 1e-5

"""train.compile: the compiled blocks train the same model as the eager ones in every kind of layout, and their
checkpoints are the eager model's (state-dict keys unchanged), so a run may switch compile on or off across a
resume. The layouts cover what touches a block: TP with sequence parallelism (its collectives inside the
block), an interleaved pipeline with selective recompute, FSDP2 (ZeRO-3) with full recompute around the
compiled block, context parallelism (the K/V all-gather in attention) and MoE with expert parallelism (the
all-to-all dispatch), over the GPT and Llama families."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from resume_utils import set_spec, stop_after
from trainer_utils import losses, make_run, max_rel_diff, metrics, run_trainer

pytestmark = pytest.mark.slow

STEPS = 3
# inductor compiles in a pool of one process per core by default: on the 2-core test machines every rank's pool
# on top of the ranks starves the other test worker (a healthy preflight node read 0.52x of its peer)
ONE_COMPILE_THREAD = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
LAYOUTS: dict[str, dict[str, Any]] = {
    "llama TP2+SP x PP2 interleaved, selective": {
        "model": {"preset": "tiny-llama", "seq_len": 32},
        "parallel": {"tp": 2, "pp": 2, "sequence_parallel": True, "schedule": "interleaved", "virtual_stages": 2,
                     "micro_batch": 2},
        "train": {"recompute": "selective"}},
    "gpt DP2 ZeRO-3, full recompute": {
        "parallel": {"dp": 2, "zero": 3, "micro_batch": 2}, "train": {"recompute": "full"}},
    "llama CP2 x DP2 ZeRO-1": {
        "model": {"preset": "tiny-llama", "seq_len": 64}, "parallel": {"cp": 2, "dp": 2, "zero": 1, "micro_batch": 1},
        "train": {"global_batch": 4}},
    "moe EP2 x DP2": {
        "model": {"preset": "tiny-moe", "seq_len": 32}, "parallel": {"dp": 2, "ep": 2, "micro_batch": 2}},
}


def with_compile(sections: dict[str, Any], compile: bool, steps: int = STEPS) -> dict[str, Any]:
    return {**sections, "train": {**sections.get("train", {}), "steps": steps, "compile": compile}}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_blocks_train_what_eager_blocks_train(layout: str, tmp_path: Path) -> None:
    eager, world = make_run(tmp_path, "eager", **with_compile(LAYOUTS[layout], False))
    compiled, _ = make_run(tmp_path, "compiled", **with_compile(LAYOUTS[layout], True))
    kernels = tmp_path / "inductor"  # where inductor writes what it generated: proof that the blocks compiled
    for run, env in ((eager, {}), (compiled, {"TORCHINDUCTOR_CACHE_DIR": str(kernels), **ONE_COMPILE_THREAD})):
        r = run_trainer(run, world, env=env, dump=False)
        assert r.returncode == 0, r.stderr[-3000:]
    assert any(kernels.rglob("*.py")), "train.compile generated no kernel"
    # inductor fuses and reorders fp32 reductions: rounding, not bits
    assert max_rel_diff(losses(compiled), losses(eager)) < 1e-5


def test_a_compiled_run_resumes_eager_from_its_checkpoint(tmp_path: Path) -> None:
    llama = {"model": {"preset": "tiny-llama", "seq_len": 32}, "checkpoint": {"every_steps": 2}}
    eager, world = make_run(tmp_path, "eager", **with_compile(llama, False, steps=4))
    assert run_trainer(eager, world, dump=False).returncode == 0
    compiled, _ = make_run(tmp_path, "compiled", **with_compile(llama, True, steps=4))
    r = run_trainer(compiled, world, env={**stop_after(2), **ONE_COMPILE_THREAD}, dump=False)  # compiled 1-2
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in metrics(compiled)] == [1, 2]
    set_spec(compiled, train={"compile": False})
    r = run_trainer(compiled, world, dump=False)  # eager steps 3-4 from the compiled run's checkpoint
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in metrics(compiled)] == [1, 2, 3, 4]
    assert max_rel_diff(losses(compiled), losses(eager)) < 1e-5

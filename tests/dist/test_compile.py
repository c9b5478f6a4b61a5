"""train.compile: the compiled blocks train the same model as the eager ones in every kind of layout, and their
checkpoints are the eager model's (state-dict keys unchanged), so a run may switch compile on or off across a
resume. The layouts cover what touches a block: TP with sequence parallelism (its collectives inside the
block) with selective recompute, FSDP2 (ZeRO-3) with full recompute around the compiled block, an
interleaved pipeline (two chunks of blocks per rank), context parallelism (the K/V all-gather in attention)
and MoE with expert parallelism (the all-to-all dispatch), over the GPT and Llama families.

Where the distributed pieces meet the compiler is Dynamo's tracing and AOTAutograd's graphs: every layout runs
them (backend aot_eager). Inductor's generated kernels take 10-30 s per rank to build on these CPUs, so two
cases run inductor itself (one of them on two ranks); its kernels' speed was measured on a GPU
(bench/bench_gpu.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from resume_utils import set_spec, stop_after
from trainer_utils import losses, make_run, max_rel_diff, metrics, run_trainer

from trainctl.rundir.paths import read_jsonl

pytestmark = pytest.mark.slow

STEPS = 3
INDUCTOR = "gpt DP2 ZeRO-3, full recompute"  # the layout that also builds inductor's kernels
# two ranks each: every rank compiles its blocks itself, so ranks are what a case costs here
LAYOUTS: dict[str, dict[str, Any]] = {
    "llama TP2+SP, selective recompute": {
        "model": {"preset": "tiny-llama", "seq_len": 32},
        "parallel": {"tp": 2, "sequence_parallel": True, "micro_batch": 2}, "train": {"recompute": "selective"}},
    "gpt DP2 ZeRO-3, full recompute": {
        "parallel": {"dp": 2, "zero": 3, "micro_batch": 2}, "train": {"recompute": "full"}},
    "gpt PP2 interleaved": {
        "parallel": {"pp": 2, "schedule": "interleaved", "virtual_stages": 2, "micro_batch": 2}},
    "llama CP2": {
        "model": {"preset": "tiny-llama", "seq_len": 64}, "parallel": {"cp": 2, "micro_batch": 1},
        "train": {"global_batch": 4}},
    "moe EP2 x DP2": {
        "model": {"preset": "tiny-moe", "seq_len": 32}, "parallel": {"dp": 2, "ep": 2, "micro_batch": 2}},
}


def with_compile(sections: dict[str, Any], backend: str | None, steps: int = STEPS) -> dict[str, Any]:
    train = {**sections.get("train", {}), "steps": steps, "compile": backend is not None}
    return {**sections, "train": {**train, **({"compile_backend": backend} if backend else {})}}


def compiled_event(run: Path) -> dict[str, Any]:
    return next(e for e in read_jsonl(run / "events.jsonl") if e["event"] == "compiled")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_blocks_train_what_eager_blocks_train(layout: str, tmp_path: Path) -> None:
    backend = "inductor" if layout == INDUCTOR else "aot_eager"
    eager, world = make_run(tmp_path, "eager", **with_compile(LAYOUTS[layout], None))
    compiled, _ = make_run(tmp_path, "compiled", **with_compile(LAYOUTS[layout], backend))
    kernels = tmp_path / "inductor"  # where inductor writes what it generated
    for run, env in ((eager, {}), (compiled, {"TORCHINDUCTOR_CACHE_DIR": str(kernels)})):
        r = run_trainer(run, world, env=env, dump=False)
        assert r.returncode == 0, r.stderr[-3000:]
    # the blocks went through Dynamo (rank 0's record after the first step), and through inductor where asked
    ev = compiled_event(compiled)
    assert ev["backend"] == backend and ev["graphs"] >= 1, ev
    assert any(kernels.rglob("*.py")) == (backend == "inductor")
    assert not any(e["event"] == "compiled" for e in read_jsonl(eager / "events.jsonl"))
    # compiled graphs reorder and fuse fp32 reductions: rounding, not bits
    assert max_rel_diff(losses(compiled), losses(eager)) < 1e-5


def test_a_compiled_run_resumes_eager_from_its_checkpoint(tmp_path: Path) -> None:
    llama = {"model": {"preset": "tiny-llama", "seq_len": 32}, "checkpoint": {"every_steps": 2}}
    eager, world = make_run(tmp_path, "eager", **with_compile(llama, None, steps=4))
    assert run_trainer(eager, world, dump=False).returncode == 0
    compiled, _ = make_run(tmp_path, "compiled", **with_compile(llama, "inductor", steps=4))
    r = run_trainer(compiled, world, env=stop_after(2), dump=False)  # compiled steps 1-2, a checkpoint at 2
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in metrics(compiled)] == [1, 2]
    assert compiled_event(compiled)["backend"] == "inductor"
    set_spec(compiled, train={"compile": False})
    r = run_trainer(compiled, world, dump=False)  # eager steps 3-4 from the compiled run's checkpoint
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in metrics(compiled)] == [1, 2, 3, 4]
    assert max_rel_diff(losses(compiled), losses(eager)) < 1e-5

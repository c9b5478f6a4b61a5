"""ZBV (torch's ScheduleZBVZeroBubble, stages in a V: pipeline rank r holds stages r and 2*pp-1-r) trains what
the plain 1F1B pipeline trains: losses, grad norms and final weights to fp32 rounding (the matrix's 1e-5),
for the Llama family (untied) and the GPT family (tied embeddings: both copies on pipeline rank 0, their
grads summed there, not over an embedding group), with DP=2 under ZeRO-1 and under FSDP2 (which must not
reshard after forward under a zero-bubble schedule), at PP=2 and PP=4; the layout matrix holds the ZBV
layouts of every model family against one rank as well (tests/dist/test_layout_matrix.py). A ZBV checkpoint
resumes onto 1F1B with DP=2 / ZeRO-2 and back onto ZBV (the tied copy on rank 0 is set from its key on load)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from spec_utils import deep_update, world_size
from test_layout_matrix import BASE, GPT, LLAMA, compare, run_matrix
from test_resume_faults import assert_layout_chain_stays_on_the_curve

pytestmark = pytest.mark.slow

# 6 layers: PP=4 under ZBV has 8 stages, the first and last (embedding, LM head) without a layer
SIX = {"layers": 6}
PP4_ZBV_SPLIT = [0, 1, 1, 1, 1, 1, 1, 0]


def spec(model: dict[str, Any], parallel: dict[str, Any], micro_batches: int) -> dict[str, Any]:
    """BASE with `parallel`, micro_batch 2 and `micro_batches` micro-batches per DP replica."""
    return deep_update(BASE, {"model": model, "parallel": {"micro_batch": 2, **parallel},
                              "train": {"global_batch": 2 * micro_batches * parallel.get("dp", 1)},
                              "cluster": {"gpus_per_node": world_size(parallel)}})


# id -> (model, ZBV layout, the 1F1B layout it is held against, micro-batches per replica): what the layout
# matrix's ZBV rows (pp2-zbv, pp2-dp2-zbv-zero1: every model family, 2*pp micro-batches, against one rank) leave
# out: fewer micro-batches than 2*pp-1 (torch pads ZBV's order there), FSDP, and PP=4
PAIRS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any], int]] = {
    "gpt-pp2-m2": (GPT, {"pp": 2, "schedule": "zbv"}, {"pp": 2}, 2),
    "llama-pp2-dp2-fsdp": (LLAMA, {"pp": 2, "dp": 2, "zero": 3, "schedule": "zbv"}, {"pp": 2, "dp": 2, "zero": 3}, 4),
    "gpt-pp4": ({**GPT, **SIX}, {"pp": 4, "schedule": "zbv", "stage_layers": PP4_ZBV_SPLIT}, {"pp": 4}, 8),
}


def test_zbv_matches_1f1b(tmp_path: Path) -> None:
    cases = []
    for key, (model, zbv, plain, m) in PAIRS.items():
        cases += [{"id": f"1f1b-{key}", "spec": spec(model, plain, m)},
                  {"id": f"zbv-{key}", "spec": spec(model, zbv, m)}]
    run_matrix(cases, tmp_path, timeout=600, nproc=4)
    worst = [0.0, 0.0, 0.0]
    for key in PAIRS:
        diffs = compare(tmp_path / f"zbv-{key}", tmp_path / f"1f1b-{key}", 1e-5, 1e-5)
        worst = [max(a, b) for a, b in zip(worst, diffs, strict=True)]
    print(f"zbv vs 1f1b, {len(PAIRS)} pairs: max relative loss difference {worst[0]:.1e}, grad norm {worst[1]:.1e}, "
          f"max absolute weight difference {worst[2]:.1e}")


def test_zbv_checkpoint_resumes_onto_1f1b_and_back(tmp_path: Path) -> None:
    """GPT family (tied embeddings): ZBV's rank 0 saves one copy of the table under its key; 1F1B's two ranks
    each load it; ZBV again loads it into both copies on rank 0 (weights and ZeRO-2 moments)."""
    assert_layout_chain_stays_on_the_curve(tmp_path, [
        {"pp": 2, "schedule": "zbv"},
        {"pp": 2, "dp": 2, "zero": 1, "schedule": "1f1b", "virtual_stages": 1},
        {"pp": 2, "dp": 2, "zero": 2, "schedule": "zbv", "virtual_stages": 2}], "zbv -> 1f1b-dp2 -> zbv-dp2-zero2")

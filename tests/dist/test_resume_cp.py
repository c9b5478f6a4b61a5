"""Resume with context parallelism, through the real trainer (torchrun, gloo): bit for bit at an unchanged CP
layout, and on the uninterrupted curve when cp changes (nothing of the model is sharded by CP; the data
position is one slot counter whatever cp is, and ZeRO's optimizer shards over dp x cp are resharded)."""

from __future__ import annotations

from pathlib import Path

import pytest
from resume_utils import assert_resumed_bitwise, straight_and_resumed
from test_resume_faults import assert_layout_chain_stays_on_the_curve

pytestmark = pytest.mark.slow

# the Llama family: RoPE (positions of each rank's chunks), GQA (2 KV heads for 4 query heads), untied head
LLAMA = {"norm": "rmsnorm", "position": "rope", "activation": "swiglu", "kv_heads": 2, "tied_embeddings": False}


def test_resume_with_cp_is_bitwise(tmp_path: Path) -> None:
    """CP2 x DP2 with ZeRO-1 (optimizer state sharded over the 4 ranks of dp x cp), resumed after 3 of 6 steps."""
    parallel = {"cp": 2, "dp": 2, "zero": 1, "micro_batch": 2}
    straight, resumed = straight_and_resumed(tmp_path, parallel, 6, env={"TRAINCTL_BUCKET_NUMEL": "20000"},
                                             model=LLAMA)
    assert_resumed_bitwise(straight, resumed, 6)


def test_cp2_to_cp1_to_cp4_stays_on_the_curve(tmp_path: Path) -> None:
    """CP2 x DP2 ZeRO-1 -> CP1 x DP2 ZeRO-1 -> CP4 (the ZeRO shards go from 4 to 2 ranks, then away)."""
    assert_layout_chain_stays_on_the_curve(tmp_path, [
        {"cp": 2, "dp": 2, "zero": 1}, {"cp": 1, "dp": 2, "zero": 1}, {"cp": 4, "dp": 1, "zero": 0}],
        "cp2 -> cp1 -> cp4", model=LLAMA)

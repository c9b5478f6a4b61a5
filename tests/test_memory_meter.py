"""The trainer's measured memory (metrics.jsonl `memory`): exact model-state bytes per rank, held against
independent arithmetic for the matrix's base model, and the activation peak saved for backward."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_layout_matrix import BASE, run_matrix
from trainer_utils import deep_update, metrics

pytestmark = pytest.mark.slow

H, L, V, S = 32, 4, 255, 16  # BASE: GELU MLP 4h, LayerNorm without bias, learned positions, tied head
PER_LAYER = H * 3 * H + H * H + 2 * H * 4 * H + 2 * H  # qkv, proj, fc1 + fc2, two norm weights
N = L * PER_LAYER + V * H + S * H + H  # + token table (the tied head), positions, final norm
STEP_COUNTERS = 64 * 4  # AdamW keeps a 4-byte step tensor per parameter (or ZeRO fragment): < 64 here


def spec(**parallel) -> dict:
    world = parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("dp", 1)
    return deep_update(BASE, {"parallel": {"micro_batch": 4, **parallel}, "train": {"steps": 3},
                              "cluster": {"gpus_per_node": world}})


def test_model_state_bytes_are_exact_and_activations_measured(tmp_path: Path) -> None:
    cases = {"one": spec(), "zero1": spec(dp=2, zero=1), "zero2": spec(dp=2, zero=2), "zero3": spec(dp=2, zero=3),
             "full": deep_update(spec(), {"train": {"recompute": "full"}})}
    run_matrix([{"id": k, "spec": v} for k, v in cases.items()], tmp_path, timeout=600, nproc=2)
    mem = {}
    for k in cases:
        lines = [m for m in metrics(tmp_path / k) if "memory" in m]
        assert [m["step"] for m in lines] == [2]  # measured over the attempt's first two steps, logged once
        mem[k] = lines[0]["memory"]
        assert len(mem[k]["per_rank"]) == (1 if k in ("one", "full") else 2)
    one = mem["one"]["max"]
    assert one["weights"] == one["gradients"] == 4 * N  # fp32 weights and one fp32 gradient buffer
    assert 0 <= one["optimizer"] - 8 * N < STEP_COUNTERS  # Adam's two fp32 moments
    z1 = mem["zero1"]["max"]
    assert z1["weights"] == z1["gradients"] == 4 * N
    assert 0 <= z1["optimizer"] - 12 * N // 2 < STEP_COUNTERS  # moments + fp32 master of this rank's half
    # ZeRO-2 as the trainer runs it today: the full bucket buffer stays beside the reduced shard
    assert mem["zero2"]["max"]["gradients"] == 4 * N + 4 * N // 2
    z3 = mem["zero3"]["max"]
    assert z3["weights"] == pytest.approx(4 * N / 2, rel=0.01)  # FSDP pads each dim-0 shard evenly
    assert z3["gradients"] == z3["weights"]
    # activations: saved for backward, several times smaller when every block is recomputed
    assert one["activations_peak"] > 3 * mem["full"]["max"]["activations_peak"] > 0

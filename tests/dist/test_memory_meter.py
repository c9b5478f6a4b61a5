"""The trainer's measured memory (metrics.jsonl `memory`): exact model-state bytes per rank, held against
independent arithmetic for the matrix's base model, and the activation peak saved for backward."""

from __future__ import annotations

from pathlib import Path

import pytest
from spec_utils import deep_update, world_size
from test_layout_matrix import BASE, run_matrix
from trainer_utils import metrics

pytestmark = pytest.mark.slow

H, L, V, S = 32, 4, 255, 16  # BASE: GELU MLP 4h, LayerNorm without bias, learned positions, tied head
PER_LAYER = H * 3 * H + H * H + 2 * H * 4 * H + 2 * H  # qkv, proj, fc1 + fc2, two norm weights
N = L * PER_LAYER + V * H + S * H + H  # + token table (the tied head), positions, final norm
STEP_COUNTERS = 64 * 4  # AdamW keeps a 4-byte step tensor per parameter (or ZeRO fragment): < 64 here


BF16 = {"precision": "bf16", "low_precision_on_cpu": True}
FP32_RESIDUAL = {"fp32_residual": True}  # model overrides
BUCKET_NUMEL = 4000  # run_matrix's TRAINCTL_BUCKET_NUMEL
# ZeRO-2's bucket buffers hold the largest bucket: here the token table alone (V*H = 8160 > BUCKET_NUMEL;
# every other bucket closes below BUCKET_NUMEL), padded to dp = 2. Two slots, each the fp32 bucket and the
# fp32 half its reduce-scatter returns.
SLOT = V * H
ZERO2_BUFFERS = 2 * (4 * SLOT + 4 * SLOT // 2)


def spec(train: dict | None = None, **parallel) -> dict:
    return deep_update(BASE, {"parallel": {"micro_batch": 4, **parallel}, "train": {"steps": 3, **(train or {})},
                              "cluster": {"gpus_per_node": world_size(parallel)}})


def test_model_state_bytes_are_exact_and_activations_measured(tmp_path: Path) -> None:
    """Bytes per parameter of every path, from independent arithmetic (docs/design/memory.md, "Memory model")."""
    cases = {"one": spec(), "zero1": spec(dp=2, zero=1), "zero2": spec(dp=2, zero=2), "zero3": spec(dp=2, zero=3),
             "full": spec({"recompute": "full"}),
             "zero1-bf16": spec(BF16, dp=2, zero=1), "zero2-bf16": spec(BF16, dp=2, zero=2),
             "zero3-bf16": spec(BF16, dp=2, zero=3)}
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
    # ZeRO-2 keeps no full gradient buffer: its fp32 half, and the two bucket buffers micro-batches pass through
    z2 = mem["zero2"]["max"]
    assert z2["weights"] == 4 * N
    assert 0 <= z2["gradients"] - (4 * N // 2 + ZERO2_BUFFERS) < 4 * N // BUCKET_NUMEL + 8  # + bucket padding
    assert 0 <= z2["optimizer"] - 12 * N // 2 < STEP_COUNTERS
    z3 = mem["zero3"]["max"]
    assert z3["weights"] == pytest.approx(4 * N / 2, rel=0.01)  # FSDP pads each dim-0 shard evenly
    assert z3["gradients"] == z3["weights"]
    # bf16 under ZeRO-1/2: bf16 weights, the fp32 gradient buffer (ZeRO-1) or half (ZeRO-2), fp32 master +
    # moments of half: 2 + 4 + 12/dp, Megatron's distributed optimizer, and 2 + 16/dp (+ buffers)
    b1, b2 = mem["zero1-bf16"]["max"], mem["zero2-bf16"]["max"]
    assert b1["weights"] == b2["weights"] == 2 * N
    assert b1["gradients"] == 4 * N
    assert b2["gradients"] == z2["gradients"]
    assert b1["optimizer"] == z1["optimizer"] and b2["optimizer"] == z2["optimizer"]
    # FSDP2 under bf16 keeps fp32 shards (it gathers them in bf16 for the compute)
    assert mem["zero3-bf16"]["max"]["weights"] == z3["weights"]
    # activations: saved for backward, several times smaller when every block is recomputed
    assert one["activations_peak"] > 3 * mem["full"]["max"]["activations_peak"] > 0
    table = {k: {c: mem[k]["max"][c] / N for c in ("weights", "gradients", "optimizer")} for k in cases}
    print("bytes per parameter (dp 2 where sharded):", table)


# Layouts across ZeRO 0-3, TP(+SP), PP schedules with m = pp and m = 4pp, and the recompute modes, for both
# model families and their mixtures of experts (global batch 16: micro_batch 8 gives m = pp = 2 at dp 1,
# micro_batch 2 gives m = 4pp).
PLAN_CASES: dict[str, tuple] = {
    "gpt-one": ("gpt", "one-rank", "4", "none"),
    "gpt-dp2-zero1-selective": ("gpt", "dp2-zero1", "4", "selective"),
    "llama-dp2-zero2": ("llama", "dp2-zero2", "2", "none"),
    "llama-dp2-zero3-full": ("llama", "dp2-zero3", "4", "full"),
    "llama-tp2-sp-full": ("llama", "tp2-sp", "4", "full"),
    "gpt-tp2-selective": ("gpt", "tp2", "4", "selective"),
    "gpt-pp2-1f1b-m=pp": ("gpt", "pp2-1f1b", "8", "none"),
    "llama-pp2-1f1b-m=4pp": ("llama", "pp2-1f1b", "2", "selective"),
    "gpt-pp2-interleaved-m=pp": ("gpt", "pp2-interleaved", "8", "none"),
    "llama-pp2-interleaved-m=4pp": ("llama", "pp2-interleaved", "2", "none"),
    "gpt-pp2-gpipe": ("gpt", "pp2-gpipe", "4", "full"),
    "llama-tp2-pp2-sp": ("llama", "tp2-pp2-sp-1f1b", "2", "none"),
    # bf16 parameters under ZeRO-1/2, fp32 FSDP2 shards gathered in bf16 under ZeRO-3
    "llama-dp2-zero1-bf16": ("llama", "dp2-zero1", "4", "none", BF16),
    "gpt-dp2-zero2-bf16": ("gpt", "dp2-zero2", "2", "selective", BF16),
    "gpt-dp2-zero3-bf16": ("gpt", "dp2-zero3", "4", "none", BF16),
    # fp32 parameters under bf16 autocast: the 16-bit weight copies it saves, once per stage however many
    # micro-batches are in flight; under full recompute only the LM head's
    "llama-pp2-1f1b-bf16": ("llama", "pp2-1f1b", "2", "none", BF16),
    "gpt-tp2-full-bf16": ("gpt", "tp2", "4", "full", BF16),
    # the bf16 residual stream's alternative: fp32 norm inputs, block inputs and pipeline messages
    "llama-pp2-1f1b-bf16-fp32-residual": ("llama", "pp2-1f1b", "2", "none", BF16, FP32_RESIDUAL),
    "gpt-tp2-full-bf16-fp32-residual": ("gpt", "tp2", "4", "full", BF16, FP32_RESIDUAL),
    # context parallelism: each rank's s/cp tokens, the whole sequence's gathered K/V, ZeRO over dp x cp
    "llama-cp2": ("llama", "cp2", "4", "none"),
    "gpt-cp4": ("gpt", "cp4", "2", "none"),
    "llama-cp2-tp2-sp-selective": ("llama", "cp2-tp2-sp", "4", "selective"),
    "gpt-cp2-dp2-zero1-full": ("gpt", "cp2-dp2-zero1", "2", "full"),
    # mixtures of experts: experts over EP with ZeRO-1 (expert-DP 2) and FSDP (expert-DP 1), TP with and without
    # SP, a pipeline with full recompute
    "moe-llama-dp4-ep2-zero1": ("moe-llama", "dp4-ep2-zero1", "2", "none"),
    "moe-gpt-tp2-sp-ep2-selective": ("moe-gpt", "tp2-dp2-ep2-sp", "4", "selective"),
    "moe-llama-tp2-ep2-selective": ("moe-llama", "tp2-dp2-ep2", "2", "selective"),
    "moe-llama-pp2-ep2-full": ("moe-llama", "pp2-dp2-ep2-1f1b", "2", "full"),
    "moe-gpt-dp2-ep2-zero3": ("moe-gpt", "dp2-ep2-zero3", "4", "none"),
}


def test_plan_memory_is_the_trainers_measured_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/design/memory.md, "Memory model": the plan's weights, gradients and optimizer bytes are what the
    trainer holds (up to bucket padding and AdamW's step counters), its activations within 10% of the
    measured saved-for-backward peak."""
    check_plan_memory(PLAN_CASES, tmp_path, monkeypatch)


# FP8 over a bf16 base (autocast on the CPU too): the FP8 layers keep their input and the weight itself, no
# 16-bit copy of it (docs/design/trainer.md, "FP8 training"); only the LM head's copy stays
FP8 = {"precision": "fp8", "low_precision_on_cpu": True}
FP8_PLAN_CASES: dict[str, tuple] = {
    "llama-pp2-1f1b-fp8": ("llama", "pp2-1f1b", "2", "none", FP8),
    "gpt-tp2-full-fp8": ("gpt", "tp2", "4", "full", {**FP8, "fp8_recipe": "rowwise"}),
}


def test_plan_memory_in_fp8_is_the_trainers_measured_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check_plan_memory(FP8_PLAN_CASES, tmp_path, monkeypatch)


def check_plan_memory(cases: dict[str, tuple], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_layout_matrix import case_spec

    from trainctl.plan.plan import build_plan
    from trainctl.spec.loader import validate_spec

    monkeypatch.setenv("TRAINCTL_BUCKET_NUMEL", str(BUCKET_NUMEL))  # the plan sizes ZeRO-2's buffers by it
    specs = {k: deep_update(case_spec(dict(zip(("model", "layout", "micro_batch", "recompute"), row[:4], strict=True)),
                                      steps=2, **(row[4] if len(row) > 4 else {})),
                            {"model": row[5] if len(row) > 5 else {}}) for k, row in cases.items()}
    run_matrix([{"id": k, "spec": v} for k, v in specs.items()], tmp_path, timeout=600, nproc=4)
    worst_act = 0.0
    for k, raw in specs.items():
        spec = validate_spec(raw)
        planned = build_plan(spec).to_json()["memory"]["per_pp_rank"]
        (line,) = [m for m in metrics(tmp_path / k) if "memory" in m]
        tp, dp = spec.parallel.tp, spec.dp * spec.parallel.cp  # ZeRO shards and buckets pad over dp x cp
        for rank, got in enumerate(line["memory"]["per_rank"]):
            want = planned[rank // (tp * dp)]  # Megatron rank order: pp varies slowest
            # each DP bucket is padded to a multiple of dp (at most dp-1 elements of 4 bytes)
            padding = 4 * (dp - 1) * (round(want["params"]) // BUCKET_NUMEL + 2)
            if spec.parallel.zero == 3 and dp > 1:
                # FSDP2 pads every parameter's dim-0 shard to an even split
                assert got["weights"] == pytest.approx(want["weights"], rel=0.02), (k, rank)
                assert got["gradients"] == pytest.approx(want["gradients"], rel=0.02), (k, rank)
                assert got["optimizer"] == pytest.approx(want["optimizer"], rel=0.02), (k, rank)
            else:
                assert 0 <= got["weights"] - want["weights"] <= padding, (k, rank, got, want)
                assert 0 <= got["gradients"] - want["gradients"] <= padding, (k, rank, got, want)
                assert 0 <= got["optimizer"] - want["optimizer"] <= padding * 3 + STEP_COUNTERS * 2, (k, rank)
            rel = abs(got["activations_peak"] - want["activations"]) / want["activations"]
            worst_act = max(worst_act, rel)
            assert rel <= 0.10, (k, rank, got["activations_peak"], want["activations"])
    print(f"activations: worst relative error {worst_act:.3f}")

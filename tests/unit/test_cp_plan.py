"""The planner under context parallelism: activation memory divided over CP (Korthikanti et al. 2022's per-layer
terms, all linear in s once the s^2 attention core is not stored), the K/V exchange's bytes by hand, the
causal balance of the chunk layout, the link and its warnings, --auto's search of cp, and the Llama 3 405B
long-context recipe (the Llama 3 paper's Table 4 layout) fitting in H100 memory."""

from __future__ import annotations

from dataclasses import replace

import pytest
from paths import RECIPES

from trainctl import model_shape
from trainctl.model_shape import ModelShape
from trainctl.plan import memory
from trainctl.plan.auto import search
from trainctl.plan.plan import build_plan
from trainctl.spec import load_spec, load_spec_text
from trainctl.spec.presets import MODEL_PRESETS

LONG = RECIPES / "llama3-405b-long-context.yaml"


def shape(preset: str, **kw) -> ModelShape:
    spec = load_spec_text(f"name: t\nmodel: {{preset: {preset}}}\ntrain: {{global_batch: 8, steps: 1}}\n")
    return replace(ModelShape.from_spec(spec.model), **kw)


@pytest.mark.parametrize("preset", ["gpt3-175b", "llama3-405b"])
@pytest.mark.parametrize("cp", [2, 16])
def test_selective_and_full_recompute_activations_fall_exactly_by_cp(preset: str, cp: int) -> None:
    """Korthikanti et al. 2022, Sec. 4: every stored term of a layer is linear in s except the attention
    core's s^2 scores, which selective recompute drops (and which torch's fused attention never stores); so a
    rank holding s/cp tokens keeps 1/cp of the bytes, and with recompute no CP exchange tensor is kept."""
    m = shape(preset, seq_len=131072, dropout=0.0)
    for recompute in ("selective", "full"):
        for tp, sp in ((1, False), (8, True)):
            one = memory.trainer_layer_activation_bytes(m, 1, tp, sp, recompute, "bf16")
            assert memory.trainer_layer_activation_bytes(m, 1, tp, sp, recompute, "bf16", cp) == one / cp
    head = memory.trainer_head_activation_bytes(m, 1, 8, True, m.padded_vocab(8), "bf16")
    assert memory.trainer_head_activation_bytes(m, 1, 8, True, m.padded_vocab(8), "bf16", cp) == head / cp


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_without_recompute_cp_adds_the_gathered_kv(position: str) -> None:
    """What the all-gather attention keeps beyond 1/cp of the one-rank layer, by hand (per TP rank, 2-byte
    values, t = s/cp tokens): the whole sequence's K and V (2*s*b*kv_width), the chunk calls' queries (t*b*h)
    and the joined output of the two calls (t*b*h); no longer kept: the fused QKV output (t*b*(h + 2*kv_width))
    and, with RoPE, the rotated Q and K (t*b*(h + kv_width))."""
    s, b, tp, cp = 131072, 1, 8, 16
    t = s // cp
    m = shape("llama3-405b", seq_len=s, position=position)
    h, kvw = m.hidden, m.kv_width  # 16384, 8 KV heads x 128 = 1024
    extra = 2 * s * b * kvw + 2 * t * b * h - t * b * (h + 2 * kvw)
    if position == "rope":
        extra -= t * b * (h + kvw)
    got = memory.trainer_layer_activation_bytes(m, b, tp, True, "none", "bf16", cp)
    one = memory.trainer_layer_activation_bytes(m, b, tp, True, "none", "bf16")
    assert got - one / cp == pytest.approx(2 * extra / tp, rel=1e-12)
    # the gathered K/V is small next to the rest under GQA: 2*kv_width/h = 1/8 of a hidden-wide tensor
    assert 2 * s * b * kvw * 2 / tp < 0.15 * got


def test_kv_exchange_bytes_by_hand() -> None:
    """The 405B long-context recipe: K and V of the whole 131,072-token sequence for this TP rank's 8/8 = 1
    KV head of 128 dims are 2 x 131072 x 128 x 2 bytes = 64 MiB; a ring all-gather sends 15/16 of it per rank,
    the backward reduce-scatter the same, full recompute gathers once more: 3 passes per layer and micro-batch.
    The busiest pipeline rank holds 8 layers (8 chunks of 1 layer), 16 micro-batches per step."""
    plan = build_plan(load_spec(LONG)).to_json()
    per_layer = 3 * (2 * 131072 * 1 * 128 * 2) * 15 / 16
    assert per_layer == 188_743_680
    cpj = plan["context_parallel"]
    assert cpj["bytes_per_layer_per_micro_batch"] == per_layer
    assert plan["communication"]["per_kind"]["cp"]["bytes"] == 16 * 8 * per_layer  # 24.2 GB
    # the CP group (stride tp = 8: one GPU of each of 16 nodes) crosses the fabric
    assert cpj["link"] == "inter_node" and plan["communication"]["per_kind"]["cp"]["link"] == "inter_node"


@pytest.mark.parametrize("cp", [2, 4, 16])
def test_causal_work_is_balanced_and_complete(cp: int) -> None:
    s = 4096 * 2 * cp
    pairs = model_shape.causal_pairs_per_rank(s, cp)
    assert len(set(pairs)) == 1  # every rank the same work
    assert sum(pairs) == s * (s + 1) // 2  # together exactly the causal triangle
    contiguous = model_shape.causal_pairs_per_rank(s, cp, balanced=False)
    assert sum(contiguous) == s * (s + 1) // 2
    # rank k of a contiguous split: k whole squares + half its own, against a mean of cp/2
    assert max(contiguous) / (sum(contiguous) / cp) == pytest.approx((2 * cp - 1) / cp, rel=1e-3)


def test_llama3_405b_long_context_recipe_is_the_paper_layout_and_fits() -> None:
    """Llama 3 paper (Dubey et al. 2024), Table 4, the 131,072-token row: 16,384 GPUs, TP 8, CP 16, PP 16,
    DP 8, batch size per DP 16, 16M tokens per step."""
    spec = load_spec(LONG)
    p = spec.parallel
    assert (spec.world_size, p.tp, p.cp, p.pp, spec.dp) == (16384, 8, 16, 16, 8)
    assert spec.model.seq_len == 131072 and spec.train.global_batch // spec.dp == 16
    assert spec.train.global_batch * spec.model.seq_len == 16 * 2**20  # 16.8M tokens
    plan = build_plan(spec)
    j = plan.to_json()
    assert plan.fits and j["memory"]["total"] < 80e9 - memory.GPU_RESERVE_BYTES
    assert j["context_parallel"]["tokens_per_rank"] == 8192 and j["context_parallel"]["causal_balance"] == 1.0
    dom = j["prediction"]["dominant"]
    assert dom["part"] == "compute" and 0.5 < dom["share"] < 1  # what dominates the step is named
    assert sum(j["prediction"]["breakdown_s"].values()) == pytest.approx(j["prediction"]["step_time_s"])
    # ZeRO-1 shards the optimizer over dp x cp = 128 ranks
    assert j["memory"]["optimizer"] == pytest.approx(12 * j["memory"]["params_per_gpu"] / 128)
    codes = {w["code"] for w in j["warnings"]}
    assert "CP_ACROSS_NVLINK" in codes and "CP_CHUNK_SHORT" not in codes and "OOM" not in codes
    # without CP (the same tp x pp x dp on 1/16 of the GPUs) the sequence does not fit: 16x the tokens per GPU
    assert not build_plan(load_spec(LONG, overrides=["parallel.cp=1", "cluster.nodes=128"])).fits


def test_short_chunks_and_groups_inside_the_node_are_named() -> None:
    text = ("name: t\nmodel: {preset: llama3-8b, seq_len: 8192}\nparallel: {tp: 1, cp: 8, pp: 1}\n"
            "train: {global_batch: 64, steps: 1}\ncluster: {nodes: 2, gpus_per_node: 8, gpu: h100-sxm}\n")
    j = build_plan(load_spec_text(text)).to_json()
    codes = {w["code"] for w in j["warnings"]}
    assert j["context_parallel"]["link"] == "nvlink" and "CP_ACROSS_NVLINK" not in codes
    # 512-token chunks: a layer's K/V exchange outlasts the rank's attention on its 1,024 tokens
    j = build_plan(load_spec_text(text.replace("seq_len: 8192", "seq_len: 1024"),
                                  overrides=["cluster.nvlink_gbps=10"])).to_json()
    assert "CP_CHUNK_SHORT" in {w["code"] for w in j["warnings"]}


def test_auto_searches_cp_only_for_long_sequences() -> None:
    long = search(load_spec(LONG), top=3)
    assert long.top and all(s.cand.cp > 1 for s, _, _ in long.top)
    assert all(run.parallel.cp == s.cand.cp for s, run, _ in long.top)  # a shown layout is a valid spec
    short = search(load_spec(RECIPES / "llama3-8b.yaml"), top=3)
    assert MODEL_PRESETS["llama3-8b"]["seq_len"] < 32768 and all(s.cand.cp == 1 for s, _, _ in short.top)

"""The planner's mixture-of-experts arithmetic: total and active parameters against the papers and against
independent arithmetic written out here, FLOPs from the active parameters (router included), the EP
all-to-all against a hand count, expert memory against ep, EP placement, warnings, `plan --json` and
`plan --auto`.

Sources of the published figures:
- Mixtral 8x7B: Jiang et al. 2024, "Mixtral of Experts" (arXiv:2401.04088), Sec. 2 / Table 1: 32 layers,
  dim 4096, head_dim 128, 32 heads, 8 KV heads, hidden_dim 14336, vocab 32000, 8 experts, top-2; "46.7B
  total parameters ... 12.9B active parameters" (Mistral AI's announcement; the paper: "47B parameters",
  "13B active"). The HF config (mistralai/Mixtral-8x7B-v0.1) agrees: num_local_experts 8,
  num_experts_per_tok 2, untied embeddings, router gate Linear(4096, 8, bias=False).
- OLMoE-1B-7B: Muennighoff et al. 2024, "OLMoE: Open Mixture-of-Experts Language Models"
  (arXiv:2409.02060), Table 1: 6.9B total, 1.3B active; 16 layers, d_model 2048, 16 heads, 64 experts of
  FFN 1024, top-8, vocab 50304 (HF allenai/OLMoE-1B-7B-0924: intermediate_size 1024, num_experts 64,
  num_experts_per_tok 8, norm_topk_prob false, tie_word_embeddings false). Its QK-norm (q_norm and k_norm,
  2048 weights each per layer) is not part of this model family: 16 * 2 * 2048 = 65,536 parameters fewer.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from cli_utils import trainctl
from paths import RECIPES

from trainctl import model_shape as ms
from trainctl.plan.auto import search
from trainctl.plan.comm import all_to_all_bytes
from trainctl.plan.estimate import Evaluator
from trainctl.plan.placement import Groups, Layout, ep_fits_nvlink, ep_groups_outside_nvlink, placement
from trainctl.plan.plan import build_plan, candidate_from_spec, context_from_spec
from trainctl.spec import load_spec
from trainctl.spec.models import DEFAULT_MOE_IMBALANCE

MIXTRAL = RECIPES / "mixtral-8x7b.yaml"
OLMOE = RECIPES / "olmoe-1b-7b.yaml"
TINY_MOE = RECIPES / "tiny-moe-cpu.yaml"


def counts(path):
    return ms.param_counts(ms.ModelShape.from_spec(load_spec(path).model))


# --- parameters --------------------------------------------------------------------------------------------


def test_mixtral_8x7b_total_and_active_parameters() -> None:
    L, h, kv, f, E, k, V = 32, 4096, 8 * 128, 14336, 8, 2, 32000
    attention = h * h + 2 * h * kv + h * h  # q, k, v, o: 41,943,040
    expert = 3 * h * f  # w1, w3 (4096 -> 14336) and w2 (14336 -> 4096): 176,160,768
    router = h * E  # the gate: 32,768
    norms = 2 * h  # input and post-attention RMSNorm
    per_layer = attention + E * expert + router + norms
    total = L * per_layer + V * h + V * h + h  # + embedding, untied LM head, final norm
    active = total - L * (E - k) * expert
    assert total == 46_702_792_704 and active == 12_879_925_248  # the arithmetic above, evaluated
    c = counts(MIXTRAL)
    assert (c.total, c.active) == (total, active)
    assert round(c.total / 1e9, 1) == 46.7 and round(c.active / 1e9, 1) == 12.9  # the published figures
    assert c.router == L * router and c.experts == L * E * expert and c.shared_experts == 0
    assert c.attention == L * attention and c.dense_mlp == 0


def test_olmoe_1b_7b_total_and_active_parameters() -> None:
    L, h, f, E, k, V = 16, 2048, 1024, 64, 8, 50304
    attention = 4 * h * h  # no GQA: 16,777,216
    expert = 3 * h * f  # SwiGLU: 6,291,456
    router = h * E  # 131,072
    per_layer = attention + E * expert + router + 2 * h
    total = L * per_layer + 2 * V * h + h
    active = total - L * (E - k) * expert
    assert total == 6_919_096_320 and active == 1_281_951_744
    c = counts(OLMOE)
    assert (c.total, c.active) == (total, active)
    # the paper's 6.9B and 1.3B (with QK-norm's 65,536 more: 6,919,161,856 and 1,282,017,280)
    assert round(c.total / 1e9, 1) == 6.9 and round(c.active / 1e9, 1) == 1.3


def test_shared_experts_dense_layers_and_biases_by_kind() -> None:
    m = ms.ModelShape(layers=6, hidden=32, heads=4, vocab=100, seq_len=16, ffn_hidden=64, activation="gelu",
                      bias=True, tied_embeddings=True,
                      moe=ms.MoEShape(num_experts=4, top_k=2, expert_ffn_hidden=48, shared_experts=1,
                                      shared_ffn_hidden=40, every=2, first_dense=1))
    assert [i for i in range(6) if m.moe.is_moe_layer(i)] == [2, 4] and m.moe_layers == 2
    h = 32
    attn, attn_b = 4 * h * h, 3 * h + h  # QKV bias 3h, output bias h
    dense_mlp, dense_b = 2 * h * 64, 64 + h
    expert, expert_b = 2 * h * 48, 48 + h
    shared, shared_b = 2 * h * 40, 40 + h
    norms = 2 * 2 * h  # two LayerNorms with biases
    dense_layer = attn + attn_b + dense_mlp + dense_b + norms
    moe_layer = attn + attn_b + 4 * (expert + expert_b) + h * 4 + shared + shared_b + norms
    total = 4 * dense_layer + 2 * moe_layer + 100 * h + 16 * h + 2 * h  # tied embedding, learned positions
    c = ms.param_counts(m)
    assert c.total == total
    assert c.active == total - 2 * 2 * (expert + expert_b)
    assert c.shared_experts == 2 * shared and c.router == 2 * h * 4 and c.dense_mlp == 4 * dense_mlp
    assert c.experts == 2 * 4 * (expert + expert_b)


def test_dense_models_are_unchanged() -> None:
    c = counts(RECIPES / "llama3-8b.yaml")
    assert c.active == c.total and c.router == c.experts == c.shared_experts == 0
    assert c.matmul == c.layers_matmul + c.lm_head


def test_model_flops_come_from_the_active_parameters_router_included() -> None:
    m = ms.ModelShape.from_spec(load_spec(MIXTRAL).model)
    L, h, s = 32, 4096, 4096
    n_active = L * (2 * h * h + 2 * h * 1024 + 2 * 3 * h * 14336 + h * 8) + 32000 * h  # + LM head
    assert ms.param_counts(m).matmul == n_active
    assert ms.model_flops_per_token_of(m) == 6 * n_active + 12 * L * h * s
    no_router = 6 * (n_active - L * h * 8) + 12 * L * h * s
    assert ms.model_flops_per_token_of(m) - no_router == 6 * L * h * 8


# --- all-to-all ---------------------------------------------------------------------------------------------


def test_all_to_all_bytes_against_a_hand_count() -> None:
    """tiny-moe-cpu: tp 2 with SP, micro-batch 4 of 64 tokens, hidden 64, top-2, ep 2, fp32 on the CPU.

    Each TP rank dispatches its sequence shard: 4*64/2 = 128 tokens, 2 copies each = 256 vectors of 64 fp32
    (256 bytes); with 2 of the 4 experts on each EP rank half the copies leave: 128 * 256 = 32,768 bytes per
    exchange. Dispatch + combine forward, their gradients backward: 4 exchanges = 131,072 bytes per layer
    and micro-batch; 4 MoE layers and 16/(4*2) = 2 micro-batches: 1,048,576 bytes per step."""
    assert all_to_all_bytes(tokens=128, top_k=2, hidden=64, act_bytes=4, ep=2) == 4 * 32_768
    spec = load_spec(TINY_MOE)
    plan = build_plan(spec)
    assert plan.est.comm_bytes["ep"] == 1_048_576
    assert plan.est.comm_link["ep"] == "nvlink"  # 4 ranks, one machine
    # full recompute repeats the forward dispatch and combine: 6 exchanges
    full = build_plan(load_spec(TINY_MOE, overrides=["train.recompute=full"]))
    assert full.est.comm_bytes["ep"] == 1_048_576 * 6 // 4
    # ep 1: no exchange
    one = build_plan(load_spec(TINY_MOE, overrides=["parallel.ep=1"]))
    assert one.est.comm_bytes["ep"] == 0


def test_all_to_all_formula() -> None:
    # per MoE layer: 4 x tokens_per_rank x top_k x hidden x bytes x (ep-1)/ep
    assert all_to_all_bytes(tokens=2048, top_k=2, hidden=4096, act_bytes=2, ep=4) == 4 * 2048 * 2 * 4096 * 2 * 3 / 4
    assert all_to_all_bytes(tokens=2048, top_k=2, hidden=4096, act_bytes=2, ep=1) == 0.0


# --- memory -------------------------------------------------------------------------------------------------


def test_expert_memory_falls_with_ep_and_optimizer_is_sharded_over_expert_dp() -> None:
    spec = load_spec(MIXTRAL, overrides=["parallel.tp=1", "parallel.pp=4", "parallel.dp=16",
                                         "parallel.sequence_parallel=false"])
    ev = Evaluator(context_from_spec(spec))
    base = candidate_from_spec(spec)
    experts, states = [], []
    for ep in (1, 2, 4, 8, 16):
        r = ev.evaluate(replace(base, ep=ep)).worst
        experts.append(r.expert_params)
        states.append(r.model_states)
        dense = r.params - r.expert_params
        # ZeRO-1: fp32 master + moments, 12 bytes, of a 1/dp slice of the dense and 1/(dp/ep) of the experts
        assert r.optimizer == pytest.approx(dense * 12 / 16 + r.expert_params * 12 / (16 // ep))
    assert all(a > b for a, b in zip(experts, experts[1:], strict=False))
    assert experts[0] == pytest.approx(experts[3] * 8)  # 8 experts on every GPU vs 1
    assert all(a > b for a, b in zip(states, states[1:], strict=False))


def test_load_imbalance_allowance_and_capacity_factor() -> None:
    dropless = build_plan(load_spec(TINY_MOE))
    assert dropless.to_json()["moe"]["load_imbalance_allowance"] == DEFAULT_MOE_IMBALANCE == 1.1
    capped = build_plan(load_spec(TINY_MOE, overrides=["model.moe.capacity_factor=1.25"]))
    assert capped.to_json()["moe"]["load_imbalance_allowance"] == 1.25
    assert capped.est.hardware_flops > dropless.est.hardware_flops  # capacity-padded buffers are computed
    assert capped.est.model_flops == dropless.est.model_flops  # MFU counts the model, not the padding


def test_the_imbalance_allowance_is_the_specs_and_paces_the_routed_experts() -> None:
    """estimate.moe_imbalance prices the imbalance a run measured (mfu-report names it): on one H100 the compute
    time grows by the extra routed-expert FLOPs at the planned rate and nothing else. tiny-moe's shape (presets):
    hidden 64, 4 layers all MoE, top-2 of 4 experts of SwiGLU width 96: 2 x 3 x 64 x 96 active expert weights a
    layer, 6 FLOPs per weight per token forward and backward, 16 x 64 tokens a step."""
    # a flat compute rate (estimate.compute_efficiency), so the extra FLOPs take exactly extra / rate
    one_gpu = ["cluster.gpu=h100-sxm", "cluster.gpus_per_node=1", "parallel.tp=1", "parallel.dp=1", "parallel.ep=1",
               "parallel.sequence_parallel=false", "estimate.compute_efficiency=0.6"]
    base = build_plan(load_spec(TINY_MOE, overrides=one_gpu)).to_json()
    heavy_plan = build_plan(load_spec(TINY_MOE, overrides=[*one_gpu, "estimate.moe_imbalance=2.0"]))
    heavy = heavy_plan.to_json()
    assert (base["moe"]["load_imbalance_allowance"], heavy["moe"]["load_imbalance_allowance"]) == (1.1, 2.0)
    extra_flops = (2.0 - 1.1) * 6 * (2 * 3 * 64 * 96) * 4 * (16 * 64)
    rate = base["hardware"]["peak_flops"] * base["assumptions"]["compute_efficiency"]
    assert heavy["prediction"]["compute_s"] - base["prediction"]["compute_s"] == pytest.approx(extra_flops / rate)
    assert heavy["prediction"]["step_time_s"] - base["prediction"]["step_time_s"] == pytest.approx(extra_flops / rate)
    assert heavy_plan.est.model_flops == build_plan(load_spec(TINY_MOE, overrides=one_gpu)).est.model_flops


# --- placement ----------------------------------------------------------------------------------------------


def test_ep_groups_follow_tp_cp_ep_dp_pp() -> None:
    layout = Layout(tp=2, pp=2, dp=4, gpus_per_node=8, nvlink_domain=8, ep=2)
    g = Groups(layout)
    assert g.ep[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.expert_dp[:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for r in placement(layout):
        assert r.dp == r.ep + layout.ep * r.edp
        assert r.rank == r.tp + layout.tp * (r.ep + layout.ep * (r.edp + layout.edp * r.pp))
    for kind in ("ep", "expert_dp"):
        assert sorted(x for grp in getattr(g, kind) for x in grp) == list(range(layout.world_size))
    assert ep_fits_nvlink(layout) and not ep_groups_outside_nvlink(layout)
    wide = Layout(tp=2, pp=1, dp=16, gpus_per_node=8, nvlink_domain=8, ep=8)
    assert not ep_fits_nvlink(wide) and len(ep_groups_outside_nvlink(wide)) == len(Groups(wide).ep)
    assert "ep" not in Groups(replace(layout, ep=1)).as_dict()  # dense layouts keep their group list


def test_ep_group_leaving_nvlink_warns() -> None:
    plan = build_plan(load_spec(OLMOE, overrides=["parallel.ep=16"]))
    assert plan.est.comm_link["ep"] == "inter_node"
    assert "EP_ACROSS_NVLINK" in [w.code for w in plan.warnings]
    assert "EP_ACROSS_NVLINK" not in [w.code for w in build_plan(load_spec(OLMOE)).warnings]


# --- CLI ----------------------------------------------------------------------------------------------------


def test_plan_json_moe_fields() -> None:
    out = trainctl("plan", str(MIXTRAL), "--json")
    assert out.returncode == 0, out.stderr
    j = json.loads(out.stdout)
    assert j["layout"]["ep"] == 4 and j["layout"]["expert_dp"] == 2
    moe = j["moe"]
    assert moe["params_total"] == j["params"]["total"] == 46_702_792_704
    assert moe["params_active"] == j["params"]["active"] == 12_879_925_248
    assert (moe["num_experts"], moe["top_k"], moe["experts_per_rank"], moe["moe_layers"]) == (8, 2, 2, 32)
    assert moe["ep_fits_nvlink"] and moe["all_to_all_link"] == "nvlink"
    # 8 MoE layers per pipeline rank x 64 micro-batches x 4 x 2048 tokens x 2 x 4096 x 2 bytes x 3/4
    assert moe["all_to_all_bytes_per_step"] == 8 * 64 * 4 * 2048 * 2 * 4096 * 2 * 3 // 4
    assert j["communication"]["per_kind"]["ep"]["bytes"] == moe["all_to_all_bytes_per_step"]
    assert j["communication"]["per_kind"]["expert_dp"]["link"] == "inter_node"
    assert j["memory"]["fits"]


def test_plan_ranks_shows_ep_coordinates() -> None:
    out = trainctl("plan", str(TINY_MOE), "--ranks", "--json")
    j = json.loads(out.stdout)
    assert [(r["ep"], r["edp"]) for r in j["placement"]] == [(0, 0), (0, 0), (1, 0), (1, 0)]
    assert j["groups"]["ep"] == [[0, 2], [1, 3]] and j["groups"]["expert_dp"] == [[0], [1], [2], [3]]
    text = trainctl("plan", str(TINY_MOE), "--ranks")
    assert text.returncode == 0 and "EP groups" in text.stdout and "EXPERT_DP groups" in text.stdout


def test_auto_searches_ep() -> None:
    res = search(load_spec(OLMOE), top=400)  # ZeRO, offload and schedule variants of ep 1 come first
    assert res.invalid == [] and res.top
    eps = {s.cand.ep for s, _, _ in res.top}
    assert len(eps) > 1 and max(eps) > 1
    for s, run, _ in res.top:
        assert run.parallel.ep == s.cand.ep and s.cand.dp % s.cand.ep == 0 and 64 % s.cand.ep == 0
    out = trainctl("plan", str(TINY_MOE), "--auto", "--json", "--top", "50")
    rows = json.loads(out.stdout)["top"]
    assert {1, 2} <= {r["ep"] for r in rows}
    dense = search(load_spec(RECIPES / "tiny-llama-cpu.yaml"), top=20)
    assert {s.cand.ep for s, _, _ in dense.top} == {1}

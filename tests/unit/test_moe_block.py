"""The MoE block (runtime/model/moe.py) against independent implementations: transformers' Mixtral (topk_softmax),
OLMoE (softmax_topk) and Qwen2-MoE (softmax_topk with a shared expert) blocks, built from a config with
random weights (no download), our weights copied in, fp64: router logits, routing, outputs and gradients
equal (transformers' routers round their softmax to fp32, so the reference routes with their formula in
fp64 and their own routing is checked to fp32 precision). The
balance loss against transformers' Switch/Mixtral `load_balancing_loss_func`, the z-loss against its
`router_z_loss_func`, and the capacity rule against a plain loop over GShard's priority order."""

from __future__ import annotations

import math

import pytest
import torch

from trainctl.model_shape import ModelShape, MoEShape
from trainctl.runtime.model.init import init_parameters
from trainctl.runtime.model.moe import MoE, MoEContext, regroup
from trainctl.runtime.model.parallel_context import ParallelContext
from trainctl.runtime.model.transformer import Block
from trainctl.runtime.parallel.tensor_parallel import TPContext

transformers = pytest.importorskip("transformers")

H, F_E, F_S, E, K, T, B = 32, 48, 40, 8, 2, 16, 3


def shape(router: str, shared: int = 0, activation: str = "swiglu", **moe) -> ModelShape:
    return ModelShape(layers=2, hidden=H, heads=4, vocab=64, seq_len=T, activation=activation, norm="rmsnorm",
                      position="rope", tied_embeddings=False,
                      moe=MoEShape(num_experts=E, top_k=K, expert_ffn_hidden=F_E, shared_experts=shared,
                                   shared_ffn_hidden=F_S, router=router, **moe))


def our_block(cfg: ModelShape, seed: int = 3) -> MoE:
    block = Block(cfg, ParallelContext(moe=MoEContext.single(cfg)), "none", layer=0)
    init_parameters(block, seed, TPContext.single())
    return block.mlp.double()


def copy_experts(ours: MoE, experts) -> None:
    """Our experts (fc1 = [gate; up], fc2 = down) into transformers' stacked 3-D expert weights."""
    with torch.no_grad():
        for e, m in ours.experts.items():
            experts.gate_up_proj[int(e)].copy_(m.fc1.weight)
            experts.down_proj[int(e)].copy_(m.fc2.weight)


def hf_routing_fp64(hf_gate, x: torch.Tensor, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' router formula (softmax over all experts, top_k, renormalised for Mixtral) evaluated in
    fp64: its own forward rounds the softmax to fp32 (`router_logits.float()`), which would hide fp64
    differences behind fp32 rounding."""
    probs = torch.softmax(hf_gate(x)[0], dim=-1)
    top, idx = torch.topk(probs, K, dim=-1)
    return (top / top.sum(-1, keepdim=True) if renormalise else top), idx


def check_against(ours: MoE, hf, x: torch.Tensor, renormalise: bool, shared_hf=None) -> None:
    """Router logits, routing, outputs and every gradient of ours against the transformers block."""
    hf = hf.double()
    x_ours, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    flat = x_hf.view(-1, H)
    logits_hf, w_hf32, idx_hf32 = hf.gate(flat)
    assert torch.allclose(ours.router(x_ours.view(-1, H)), logits_hf, rtol=0, atol=1e-13)
    w_hf, idx_hf = hf_routing_fp64(hf.gate, flat, renormalise)
    assert torch.equal(idx_hf, idx_hf32) and torch.allclose(w_hf, w_hf32.double(), rtol=1e-6, atol=0)
    y_hf = hf.experts(flat, idx_hf, w_hf)
    if shared_hf is not None:
        y_hf = y_hf + shared_hf(flat)
    y_hf = y_hf.view_as(x)
    y_ours = ours(x_ours)
    assert y_ours.dtype == torch.float64
    assert torch.allclose(y_ours, y_hf, rtol=0, atol=1e-15), (y_ours - y_hf).abs().max()
    # the gradient of an arbitrary function of the output (the aux losses are off here: HF adds none)
    probe = torch.randn_like(y_hf)
    (y_ours * probe).sum().backward()
    (y_hf * probe).sum().backward()
    assert torch.allclose(x_ours.grad, x_hf.grad, rtol=0, atol=1e-14)
    assert torch.allclose(ours.router.weight.grad, hf.gate.weight.grad, rtol=0, atol=1e-14)
    for e, m in ours.experts.items():
        assert torch.allclose(m.fc1.weight.grad, hf.experts.gate_up_proj.grad[int(e)], rtol=0, atol=1e-14)
        assert torch.allclose(m.fc2.weight.grad, hf.experts.down_proj.grad[int(e)], rtol=0, atol=1e-14)
    if shared_hf is not None:
        m = ours.shared
        want = torch.cat([shared_hf.gate_proj.weight.grad, shared_hf.up_proj.weight.grad])
        assert torch.allclose(m.fc1.weight.grad, want, rtol=0, atol=1e-14)
        assert torch.allclose(m.fc2.weight.grad, shared_hf.down_proj.weight.grad, rtol=0, atol=1e-14)


def test_topk_softmax_equals_mixtral() -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock

    ours = our_block(shape("topk_softmax"))
    hf = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=F_E, num_local_experts=E,
                                             num_experts_per_tok=K, hidden_act="silu", router_jitter_noise=0.0))
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.weight)
    copy_experts(ours, hf.experts)
    check_against(ours, hf, torch.randn(B, T, H, dtype=torch.float64), renormalise=True)


def test_softmax_topk_equals_olmoe() -> None:
    from transformers.models.olmoe.modeling_olmoe import OlmoeConfig, OlmoeSparseMoeBlock

    ours = our_block(shape("softmax_topk"))
    hf = OlmoeSparseMoeBlock(OlmoeConfig(hidden_size=H, intermediate_size=F_E, num_experts=E,
                                         num_experts_per_tok=K, hidden_act="silu", norm_topk_prob=False))
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.weight)
    copy_experts(ours, hf.experts)
    check_against(ours, hf, torch.randn(B, T, H, dtype=torch.float64), renormalise=False)


def test_softmax_topk_with_shared_expert_equals_qwen2_moe() -> None:
    """Qwen2-MoE scales its shared expert by a learned sigmoid gate; ours (DeepSeek-MoE's) is ungated, so
    the reference adds transformers' shared expert MLP ungated."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeConfig, Qwen2MoeSparseMoeBlock

    ours = our_block(shape("softmax_topk", shared=1))
    hf = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=F_E, num_experts=E,
                                               num_experts_per_tok=K, shared_expert_intermediate_size=F_S,
                                               hidden_act="silu", norm_topk_prob=False))
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.weight)
        s = ours.shared
        gate, up = s.fc1.weight.chunk(2)
        hf.shared_expert.gate_proj.weight.copy_(gate)
        hf.shared_expert.up_proj.weight.copy_(up)
        hf.shared_expert.down_proj.weight.copy_(s.fc2.weight)
    copy_experts(ours, hf.experts)
    check_against(ours, hf, torch.randn(B, T, H, dtype=torch.float64), renormalise=False,
                  shared_hf=hf.shared_expert.double())


@pytest.mark.parametrize("router", ["topk_softmax", "softmax_topk"])
def test_balance_and_z_losses_against_transformers(router: str) -> None:
    """Per sequence: our balance loss normalises f_i to sum to 1 (Megatron-Core's convention), where the
    Mixtral function's f_i sums to top_k (it accumulates in fp32: agreement to fp32 precision); the z-loss
    is Switch Transformers' function (fp64 here)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

    ours = our_block(shape(router))
    x = torch.randn(B, T, H, dtype=torch.float64)
    logits = ours.router(x.view(-1, H))
    probs = logits.softmax(-1)
    _, idx = ours._top_k(logits, probs)
    balance, z = ours._losses(logits, probs, idx, B)
    for b in range(B):
        seq = logits.view(B, T, E)[b]
        assert math.isclose(balance[b].item(), load_balancing_loss_func((seq,), E, K).item() / K, rel_tol=1e-6)
        assert math.isclose(z[b].item(), router_z_loss_func(seq.unsqueeze(0)).item(), rel_tol=1e-12)


def gshard_keep(idx: torch.Tensor, capacity: int) -> torch.Tensor:
    """A plain loop: per sequence, first choices of every token in order, then second choices; an expert
    takes an assignment while it has room."""
    Bn, Tn, k = idx.shape
    keep = torch.zeros_like(idx, dtype=torch.bool)
    for b in range(Bn):
        load = [0] * E
        for j in range(k):
            for t in range(Tn):
                e = int(idx[b, t, j])
                if load[e] < capacity:
                    load[e] += 1
                    keep[b, t, j] = True
    return keep


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_drops_in_gshard_order(factor: float) -> None:
    ours = our_block(shape("topk_softmax", capacity_factor=factor))
    x = torch.randn(B, T, H, dtype=torch.float64) * 3  # a skewed router: some experts over capacity
    logits = ours.router(x.view(-1, H))
    _, idx = ours._top_k(logits, logits.softmax(-1))
    keep = ours._capacity_keep(idx.view(B, T, K))
    want = gshard_keep(idx.view(B, T, K), math.ceil(factor * T * K / E))
    assert torch.equal(keep, want)
    if factor == 0.5:
        assert (~keep).any()  # the case really drops
    # a dropped assignment contributes nothing: the block equals the dropless block with its weight zeroed
    y = ours(x)
    row = ours.moe.stats.records[0][-1]
    assert row[E].item() == (~want).sum().item()  # dropped assignments counted
    dropless = our_block(shape("topk_softmax"))
    weights, idx2 = dropless._top_k(logits, logits.softmax(-1))
    masked = dropless._routed(x.view(-1, H), idx2, weights * want.view(-1, K), None).view(B, T, H)
    assert torch.allclose(y, masked, rtol=0, atol=1e-12)


def test_regroup_reorders_chunks() -> None:
    sizes = torch.tensor([2, 0, 3, 1])
    rows = torch.arange(6)  # chunks [0,1] [] [2,3,4] [5]
    assert regroup(sizes, torch.tensor([2, 0, 3, 1])).tolist() == [2, 3, 4, 0, 1, 5]
    assert rows.index_select(0, regroup(sizes, torch.arange(4))).tolist() == rows.tolist()

"""The bundled trainer's model in one process: every variant, recompute, layout-independent init, counts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trainctl.model_shape import ModelShape, param_counts
from trainctl.runtime.model.init import full_tensor, iter_param_meta
from trainctl.runtime.model.parallel_context import ParallelContext
from trainctl.runtime.model.transformer import build_stage, loss_fn
from trainctl.runtime.parallel.tensor_parallel import (
    ShardSpec,
    TPContext,
    shard_tensor,
    unshard_tensors,
    vocab_parallel_cross_entropy,
)
from trainctl.spec.models import ParallelSpec, RunSpec

SINGLE = TPContext.single()
BASE = dict(layers=2, hidden=32, heads=4, vocab=255, seq_len=16)
VARIANTS = {
    "gpt2": dict(norm="layernorm", position="learned", activation="gelu", bias=True, tied_embeddings=True),
    "gpt2-untied-nobias": dict(bias=False, tied_embeddings=False),
    "llama-gqa": dict(norm="rmsnorm", position="rope", activation="swiglu", kv_heads=2, ffn_hidden=96,
                      tied_embeddings=False, rope_theta=500000.0),
    "llama-tied-mha": dict(norm="rmsnorm", position="rope", activation="swiglu", tied_embeddings=True),
    "mqa-dropout": dict(position="rope", kv_heads=1, dropout=0.1),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def batch(cfg: ModelShape, seed: int = 0, b: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab, (b, cfg.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def fwd_bwd(model, cfg, x, y, rng_seed=0):
    torch.manual_seed(rng_seed)
    loss = loss_fn(model(x), y, cfg, SINGLE)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_forward_backward(variant):
    cfg = ModelShape(**BASE, **VARIANTS[variant])
    model = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=1)
    x, y = batch(cfg)
    logits = model(x)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab)
    loss = loss_fn(logits, y, cfg, SINGLE)
    # the vocab-parallel CE at tp 1 is the ordinary cross-entropy; a fresh model predicts ~uniformly
    assert torch.allclose(loss, F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1)), atol=1e-5)
    assert abs(loss.item() - math.log(cfg.vocab)) < 0.2
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg).total
    names = {n for n, _ in model.named_parameters()}
    assert ("head.weight" in names) == (not cfg.tied_embeddings)
    assert ("embed.pos.weight" in names) == (cfg.position == "learned")
    assert model.tied_parameters() == []


@pytest.mark.parametrize("fp32_residual", [False, True])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_residual_stream_is_in_the_compute_dtype(variant, fp32_residual):
    """Under bf16 autocast over fp32 weights the residual stream stays bf16 from the embedding to the head (an
    fp32 bias or position table must not promote it back to fp32), so the norms keep a 2-byte input, as
    Megatron's do, or fp32 throughout with model.fp32_residual; and the bf16 forward stays close to the fp32
    one (bf16's unit roundoff is 2^-9)."""
    cfg = ModelShape(**BASE, **VARIANTS[variant], fp32_residual=fp32_residual)
    stream = torch.float32 if fp32_residual else torch.bfloat16
    model = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=1)
    model.eval()  # no dropout: the two forwards see the same function
    x, y = batch(cfg)
    seen = []
    for block in model.layers.values():
        block.register_forward_hook(lambda _m, args, out: seen.append((args[0].dtype, out.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = loss_fn(model(x), y, cfg, SINGLE)
    assert seen == [(stream, stream)] * cfg.layers
    high = loss_fn(model(x), y, cfg, SINGLE)
    assert abs(low.item() - high.item()) < 0.02 * high.item()


def test_causal():
    """Changing a later token never changes earlier logits."""
    cfg = ModelShape(**BASE, **VARIANTS["llama-gqa"])
    model = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=1)
    x, _ = batch(cfg)
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % cfg.vocab
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("variant", ["gpt2", "llama-gqa", "mqa-dropout"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_is_exact(variant, recompute):
    """Selective and full recompute give the same loss and grads as none (bitwise; dropout replayed)."""
    kw = {**BASE, **VARIANTS[variant]}
    cfg = ModelShape(**kw)
    x, y = batch(cfg)
    l0, g0 = fwd_bwd(build_stage(cfg, range(2), first=True, last=True, seed=3, dtype=torch.float64), cfg, x, y)
    l1, g1 = fwd_bwd(build_stage(cfg, range(2), first=True, last=True, seed=3, recompute=recompute,
                                 dtype=torch.float64),
                     cfg, x, y)
    assert torch.equal(l0, l1)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


@pytest.mark.parametrize("variant", ["gpt2", "llama-gqa"])
def test_pipeline_split_keeps_names_and_values(variant):
    """Layers 0-1 + 2-3 in two stages vs all four in one: identical parameters by name (layout-free init),
    and chaining the two stages computes the same loss and grads (tied grads: sum of the two copies)."""
    cfg = ModelShape(**{**BASE, **VARIANTS[variant], "layers": 4})
    whole = build_stage(cfg, range(4), first=True, last=True, seed=5, dtype=torch.float64)
    first = build_stage(cfg, range(0, 2), first=True, last=False, seed=5, dtype=torch.float64)
    last = build_stage(cfg, range(2, 4), first=False, last=True, seed=5, dtype=torch.float64)
    ref = dict(whole.named_parameters())
    split = {**dict(first.named_parameters()), **dict(last.named_parameters())}
    assert set(split) == set(ref)
    assert "layers.3.attn.qkv.weight" in dict(last.named_parameters())
    for stage in (first, last):
        for n, p in stage.named_parameters():
            assert torch.equal(p, ref[n]), n
    if cfg.tied_embeddings:
        assert first.tied_parameters() == [first.embed.tok.weight]
        assert last.tied_parameters() == [last.embed.tok.weight]
        assert torch.equal(first.embed.tok.weight, last.embed.tok.weight)
    else:
        assert first.tied_parameters() == [] and last.tied_parameters() == []
    x, y = batch(cfg)
    l_ref, g_ref = fwd_bwd(whole, cfg, x, y)
    torch.manual_seed(0)
    loss = loss_fn(last(first(x)), y, cfg, SINGLE)
    loss.backward()
    assert abs(loss.item() - l_ref.item()) <= 1e-12
    grads: dict[str, torch.Tensor] = {}
    for stage in (first, last):
        for n, p in stage.named_parameters():
            grads[n] = grads[n] + p.grad if n in grads else p.grad
    for n, g in g_ref.items():
        assert torch.allclose(grads[n], g, atol=1e-13, rtol=0), n


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_shards_are_slices_of_the_single_model(tp_size):
    """Init is layout-independent across TP too: the shards built for each TP rank (no process group needed to
    build) reassemble into exactly the single-process parameters; padded vocab rows are zero."""
    cfg = ModelShape(**{**BASE, "heads": 4, "kv_heads": 4, "hidden": 32, "ffn_hidden": 64},
                      norm="rmsnorm", position="rope", activation="swiglu", tied_embeddings=False)
    single = build_stage(cfg, range(2), first=True, last=True, seed=9)
    shards = [build_stage(cfg, range(2), first=True, last=True, seed=9,
                          ctx=ParallelContext(tp=TPContext(group=None, size=tp_size, rank=r, sequence_parallel=True)))
              for r in range(tp_size)]
    metas = shards[0].named_param_meta()
    per_rank = [dict(s.named_parameters()) for s in shards]
    for name, p in single.named_parameters():
        full = unshard_tensors([d[name].detach() for d in per_rank], metas[name].shard)
        assert torch.equal(full, p.detach()), name
    padded = cfg.padded_vocab(tp_size)
    assert shards[-1].embed.tok.weight.shape == (padded // tp_size, cfg.hidden)
    assert padded == 256 and shards[-1].embed.tok.weight[-1].abs().sum() == 0  # the one padded row


def test_init_independent_of_dtype_and_rules():
    cfg = ModelShape(**BASE, bias=True)
    m32 = build_stage(cfg, range(2), first=True, last=True, seed=2)
    m64 = build_stage(cfg, range(2), first=True, last=True, seed=2, dtype=torch.float64)
    for (n, a), (_, b) in zip(m32.named_parameters(), m64.named_parameters(), strict=True):
        assert b.dtype == torch.float64 and torch.equal(a.double(), b), n
    other = build_stage(cfg, range(2), first=True, last=True, seed=3)
    assert not torch.equal(other.embed.tok.weight, m32.embed.tok.weight)
    p = dict(m32.named_parameters())
    assert torch.equal(p["layers.0.attn_norm.weight"], torch.ones(cfg.hidden))
    assert torch.equal(p["layers.0.attn.qkv.bias"], torch.zeros(3 * cfg.hidden))
    assert abs(p["embed.tok.weight"].std().item() - 0.02) < 0.002
    assert abs(p["layers.1.mlp.fc2.weight"].std().item() - 0.02 / math.sqrt(4)) < 0.002
    # every parameter is covered by metadata, and different names give different tensors
    names = [n for n, _p, _m in iter_param_meta(m32)]
    assert sorted(names) == sorted(n for n, _ in m32.named_parameters())
    meta = m32.named_param_meta()
    assert not torch.equal(full_tensor(meta["layers.0.attn.qkv.weight"], 2, "layers.0.attn.qkv.weight"),
                           full_tensor(meta["layers.1.attn.qkv.weight"], 2, "layers.1.attn.qkv.weight"))


def test_shard_unshard_roundtrip_fused_and_padded():
    full = torch.arange(10 * 3, dtype=torch.float64).view(10, 3)
    spec = ShardSpec(0, (4, 2, 4))  # e.g. q, k, v rows
    shards = [shard_tensor(full, spec, r, 2) for r in range(2)]
    assert torch.equal(shards[0][:, 0], torch.tensor([0, 3, 12, 18, 21], dtype=torch.float64))
    assert torch.equal(unshard_tensors(shards, spec), full)
    vocab = torch.randn(7, 3)
    pspec = ShardSpec(0, (8,), logical=7)
    vshards = [shard_tensor(vocab, pspec, r, 4) for r in range(4)]
    assert all(s.shape == (2, 3) for s in vshards) and vshards[-1][-1].abs().sum() == 0
    assert torch.equal(unshard_tensors(vshards, pspec), vocab)
    col = ShardSpec(1, (6,))
    w = torch.randn(2, 6)
    assert torch.equal(unshard_tensors([shard_tensor(w, col, r, 3) for r in range(3)], col), w)


def test_vocab_parallel_ce_single_rank_matches_torch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    loss = vocab_parallel_cross_entropy(logits, targets, SINGLE, 11)
    (grad,) = torch.autograd.grad(loss, logits)
    ref = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    (ref_grad,) = torch.autograd.grad(ref, logits)
    assert abs(loss.item() - ref.item()) < 1e-14
    assert torch.allclose(grad, ref_grad, atol=1e-15, rtol=0)
    # bf16 logits: statistics in fp32, fp32 loss, bf16 grad
    lb = logits.detach().bfloat16().requires_grad_(True)
    lossb = vocab_parallel_cross_entropy(lb, targets, SINGLE, 11)
    lossb.backward()
    assert lossb.dtype == torch.float32 and lb.grad.dtype == torch.bfloat16
    assert abs(lossb.item() - ref.item()) < 0.05


def _spec(**model) -> RunSpec:
    return RunSpec(name="t", model=model, train={"global_batch": 8, "steps": 1, "recompute": "selective"})


@pytest.mark.parametrize("model", [{"preset": "tiny"}, {"preset": "gpt2-124m"}, {"preset": "llama3-8b"},
                                   {"preset": "llama3-8b", "tied_embeddings": True}])
def test_shape_from_spec(model):
    spec = _spec(**model)
    cfg = ModelShape.from_spec(spec.model)
    m = spec.model
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, cfg.vocab, cfg.rope_theta) == \
        (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn_hidden, m.vocab, m.rope_theta)
    for tp in (1, 3, 8):
        assert cfg.padded_vocab(tp) == spec.model_copy(update={"parallel": ParallelSpec(tp=tp)}).padded_vocab


def test_param_counts_match_a_built_model():
    """The arithmetic of trainctl.model_shape (what the planner and the MFU meter use) against the modules,
    by kind: LayerNorm biases only with bias: true, position table only when learned, head only untied."""
    for kw in VARIANTS.values():
        cfg = ModelShape(**BASE, **kw)
        stage = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=0)
        counts = param_counts(cfg)
        by_kind = {"norms": 0, "biases": 0, "position": 0}
        for name, p in stage.named_parameters():
            kind = ("norms" if "norm" in name else "position" if name == "embed.pos.weight"
                    else "biases" if name.endswith(".bias") else None)
            if kind:
                by_kind[kind] += p.numel()
        assert by_kind == {"norms": counts.norms, "biases": counts.biases, "position": counts.position}, kw
        assert sum(p.numel() for p in stage.parameters()) == counts.total
    # llama3-8b: 8.03 B parameters (published, Dubey et al. 2024)
    assert abs(param_counts(ModelShape.from_spec(_spec(preset="llama3-8b").model)).total / 1e9 - 8.03) < 0.01

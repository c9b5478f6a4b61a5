"""The bundled trainer's model: a decoder-only transformer covering GPT-2 and Llama-style variants.

LayerNorm or RMSNorm, learned or rotary positions, GELU or SwiGLU MLP, multi-head or grouped-query attention,
optional biases, tied or untied embeddings, dropout, activation recompute (none / selective / full).

The model is written once, with Megatron tensor parallelism built in (trainctl.runtime.parallel.tensor_parallel): the
layers receive one `ParallelContext` (runtime/model/parallel_context.py: TP, CP and MoE state), and with
`ParallelContext()` every parallel layer is a plain layer and no communication happens. A pipeline stage is a
`StageModule` holding a contiguous range of transformer layers, keyed by their GLOBAL index in an
`nn.ModuleDict`, so parameter names (and hence init and checkpoints) do not depend on the pipeline split.

Parameter names (global, identical in every layout):
    embed.tok.weight            token embedding [V, H] (vocab-sharded; also the LM head when tied)
    embed.pos.weight            learned positions [seq_len, H] (first stage only)
    layers.<i>.attn_norm.{weight,bias}
    layers.<i>.attn.qkv.{weight,bias}    fused [q; k; v] rows, column-parallel (each of q/k/v split over TP)
    layers.<i>.attn.proj.{weight,bias}   row-parallel
    layers.<i>.mlp_norm.{weight,bias}
    layers.<i>.mlp.fc1.{weight,bias}     column-parallel; SwiGLU fuses [gate; up]
    layers.<i>.mlp.fc2.{weight,bias}     row-parallel
    layers.<i>.mlp.router.weight         an MoE layer's gate [E, H] (replicated; runtime/model/moe.py), then
    layers.<i>.mlp.experts.<e>.fc{1,2}.* routed expert e (global index: only this EP rank's experts exist)
    layers.<i>.mlp.shared.fc{1,2}.*      the shared experts (one dense MLP)
    final_norm.{weight,bias}
    head.weight                 untied LM head [V, H] (vocab-sharded)
With tied embeddings and the first and last stage in different modules, the last stage holds its own copy
named `embed.tok.weight` (same name, so same init and same checkpoint key); the engine sums the two copies'
grads over the embedding group (`tied_parameters()`).

Activations are [B, T, H]; under sequence parallelism a stage's hidden-state input/output is this TP rank's
sequence chunk [B, T/tp, H]. The last stage returns vocab-parallel logits [B, T, V_padded/tp]. Under context
parallelism (trainctl.runtime.parallel.context_parallel) T is this CP rank's T/cp tokens (chunks i and 2cp-1-i of each
sequence): attention all-gathers K/V over the CP group and positions are those of the rank's chunks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from trainctl.model_shape import ModelShape
from trainctl.runtime.model.init import init_parameters, iter_param_meta
from trainctl.runtime.model.lean_ops import rms_norm_16bit, swiglu
from trainctl.runtime.model.moe import MoE
from trainctl.runtime.model.parallel_context import ParallelContext
from trainctl.runtime.parallel import context_parallel
from trainctl.runtime.parallel.context_parallel import CPContext
from trainctl.runtime.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParamMeta,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    column_parallel_linear,
    compute_dtype,
    scatter_to_sp_region,
    sp_param,
    tp_dropout,
    tp_rng_fork,
    vocab_parallel_cross_entropy,
)

# ---------------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------------


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the hidden dim. Weights are replicated over TP; under sequence parallelism
    each rank normalises only its sequence chunk, so the weight grads are partial (ParamMeta.sequence_parallel)."""

    def __init__(self, cfg: ModelShape, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.kind = cfg.norm
        self.eps = cfg.norm_eps
        self.shape = (cfg.hidden,)
        self.weight = nn.Parameter(torch.empty(cfg.hidden))
        self.param_meta = {"weight": ParamMeta((cfg.hidden,), None, "ones", sequence_parallel=tp.sp)}
        if cfg.norm == "layernorm" and cfg.bias:
            self.bias = nn.Parameter(torch.empty(cfg.hidden))
            self.param_meta["bias"] = ParamMeta((cfg.hidden,), None, "zeros", sequence_parallel=tp.sp)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        # the weights are cast to the stream's dtype: fp32 master weights to a bf16 stream, bf16 ZeRO-1/2 or
        # FSDP-gathered weights to an fp32 one (model.fp32_residual, or fp32 compute)
        w = sp_param(self.weight, self.tp).to(x.dtype)
        b = sp_param(self.bias, self.tp).to(x.dtype) if self.bias is not None else None
        if x.dtype in (torch.bfloat16, torch.float16):
            # a 16-bit stream is normalised in fp32 inside the kernel and keeps only its 16-bit input for
            # backward, as Megatron's fused norms do; autocast would first cast it to an fp32 copy
            with torch.autocast(x.device.type, enabled=False):
                if self.kind == "rmsnorm":
                    return rms_norm_16bit(x, w, self.eps)
                return F.layer_norm(x, self.shape, w, b, self.eps)
        if self.kind == "rmsnorm":
            return F.rms_norm(x, self.shape, w, self.eps)
        return F.layer_norm(x, self.shape, w, b, self.eps)


class Rotary(nn.Module):
    """Rotary position embedding (RoFormer; the 'rotate half' layout of GPT-NeoX / Hugging Face Llama)."""

    def __init__(self, head_dim: int, max_len: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, seq_len: int, dtype: torch.dtype, cp: CPContext | None = None) -> tuple[Tensor, Tensor]:
        """cos/sin of the first seq_len positions, or of this CP rank's positions (seq_len = T/cp)."""
        if seq_len * (cp.size if cp else 1) > self.cos.shape[0]:
            raise ValueError(f"sequence length {seq_len} exceeds the model's seq_len {self.cos.shape[0]}")
        if cp is not None and cp.enabled:
            pos = cp.positions(seq_len, self.cos.device)
            return self.cos[pos].to(dtype), self.sin[pos].to(dtype)
        return self.cos[:seq_len].to(dtype), self.sin[:seq_len].to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [T, head_dim]."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Causal self-attention; QKV column-parallel (heads/tp query and kv_heads/tp kv heads per rank), output
    projection row-parallel. The core (rotary + softmax attention) is what selective recompute recomputes."""

    def __init__(self, cfg: ModelShape, ctx: ParallelContext, out_std: float, recompute_core: bool):
        super().__init__()
        self.cfg = cfg
        self.tp = tp = ctx.tp
        self.cp = ctx.cp
        self.recompute_core = recompute_core
        hd = cfg.head_dim
        self.head_dim = hd
        self.local_q = cfg.heads // tp.size * hd
        self.local_kv = cfg.kv_heads // tp.size * hd
        self.qkv = ColumnParallelLinear(cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * hd, tp, bias=cfg.bias,
                                        parts=(cfg.heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd),
                                        std=cfg.init_std)
        self.proj = RowParallelLinear(cfg.heads * hd, cfg.hidden, tp, bias=cfg.bias, std=out_std)

    def core(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor | None, sin: Tensor | None) -> Tensor:
        if cos is not None:
            # rotated in the tables' precision (at least fp32), then back to the compute dtype: bf16 angles
            # would lose digits at long positions (measured: bf16 rotary trains worse); saves only the tables
            q = apply_rotary(q.to(cos.dtype), cos, sin).to(q.dtype)
            k = apply_rotary(k.to(cos.dtype), cos, sin).to(k.dtype)
        p = self.cfg.dropout if self.training else 0.0
        if self.cp.enabled:  # the spec rules refuse dropout with cp
            return context_parallel.attention(q, k, v, self.cp)
        gqa = q.shape[1] != k.shape[1]
        if p > 0.0 and self.tp.enabled:
            # attention heads are sharded over TP: dropout masks must differ across TP ranks
            with tp_rng_fork(self.tp, q.device):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        qkv = self.qkv(x)  # [B, T, local_q + 2 local_kv] (full T: gathered under SP)
        B, T, _ = qkv.shape
        q, k, v = qkv.split([self.local_q, self.local_kv, self.local_kv], dim=-1)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope if rope is not None else (None, None)
        if self.recompute_core and torch.is_grad_enabled():
            y = checkpoint(self.core, q, k, v, cos, sin, use_reentrant=False, preserve_rng_state=True)
        else:
            y = self.core(q, k, v, cos, sin)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.proj(y)


class MLP(nn.Module):
    """The dense MLP (inner size `ffn`, default the model's), also one shared expert. `tp_region=False` makes
    it a routed expert: its input is already in the TP region and it returns the partial sum of fc2 without
    the bias, which the MoE block reduces for all its experts at once (runtime/model/moe.py)."""

    def __init__(self, cfg: ModelShape, tp: TPContext, out_std: float, ffn: int | None = None,
                 tp_region: bool = True):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        f = cfg.ffn_hidden if ffn is None else ffn
        self.fc1 = ColumnParallelLinear(cfg.hidden, 2 * f if self.swiglu else f, tp, bias=cfg.bias,
                                        parts=(f, f) if self.swiglu else None, std=cfg.init_std,
                                        gather_input=tp_region)
        self.fc2 = RowParallelLinear(f, cfg.hidden, tp, bias=cfg.bias, std=out_std, reduce_output=tp_region)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)  # SwiGLU: the local shard is [gate_r; up_r]
        h = swiglu(h) if self.swiglu else F.gelu(h, approximate="tanh")
        return self.fc2(h)


class Block(nn.Module):
    """Pre-norm transformer block: x + drop(attn(norm(x))), then + drop(mlp(norm(x)))."""

    def __init__(self, cfg: ModelShape, ctx: ParallelContext, recompute: str, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tp = tp = ctx.tp
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        self.attn_norm = Norm(cfg, tp)
        self.attn = Attention(cfg, ctx, out_std, recompute_core=recompute == "selective")
        self.mlp_norm = Norm(cfg, tp)
        moe_layer = ctx.moe is not None and ctx.moe.is_moe_layer(layer)
        self.mlp = _moe_mlp(cfg, ctx, out_std, layer) if moe_layer else MLP(cfg, tp, out_std)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        p, train, tp = self.cfg.dropout, self.training, self.tp
        # after the row-parallel reduction activations are replicated over TP, or sequence-sharded under SP
        x = x + tp_dropout(self.attn(self.attn_norm(x), rope), p, train, tp, sharded=tp.sp)
        x = x + tp_dropout(self.mlp(self.mlp_norm(x)), p, train, tp, sharded=tp.sp)
        return x


def _moe_mlp(cfg: ModelShape, ctx: ParallelContext, out_std: float, layer: int) -> MoE:
    """An MoE layer's MLP: this EP rank's routed experts (each the dense MLP's shape at expert_ffn_hidden,
    named by global expert index) and the shared experts, one dense MLP of shared_experts x shared_ffn_hidden
    (DeepSeek-MoE's: n MLPs side by side are one MLP n times as wide)."""
    e, tp = cfg.moe, ctx.tp
    assert e is not None and ctx.moe is not None
    experts = {i: MLP(cfg, tp, out_std, ffn=e.expert_ffn_hidden, tp_region=False)
               for i in ctx.moe.ep.experts_of(e.num_experts)}
    shared = MLP(cfg, tp, out_std, ffn=e.shared_experts * e.shared_ffn_hidden) if e.shared_experts else None
    return MoE(cfg, ctx, experts=experts, shared=shared, layer=layer)


class PositionEmbedding(nn.Module):
    def __init__(self, cfg: ModelShape, tp: TPContext):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.seq_len, cfg.hidden))
        self.param_meta = {"weight": ParamMeta((cfg.seq_len, cfg.hidden), None, "normal", cfg.init_std)}


class Embedding(nn.Module):
    """Token (+ learned position) embedding of the first stage; on a separate last stage with tied
    embeddings, only the token table (`lookup=False`) as the LM head's weight."""

    def __init__(self, cfg: ModelShape, ctx: ParallelContext, lookup: bool = True):
        super().__init__()
        self.cfg = cfg
        self.tp = tp = ctx.tp
        self.cp = ctx.cp
        self.learned_pos = lookup and cfg.position == "learned"
        # without learned positions the token lookup can reduce-scatter straight into the SP region
        self.tok = VocabParallelEmbedding(cfg.vocab, padded_vocab=cfg.padded_vocab(tp.size), dim=cfg.hidden, tp=tp,
                                          std=cfg.init_std, scatter_output=tp.sp and not self.learned_pos)
        if self.learned_pos:
            self.pos = PositionEmbedding(cfg, tp)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok(ids)
        if self.learned_pos:
            seq = ids.shape[1]
            if seq * self.cp.size > self.cfg.seq_len:
                raise ValueError(f"sequence length {seq} exceeds the model's seq_len {self.cfg.seq_len}")
            pos = self.pos.weight[self.cp.positions(seq, ids.device)] if self.cp.enabled else self.pos.weight[:seq]
            h = h + pos
        # the residual stream is in the compute dtype, bf16 under bf16 autocast as in Megatron: the norm inputs,
        # a recomputed block's input and the pipeline's messages are 2 bytes a value; or at least fp32 with
        # model.fp32_residual (docs/design/memory.md, "Memory model")
        h = h.to(residual_dtype(self.cfg, compute_dtype(h)))
        if self.learned_pos and self.tp.sp:
            h = scatter_to_sp_region(h, self.tp)
        return tp_dropout(h, self.cfg.dropout, self.training, self.tp, sharded=self.tp.sp)


def residual_dtype(cfg: ModelShape, compute: torch.dtype) -> torch.dtype:
    """The residual stream's dtype when the matmuls compute in `compute`: that dtype, or at least fp32 with
    model.fp32_residual."""
    return torch.promote_types(compute, torch.float32) if cfg.fp32_residual else compute


# ---------------------------------------------------------------------------------------------------------
# Pipeline stage
# ---------------------------------------------------------------------------------------------------------


class StageModule(nn.Module):
    """One pipeline stage: [embedding] + layers[layer_ids] + [final norm + LM head]. See the module docstring."""

    def __init__(self, cfg: ModelShape, layer_ids: range, *, first: bool, last: bool,
                 ctx: ParallelContext | None = None, recompute: str = "none"):
        super().__init__()
        ctx = (ctx or ParallelContext()).with_all_experts(cfg)
        self.cfg = cfg
        self.recompute = recompute
        self.tp = tp = ctx.tp
        self.cp = ctx.cp
        self.first = first
        self.last = last
        self.layer_ids = layer_ids
        self.padded_vocab = cfg.padded_vocab(tp.size)
        if first or (last and cfg.tied_embeddings):
            self.embed = Embedding(cfg, ctx, lookup=first)
        self.layers = nn.ModuleDict({str(i): Block(cfg, ctx, recompute, layer=i) for i in layer_ids})
        if cfg.position == "rope" and len(layer_ids):
            self.rope = Rotary(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        if last:
            self.final_norm = Norm(cfg, tp)
            if not cfg.tied_embeddings:
                self.head = ColumnParallelLinear(cfg.hidden, self.padded_vocab, tp, logical_out=cfg.vocab,
                                                 std=cfg.init_std)

    def _block(self, block: Block, x: Tensor, rope) -> Tensor:
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(block, x, rope, use_reentrant=False, preserve_rng_state=True)
        return block(x, rope)

    def head_weight(self) -> Tensor:
        return self.embed.tok.weight if self.cfg.tied_embeddings else self.head.weight

    def forward(self, x: Tensor) -> Tensor:
        if self.first:
            x = self.embed(x)
        if len(self.layers):
            rope = None
            if self.cfg.position == "rope":
                T = x.shape[1] * (self.tp.size if self.tp.sp else 1)
                rope = self.rope(T, torch.promote_types(x.dtype, torch.float32), self.cp)
            for block in self.layers.values():
                x = self._block(block, x, rope)
        if self.last:
            x = self.final_norm(x)
            x = column_parallel_linear(x, self.head_weight(), None, self.tp)  # [B, T, V_padded/tp]
        return x

    def tied_parameters(self) -> list[nn.Parameter]:
        """The embedding/LM-head weight whose grads the engine sums over the embedding group (first and last
        stage in different modules, tied embeddings); [] otherwise."""
        if self.cfg.tied_embeddings and self.first != self.last:
            return [self.embed.tok.weight]
        return []

    def tied_parameter_names(self) -> set[str]:
        """Names of `tied_parameters()`, found by identity (FSDP replaces Parameter objects; names survive)."""
        ids = {id(q) for q in self.tied_parameters()}
        return {n for n, q in self.named_parameters() if id(q) in ids}

    def named_param_meta(self) -> dict[str, ParamMeta]:
        """Global parameter name -> ParamMeta (full shape, TP sharding, init) for checkpoint resharding and for
        counting replicated parameters once in the grad norm."""
        return {name: meta for name, _p, meta in iter_param_meta(self)}


def build_stage(cfg: ModelShape, layer_ids: range, *, first: bool, last: bool, seed: int,
                ctx: ParallelContext | None = None, recompute: str = "none",
                device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> StageModule:
    """Build a stage and initialise it deterministically and layout-independently (trainctl.runtime.model.init).
    `ctx` None: one process, no parallelism.

    The shape was checked by the spec rules (divisibility by tp, even rotary head_dim, ...). Nothing of the
    model is sharded by context parallelism: `ctx.cp` only changes what attention and positions do."""
    stage = StageModule(cfg, layer_ids, first=first, last=last, ctx=ctx, recompute=recompute)
    if device is not None or dtype is not None:
        stage.to(device=device, dtype=dtype)
    init_parameters(stage, seed, stage.tp)
    return stage


def compile_blocks(stages: list[StageModule], backend: str | None) -> None:
    """train.compile: compile every transformer block in place with `backend` (None: leave them eager). The
    parameters and state-dict keys stay as they are, so checkpoints do not change. Blocks share one code
    object, so one compilation serves them all; a full-recompute checkpoint wraps the compiled block and reruns
    it."""
    if backend is None:
        return
    for stage in stages:
        for block in stage.layers.values():
            block.compile(backend=backend)


def loss_fn(logits_shard: Tensor, targets: Tensor, cfg: ModelShape, tp: TPContext) -> Tensor:
    """Vocab-parallel cross-entropy, mean over all tokens of the micro-batch (padded vocab masked)."""
    return vocab_parallel_cross_entropy(logits_shard, targets, tp, cfg.vocab)


def params_built(stages: list[StageModule]) -> tuple[int, dict[str, int]]:
    """(parameters this rank holds, as built: TP shards with the padded vocabulary; the full logical size of
    each of its parameters by global name). Call before FSDP shards the parameters."""
    local = sum(p.numel() for s in stages for p in s.parameters())
    full = {name: math.prod(meta.full_shape) for s in stages for name, meta in s.named_param_meta().items()}
    return local, full


def params_record(by_pp_rank: dict[int, tuple[int, dict[str, int]]]) -> dict[str, Any]:
    """The `params` record of a run from `params_built` of one rank per pipeline rank: `total` unique
    parameters (logical shapes, a tied embedding once) and `per_rank`, what one GPU of each pipeline rank
    holds. `trainctl plan --json` predicts the same record."""
    full: dict[str, int] = {}
    for _local, names in by_pp_rank.values():
        full.update(names)
    return {"total": sum(full.values()), "per_rank": [by_pp_rank[r][0] for r in sorted(by_pp_rank)]}

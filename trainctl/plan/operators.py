"""The operator-level step model: one layer's forward and backward (and recompute) on one GPU as the sum of its
operators, each priced by what bounds it, from the catalog's cited figures (hardware/catalog.py).

  GEMMs          2*m*n*k FLOPs at peak x the part's GEMM efficiency x the wave quantization of m x n in
                 128 x 128 tiles over the SMs (NVIDIA, "Matrix Multiplication Background User's Guide", tile and
                 wave quantization) x the shape's measured share of the plateau where the part has a table
                 (shape_factor: Hopper), or its bytes at HBM bandwidth when that is longer (a roofline per GEMM). The
                 shapes are the layer's after TP and CP sharding; backward is the data-gradient GEMM (m, k, n) and
                 the weight-gradient GEMM (k, n, m) of each.
  attention      flash kernels: the causal half of the scores' FLOPs (4*pairs*head_dim forward, 2.5x that backward:
                 FlashAttention-2's five matmuls against two) at the kernel's measured rate for the head dim and
                 the rank's query length (hardware/attention_curves.py); "unfused" (Megatron
                 before flash attention): QK^T and AV as batched GEMMs over the whole s x s square, the fused
                 scale-mask-softmax and the attention dropout as HBM passes over the s x s scores.
  memory-bound   norms, residual adds, rotary, the activation, dropout: their bytes at HBM bandwidth (a backward
                 moves twice a forward's bytes: the saved input and the incoming gradient read, a gradient written).
  recompute      full: the forward again; selective: the attention core's forward again.
  weight passes  each micro-batch's passes over the matmul weights beyond their GEMMs (autocast's casts, the add
                 of each gradient into the fp32 buffer, FSDP2's copies: weight_pass_bytes) and over the gradient
                 buffer (its zeroing and division by dp: gradient_buffer_pass_bytes), as the trainer makes them, at
                 HBM bandwidth; the Evaluator puts them on the slot by the ZeRO stage.

What the planner asks: seconds per micro-batch of one layer and of the LM head (with its loss) on one rank. The
Evaluator turns them into an achieved FLOP/s for the layer's and the head's FLOPs, so every other figure of the
plan (MoE pace, the pipeline, the bubble) reads them as it read the flat rate before.
TP overlap     estimate.tp_overlap's share of the TP collectives overlapped as Transformer Engine overlaps them
                 (te_tp_exposed_seconds): what its chunking leaves exposed and what the SMs it takes cost the GEMMs.
Not priced: kernel launches and host overheads (no cited figure holds for every stack), the embedding lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import ceil

from trainctl import model_shape as model
from trainctl.hardware import attention_curves
from trainctl.hardware.gemm_shapes import BATCHES, GRID, TABLES
from trainctl.hardware.interpolation import log_weights
from trainctl.model_shape import ModelShape
from trainctl.plan.memory import bf16_params

TILE = 128  # GEMM output tile edge for wave quantization (cuBLAS's common 128 x 128 CTA tile)
# A residual dropout writes a 1-byte mask per value besides its output.
MASK_BYTES = 1
# Rotary fused into one pass (train.compile, or a stack's fused kernel): the 16-bit Q and K read, rotated in fp32
# (written, read back) and cast back; backward twice that.
ROTARY_BYTES_PER_VALUE = 2 + 4 + 4 + 2


def rotary_eager_bytes(act: int, heads: int) -> float:
    """HBM bytes per value of Q or K (`heads` of them on the rank) that the trainer's eager rotary moves forward,
    and again backward (runtime/model/transformer.py apply_rotary, in fp32): a 16-bit input cast to fp32 and the
    result cast back (read act, write 4; read 4, write act), x*cos and rotate_half(x)*sin (read 4, write 4, and the
    fp32 [seq, head_dim] table shared by the heads), the negated half (read 2, write 2), the concatenation (read 4,
    write 4), the sum (read 8, write 4)."""
    casts = 2 * (act + 4) if act < 4 else 0
    return casts + 2 * (4 + 4 + 4 / heads) + 4 + 8 + 12


def swiglu_eager_bytes(act: int) -> tuple[int, int]:
    """(forward, backward) HBM bytes per value of the FFN width that the trainer's eager SwiGLU moves
    (runtime/model/lean_ops.py): forward silu(gate) (read, write) and its product with up (read two, write);
    backward g*up, silu's backward, silu(gate) again, g*silu(gate) and the concatenated gradient (read two halves,
    write both)."""
    return 5 * act, (3 + 3 + 2 + 3 + 4) * act
# The scale-mask-softmax and dropout over the s x s scores, 16-bit, per score (Megatron's fused softmax kernel):
# softmax reads and writes the scores (4 bytes) forward, reads its output and gradient and writes one (6) backward;
# the attention dropout reads and writes them with a 1-byte mask (5), and again backward (5).
SOFTMAX_BYTES = (4, 6)
ATTENTION_DROPOUT_BYTES = (5, 5)


@dataclass(frozen=True)
class Device:
    """What the operator model needs of one GPU (hardware/catalog.py's cited figures)."""

    peak_flops: float  # dense FLOP/s at the run's precision
    gemm_efficiency: float
    sm_count: int
    hbm_bw: float  # bytes/s
    # the measured flash-attention curves the part takes (hardware/attention_curves.py: "h100" | "a100")
    attention_curves: str
    kernel: str = "flash2"  # flash2 | flash3 | unfused
    # the elementwise work (rotary, SwiGLU) as the trainer's eager ops run it, or fused into one pass each
    # (train.compile's inductor, or another stack's fused kernels: estimate.elementwise)
    elementwise: str = "fused"  # eager | fused
    gemm_shapes: str | None = None  # the part's measured GEMM table by shape (hardware/gemm_shapes.py), if any


def gemm_seconds(dev: Device, m: float, n: float, k: float, act: int, batch: float = 1) -> float:
    """One GEMM of an m x k by k x n product (`batch` of them in one batched kernel, whose tiles fill the SMs
    together): compute at the quantized efficiency (times the shape's measured share of the plateau, where the part
    has a table), or its bytes, whichever is longer."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    tiles = batch * ceil(m / TILE) * ceil(n / TILE)
    waves = ceil(tiles / dev.sm_count)
    quantized = tiles / (waves * dev.sm_count)
    shape = shape_factor(dev.gemm_shapes, m, n, k, batch) if dev.gemm_shapes else 1.0
    compute = 2 * m * n * k * batch / (dev.peak_flops * dev.gemm_efficiency * quantized * shape)
    traffic = batch * act * (m * k + k * n + m * n) / dev.hbm_bw
    return max(compute, traffic)


@lru_cache(maxsize=4096)
def _table_tflops(name: str, m: float, n: float, k: float, batch: float) -> float:
    table = TABLES[name]
    total = 0.0
    for b, wb in log_weights(batch, BATCHES):
        for mm, wm in log_weights(m, GRID):
            for nn, wn in log_weights(n, GRID):
                for kk, wk in log_weights(k, GRID):
                    total += wb * wm * wn * wk * table[b, mm, nn, kk]
    return total


def shape_factor(name: str, m: float, n: float, k: float, batch: float = 1) -> float:
    """A GEMM's measured throughput in the table `name` (hardware/gemm_shapes.py) over the table's plateau (its
    largest shape, 4 x 4096^3): the share of the part's efficiency figure this shape reaches. The table is
    interpolated linearly in log2 of batch, m, n and k; rows beyond 4096 count as batches of 4096 (the same tiles,
    more of them), and anything beyond the table's edge takes its edge (the plateau). No shape exceeds the plateau
    (a few measure up to 2% above it: the table's spread, not a faster shape)."""
    rows = batch * max(1.0, m / GRID[-1])
    m_in = min(m, GRID[-1])
    plateau = TABLES[name][BATCHES[-1], GRID[-1], GRID[-1], GRID[-1]]
    return min(1.0, _table_tflops(name, m_in, n, k, rows) / plateau)


def autocast_cast_bytes(*, precision: str, fp32_weights: bool, pp: int, micro_batches: int, recompute: str
                        ) -> float:
    """Bytes per weight, per micro-batch, of autocast's cast of a 32-bit weight to 16 bits (read 4, write 2): once
    per autocast region, which is a micro-batch at pp = 1 (again in a full recompute, which re-enters autocast)
    and the whole schedule at pp > 1; none without 16-bit compute or 32-bit weights."""
    if precision not in ("bf16", "fp16") or not fp32_weights:
        return 0.0
    return (4 + 2) * ((2 if recompute == "full" else 1) if pp == 1 else 1 / micro_batches)


def weight_pass_bytes(mode: str, *, precision: str, zero: int, dp: int, pp: int, micro_batches: int,
                      recompute: str, reduce_bf16: bool = False, gathers: int = 2) -> float:
    """HBM bytes one micro-batch moves per matmul weight on the rank beyond its GEMMs (estimate.grad_accumulation).

    auto, the bundled trainer (runtime/parallel/pipeline_schedules.py, data_parallel.py; counted from its aten ops
    by tests/dist/test_weight_passes.py): under 16-bit autocast with fp32 weights (ZeRO-0), the forward casts each
    weight to 16 bits (read 4, write 2) once per autocast region, which is a micro-batch at pp = 1 (again in a
    full recompute, which re-enters autocast) and the whole schedule at pp > 1; every backward casts the weight's
    16-bit gradient back (read 2, write 4) and adds it into the fp32 gradient buffer (read 4 + 4, write 4; with one
    replica the first micro-batch's is taken as it is). 16-bit weights (bf16 ZeRO-1/2) add their 16-bit gradient
    into the fp32 buffer (read 2 + 4, write 4); fp32 compute adds fp32. ZeRO-3 (FSDP2): each of the micro-batch's
    `gathers` all-gathers copies the gathered weights out into the layer's (read, write: 16-bit under bf16, else
    fp32), the unsharded gradient is kept in the reduce dtype (the first micro-batch's cast into it, each later
    one's added), and the step's reduce-scatter copies it into its input once.
    hook: 16-bit weights and Megatron-LM's main_grad add of the 16-bit gradient (megatron/model/distributed.py,
    March 2021): into an fp32 buffer under bf16 (read 2 + 4, write 4), into the fp16 one under fp16 (Megatron's
    default without --accumulate-allreduce-grads-in-fp32: read 2 + 2, write 2); cast: 16-bit weights whose
    gradient is first cast into a new fp32 tensor (read 2, write 4) and that added into the fp32 buffer (read
    4 + 4, write 4): DeepSpeed's BF16 optimizer (deepspeed/runtime/bf16_optimizer.py update_hp_grads,
    `hp_grad.add_(lp.grad.to(hp_grad.dtype))`, after every micro-batch's backward in its pipeline engine, as
    of the bf16 + pipeline parallelism merge of April 2022); fused: nothing (the GEMM accumulates)."""
    if mode == "fused":
        return 0.0
    if mode == "hook":
        return 2 + 2 + 2 if precision == "fp16" else 2 + 4 + 4
    if mode == "cast":
        return (2 + 4) + (4 + 4 + 4)
    m = micro_batches

    def casts(fp32_weights: bool) -> float:  # autocast's cast of a 32-bit weight and its gradient's cast back
        forward = autocast_cast_bytes(precision=precision, fp32_weights=fp32_weights, pp=pp, micro_batches=m,
                                      recompute=recompute)
        return forward + (2 + 4) if forward else 0.0

    if zero >= 3 and dp > 1:
        weight = 2 if precision == "bf16" else 4  # FSDP2 gathers bf16 under bf16 compute (MixedPrecisionPolicy)
        reduce = 2 if reduce_bf16 else 4  # the gradient's dtype from the reduce-scatter on (its reduce_dtype)
        first = weight + reduce if weight != reduce else 0.0  # the first micro-batch's gradient into that dtype
        kept = weight + reduce if m == 1 else first + (m - 1) * (weight + reduce + reduce) + 2 * reduce
        return gathers * 2 * weight + kept / m + casts(precision == "fp16")
    if bf16_params(precision, zero, dp):
        return 2 + 4 + 4
    add = (4 + 4 + 4) * (1 if dp > 1 else (m - 1) / m)
    return casts(True) + add


def fp8_quantize_bytes(value_bytes: int, *, eager: bool) -> int:
    """HBM bytes per value of one GEMM operand quantized to FP8 (runtime/model/fp8.py quantize; counted from the
    trainer's aten ops by tests/unit/test_plan_operators.py). Eager: |t| (read, write), its amax (read), a 16-bit
    operand widened to fp32 (read, write 4), the scaling (read 4, write 4), the clamp (read 4, write 4) and the
    cast to FP8 (read 4, write 1): 33 bytes from bf16 or fp32. Fused (train.compile, or another stack's kernels:
    estimate.elementwise fused): one pass for the amax and one to scale and cast, 2 x value bytes + 1."""
    if not eager:
        return 2 * value_bytes + 1
    widen = value_bytes + 4 if value_bytes < 4 else 0
    return (value_bytes + value_bytes) + value_bytes + widen + (4 + 4) + (4 + 4) + (4 + 1)


def fp8_activation_bytes(t: float, n: float, k: float, *, act: int, eager: bool) -> tuple[float, float]:
    """(forward, backward) HBM bytes an FP8 linear layer y = x W^T (x: t x k, W: n x k) moves over its input and
    its output gradient beyond its GEMMs: the forward quantizes x; the backward quantizes the gradient for the
    input's GEMM and, transposed, for the weight's, and x transposed again (eager, each transpose is first
    copied out: read and write). The weight's quantization is a weight pass (fp8_weight_pass_bytes)."""
    q = fp8_quantize_bytes(act, eager=eager)
    copy = 2 * act if eager else 0
    return q * t * k, (2 * q + copy) * t * n + (q + copy) * t * k


def fp8_weight_pass_bytes(*, weight_bytes: int, eager: bool, recompute: str, autocast_cast_per_mb: float) -> float:
    """HBM bytes per weight of an FP8 layer, per micro-batch, beyond weight_pass_bytes: the forward quantizes the
    weight (again in a full recompute), the backward quantizes it transposed (eager: copied out first), less
    autocast's 16-bit cast of a 32-bit weight, which an FP8 layer does not make (`autocast_cast_per_mb`: that
    cast's bytes per micro-batch as weight_pass_bytes priced it)."""
    q = fp8_quantize_bytes(weight_bytes, eager=eager)
    forwards = 2 if recompute == "full" else 1
    return q * forwards + q + (2 * weight_bytes if eager else 0) - autocast_cast_per_mb


def gradient_buffer_pass_bytes(mode: str, *, zero: int, dp: int, micro_batches: int, reduce_bf16: bool) -> float:
    """HBM bytes per parameter on the rank, per micro-batch, of the bundled trainer's passes over its gradient
    buffer (runtime/parallel/data_parallel.py GradSync; tests/dist/test_weight_passes.py counts them): ZeRO-0/1
    zero it before each step (write 4) and divide it by dp before the step's reduction (read 4, write 4; and
    round it into the bf16 send buffer under grad_reduce_dtype bf16: read 4, write 2); ZeRO-2 does the division
    (and rounding) every micro-batch, adds the reduce-scattered slice into its fp32 gradient shard (12 bytes per
    element of a dp-th, zeroed before each step: 4) and zeroes the buffer it filled (write 4). None with one
    replica (the gradients are autograd's own), under ZeRO-3 (FSDP2's, in weight_pass_bytes), or for another
    stack (estimate.grad_accumulation hook, cast or fused)."""
    if mode != "auto" or dp == 1 or zero >= 3:
        return 0.0
    divide = 4 + 4 + ((4 + 2) if reduce_bf16 else 0)
    if zero == 2:
        return divide + 4 + 12 / dp + 4 / (dp * micro_batches)
    return (4 + divide) / micro_batches


def rank_widths(m: ModelShape, tp: int) -> tuple[float, float, float, float]:
    """(query, one of K and V, FFN, FC1 output) widths of a layer on one TP rank. A KV head is replicated when tp
    exceeds the KV heads; a MoE layer is a dense one with the routed experts' width times top_k."""
    q = m.heads * m.head_dim / tp
    kv = max(m.kv_heads / tp, 1) * m.head_dim
    ffn = (m.moe.expert_ffn_hidden * m.moe.top_k if m.moe is not None else m.ffn_hidden) / tp
    return q, kv, ffn, ffn * (2 if m.swiglu else 1)


def _train_gemm(dev: Device, m: float, n: float, k: float, act: int) -> tuple[float, float]:
    """(forward, backward) seconds of one linear layer: y = x W (m x k by k x n), dx = dy W^T, dW = x^T dy."""
    return gemm_seconds(dev, m, n, k, act), gemm_seconds(dev, m, k, n, act) + gemm_seconds(dev, k, n, m, act)


def layer_seconds(m: ModelShape, dev: Device, *, micro_batch: int, tp: int, cp: int, sp: bool, recompute: str,
                  act: int, stream: int, gemm_speedup: float = 1.0, fp8: bool = False) -> float:
    """Seconds of one transformer layer's forward + backward (+ recompute) for one micro-batch on one rank.

    `act`: bytes of a 16-bit (or fp32) activation; `stream`: bytes of the residual stream's values. A MoE layer is
    priced as a dense layer whose MLP has the routed experts' width times top_k (the Evaluator charges the real
    FLOPs at the rate this gives). `gemm_speedup`: the linear layers' GEMMs run that many times faster (FP8:
    catalog.gemm_speedup), the attention core and the memory-bound work as they are; `fp8`: the linear layers
    quantize their inputs and output gradients (fp8_activation_bytes) as the trainer's FP8 GEMMs do."""
    t = micro_batch * m.seq_len / cp  # this rank's tokens
    h, hd = m.hidden, m.head_dim
    q, kv, ffn, up = rank_widths(m, tp)
    fwd = bwd = quant_f = quant_b = 0.0
    for n_out, k_in in ((q + 2 * kv, h), (h, q), (up, h), (h, ffn)):
        f, b = _train_gemm(dev, t, n_out, k_in, act)
        fwd, bwd = fwd + f / gemm_speedup, bwd + b / gemm_speedup
        if fp8:
            qf, qb = fp8_activation_bytes(t, n_out, k_in, act=act, eager=dev.elementwise == "eager")
            quant_f, quant_b = quant_f + qf, quant_b + qb
    core_f, core_b = _attention_seconds(m, dev, micro_batch=micro_batch, tp=tp, cp=cp, act=act)
    # memory-bound work, forward bytes; the norms, residual adds and residual dropouts are replicated over TP
    # (split under sequence parallelism), the rest is on the rank's heads and MLP shard
    rep = t * h / (tp if sp else 1)
    stream_work = (2 * 2 * rep * act  # two norms: read and write the stream
                   + 2 * 3 * rep * stream  # two residual adds: read two, write one
                   + (2 * rep * (2 * act + MASK_BYTES) if m.dropout else 0.0))  # two residual dropouts
    eager = dev.elementwise == "eager"
    if m.swiglu and eager:
        act_f, act_b = swiglu_eager_bytes(act)
    else:  # one pass: read [gate; up] or fc1, write; backward twice that
        act_f = (3 if m.swiglu else 2) * act
        act_b = 2 * act_f
    rot_f = rot_b = 0.0
    if m.position == "rope":
        q_heads, kv_heads = m.heads / tp, max(m.kv_heads / tp, 1)
        if eager:
            rot_f = rot_b = t * hd * (q_heads * rotary_eager_bytes(act, q_heads) + kv_heads * rotary_eager_bytes(
                act, kv_heads))
        else:
            rot_f = t * (q + kv) * ROTARY_BYTES_PER_VALUE
            rot_b = 2 * rot_f
    mem_f = (stream_work + act_f * t * ffn + rot_f + quant_f) / dev.hbm_bw
    mem_b = (2 * stream_work + act_b * t * ffn + rot_b + quant_b) / dev.hbm_bw
    forward = fwd + core_f + mem_f
    backward = bwd + core_b + mem_b
    again = forward if recompute == "full" else core_f if recompute == "selective" else 0.0
    return forward + backward + again


def _attention_seconds(m: ModelShape, dev: Device, *, micro_batch: int, tp: int, cp: int, act: int
                       ) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core (scores, softmax, weighted sum) on one rank."""
    heads = m.heads / tp
    hd = m.head_dim
    if dev.kernel == "unfused":
        s_q, s_kv = m.seq_len / cp, m.seq_len
        batch = micro_batch * heads
        f = gemm_seconds(dev, s_q, s_kv, hd, act, batch=batch) + gemm_seconds(dev, s_q, hd, s_kv, act, batch=batch)
        b = 2 * f  # each of the two batched GEMMs has a data- and a weight-side gradient GEMM of its size
        scores = batch * s_q * s_kv
        soft = (SOFTMAX_BYTES[0] + (ATTENTION_DROPOUT_BYTES[0] if m.dropout else 0)) * scores / dev.hbm_bw
        soft_b = (SOFTMAX_BYTES[1] + (ATTENTION_DROPOUT_BYTES[1] if m.dropout else 0)) * scores / dev.hbm_bw
        return f + soft, b + soft_b
    pairs = micro_batch * max(model.causal_pairs_per_rank(m.seq_len, cp))  # the causal half this rank computes
    flops = 4 * pairs * hd * heads
    # the kernel's measured rate at this head dim and at the rank's query length
    eff_f, eff_b = attention_curves.efficiency(dev.attention_curves, dev.kernel, head_dim=hd, seq=m.seq_len / cp)
    return flops / (dev.peak_flops * eff_f), attention_curves.BACKWARD_FLOPS * flops / (dev.peak_flops * eff_b)


def cross_entropy_bytes(act: int) -> int:
    """HBM bytes per logit of the trainer's vocab-parallel cross-entropy (runtime/parallel/tensor_parallel.py; the
    passes Megatron's VocabParallelCrossEntropy makes too), forward and backward: the head GEMM writes the logits;
    a 16-bit logit is cast to fp32 (read, write 4); then in fp32 the max (read), less the max (read, write), exp
    (read, write), the sum (read) and the division into the softmax kept for backward (read, write); backward
    scales it in place into the gradient (read, write) and casts that back for the head's GEMMs (read 4)."""
    cast = act < 4
    fp32_passes = 4 + (4 + 4) + (4 + 4) + 4 + (4 + 4) + (4 + 4)
    return act + ((act + 4) + (4 + act) if cast else 0) + fp32_passes


def head_seconds(m: ModelShape, dev: Device, *, micro_batch: int, tp: int, cp: int, vocab: int, act: int) -> float:
    """Seconds of the final norm, LM head and cross-entropy forward + backward for one micro-batch on one rank: the
    head GEMM, and the loss's passes over the logits (cross_entropy_bytes)."""
    t = micro_batch * m.seq_len / cp
    v = vocab / tp
    f, b = _train_gemm(dev, t, v, m.hidden, act)
    return f + b + cross_entropy_bytes(act) * t * v / dev.hbm_bw + 6 * t * m.hidden * act / dev.hbm_bw


# Transformer Engine's TP-communication overlap (Megatron's --tp-comm-overlap) as its defaults run it: TE's
# transformer_engine/pytorch/module/base.py, initialize_ub (the default method of each GEMM and its config).
#   ring_exchange: the all-gather before the QKV and FC1 GEMMs and before the projection's and FC2's data-gradient
#     GEMMs: the GEMM runs in tp chunks, each while the next chunk's piece arrives over the copy engines (1 SM);
#   pipeline: the reduce-scatter after the projection and FC2 GEMMs: the GEMM in 4 chunks, each chunk's
#     reduce-scatter on 16 SMs while the next chunk computes on the others ("set_sm_margin");
#   bulk: QKV's and FC1's backward: the input's all-gather beside the data-gradient GEMM and the gradient's
#     reduce-scatter beside the weight-gradient GEMM, each on 16 SMs for the whole GEMM.
TE_COMM_SMS = 16
TE_PIPELINE_SPLITS = 4


def te_tp_exposed_seconds(m: ModelShape, dev: Device, *, micro_batch: int, tp: int, cp: int, act: int,
                          half_s: float, recompute: str) -> float:
    """Seconds Transformer Engine's overlap leaves on one layer's forward + backward (+ recompute) beyond its
    GEMMs, sequence parallelism on: `half_s` is one all-gather or reduce-scatter of the micro-batch's activations."""
    t = micro_batch * m.seq_len / cp
    h = m.hidden
    q, kv, ffn, up = rank_widths(m, tp)
    qkv = q + 2 * kv
    slowed = dev.sm_count / (dev.sm_count - TE_COMM_SMS)  # the GEMM on the SMs the collective leaves it

    def gemm(rows: float, cols: float, inner: float) -> float:
        return gemm_seconds(dev, rows, cols, inner, act)

    def ring(g: float) -> float:
        piece = half_s / (tp - 1)  # one of the all-gather's tp - 1 steps
        return g / tp + (tp - 1) * max(g / tp, piece) - g

    def pipeline(g: float) -> float:
        chunk, c = g * slowed / TE_PIPELINE_SPLITS, half_s / TE_PIPELINE_SPLITS
        return chunk + (TE_PIPELINE_SPLITS - 1) * max(chunk, c) + c - g

    def bulk(g: float) -> float:
        return max(g * slowed, half_s) - g

    forward = ring(gemm(t, qkv, h)) + pipeline(gemm(t, h, q)) + ring(gemm(t, up, h)) + pipeline(gemm(t, h, ffn))
    backward = (ring(gemm(t, q, h)) + ring(gemm(t, ffn, h))  # the projection's and FC2's data gradients
                + bulk(gemm(t, h, qkv)) + bulk(gemm(h, qkv, t))  # QKV: data and weight gradients
                + bulk(gemm(t, h, up)) + bulk(gemm(h, up, t)))  # FC1: data and weight gradients
    return forward + backward + (forward if recompute == "full" else 0.0)

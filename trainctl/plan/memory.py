"""Per-GPU memory: model states per ZeRO stage, activations per Korthikanti et al. 2022.

Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1 and Figure 1): mixed-precision Adam keeps
2 bytes of 16-bit weights, 2 of 16-bit gradients and K = 12 of optimizer state (fp32 master weights,
momentum, variance) per parameter = 16 bytes. ZeRO stage 1 (P_os) shards the 12 over the Nd data-
parallel ranks, stage 2 (P_os+g) also the gradients, stage 3 (P_os+g+p) also the weights. Pure fp32
training keeps 4 + 4 and an optimizer state of 8 (momentum, variance; the weights are the master).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Sec. 4 and Table 2), bytes per layer for s = sequence, b = micro-batch, h = hidden, a = heads,
t = TP size, with 16-bit activations and 1-byte dropout masks:
    no parallelism          s*b*h*(34 + 5*a*s/h)
    TP                      s*b*h*(10 + 24/t + 5*a*s/(h*t))
    TP + SP                 s*b*h/t*(34 + 5*a*s/h)
    TP + selective          s*b*h*(10 + 24/t)
    TP + SP + selective     34*s*b*h/t
    full recompute          2*s*b*h per layer (its input), /t with SP
We keep the paper's term-by-term accounting and generalise it to GQA (K and V are kv_heads/heads of h
wide), other MLP sizes and SwiGLU (gate and up outputs, 2*f wide, plus the down projection's input), and
to models without dropout (no masks, no dropout output); for the paper's GPT shape (GELU, 4h MLP,
dropout) it is exactly Table 2. "selective" drops the s^2 attention-core term (softmax, its dropout,
A*V's input), which is also what FlashAttention-style kernels store; recompute "none" assumes the
attention core's s x s tensors are materialised, as in the paper.
"""

from __future__ import annotations

from trainctl.model_shape import ModelShape

# (weights, gradients, optimizer state) bytes per parameter.
STATE_BYTES = {"bf16": (2, 2, 12), "fp16": (2, 2, 12), "fp32": (4, 4, 8)}


def activation_bytes(precision: str) -> int:
    """Bytes per stored activation value: 16-bit under mixed precision, 4 in pure fp32."""
    return 4 if precision == "fp32" else 2


def model_state_bytes(params: float, zero: int, dp: int, precision: str = "bf16") -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per GPU for `params` parameters on that GPU.

    ZeRO paper, Sec. 5: stage 1 divides the optimizer state by Nd, stage 2 also the gradients, stage 3
    also the weights."""
    w, g, o = STATE_BYTES[precision]
    return (
        params * w / (dp if zero >= 3 else 1),
        params * g / (dp if zero >= 2 else 1),
        params * o / (dp if zero >= 1 else 1),
    )


def layer_activation_bytes(m: ModelShape, micro_batch: int, tp: int, sp: bool, recompute: str,
                           act_bytes: int = 2) -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch (Korthikanti et al. 2022 Table 2).

    Term by term (paper Sec. 4.1, values of act_bytes each unless noted):
      replicated over TP unless SP: the two norms' inputs (2*sbh), the QKV input (sbh), the MLP input
      (sbh), and with dropout the two residual dropout masks (sbh bytes each);
      split over TP: Q (sbh), K and V (sb*kv_width each), the attention output projection's input
      (sbh), the MLP's inner activations (GELU: its input and the down projection's input, 2*sbf;
      SwiGLU: gate and up outputs and the down projection's input, 3*sbf);
      the attention core, split over TP: the softmax output (a*s^2*b), and with dropout its mask
      (a*s^2*b bytes) and output (a*s^2*b).
    """
    s, b, h = m.seq_len, micro_batch, m.hidden
    sbh = s * b * h
    if recompute == "full":
        return act_bytes * sbh / (tp if sp else 1)
    replicated = 4 * sbh * act_bytes + (2 * sbh if m.dropout else 0)
    split_values = 2 * sbh + 2 * s * b * m.kv_width + (3 if m.swiglu else 2) * s * b * m.ffn_hidden
    split = split_values * act_bytes
    if recompute != "selective":
        core = m.heads * s * s * b
        split += core * act_bytes + (core * (1 + act_bytes) if m.dropout else 0)
    if sp:
        return (replicated + split) / tp
    return replicated + split / tp


def embedding_activation_bytes(m: ModelShape, micro_batch: int, tp: int, sp: bool) -> float:
    """First stage, per micro-batch in flight: the embedding dropout mask (Korthikanti Sec. 4.3)."""
    return m.seq_len * micro_batch * m.hidden / (tp if sp else 1) if m.dropout else 0.0


def head_activation_bytes(m: ModelShape, micro_batch: int, tp: int, sp: bool, padded_vocab: int,
                          act_bytes: int = 2) -> float:
    """Last stage, per micro-batch in flight: final norm and LM-head inputs (2*sbh values) and the
    fp32 logits of the vocab-parallel cross entropy (4*s*b*V/t bytes): Korthikanti Sec. 4.3's
    4*s*b*h/t*(1 + V/h) with SP."""
    sbh = m.seq_len * micro_batch * m.hidden
    return 2 * sbh * act_bytes / (tp if sp else 1) + 4 * m.seq_len * micro_batch * padded_vocab / tp

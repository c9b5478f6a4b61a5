"""PowerSGD's bytes and compute, as the trainer compresses (runtime/parallel/powersgd.py): the one owner of which
gradient matrices are compressed and what that costs.

A matrix of n x m elements (a rank's local TP shard of a weight) is compressed at rank r = min(n, m, rank) when
(n + m) * r * 2 < n * m (torch's powerSGD_hook rule, min_compression_rate 2); it then sends P (n x r) and Q
(m x r) in two all-reduces instead of n*m values in one. Everything else (1-D tensors, small matrices) is
all-reduced uncompressed. Compute per compressed matrix and step: M Q, M^T P and P Q^T, 2*n*m*r FLOPs each, plus
the QR of P and Q (about 2*n*r^2 and 2*m*r^2).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.model_shape import ModelShape


def compressed(n: int, m: int, rank: int) -> bool:
    r = min(n, m, rank)
    return (n + m) * r * 2 < n * m


Matrix = tuple[int, int, int, bool]  # rows, cols, how many, routed expert (reduced over the expert-DP group)


def stage_matrices(m: ModelShape, tp: int, layers: int, first: bool, last: bool, moe_layers: int = 0,
                   ep: int = 1) -> list[Matrix]:
    """The 2-D parameters one GPU holds for a stage, in the runtime's shapes: a column-parallel weight is
    (out/tp, in), a row-parallel one (out, in/tp), the vocab-parallel embedding and LM head (V/tp, h)."""
    h, f = m.hidden, m.ffn_hidden
    up = m.mlp_matrices - 1  # fused gate-up under SwiGLU
    attn = [((h + 2 * m.kv_width) // tp, h), (h, h // tp)]
    out: list[Matrix] = []
    dense = layers - moe_layers
    if dense:
        out += [(r, c, dense, False) for r, c in attn + [(up * f // tp, h), (h, f // tp)]]
    if moe_layers:
        moe = m.moe
        assert moe is not None
        ef = moe.expert_ffn_hidden
        local = moe.num_experts // ep
        out += [(r, c, moe_layers, False) for r, c in attn]
        out += [(moe.num_experts, h, moe_layers, False), (up * ef // tp, h, local * moe_layers, True),
                (h, ef // tp, local * moe_layers, True)]
        if moe.shared_experts:
            sf = moe.shared_experts * moe.shared_ffn_hidden
            out += [(up * sf // tp, h, moe_layers, False), (h, sf // tp, moe_layers, False)]
    vocab = m.padded_vocab(tp) // tp
    if first:
        out.append((vocab, h, 1, False))
        if m.learned_pos:
            out.append((m.seq_len, h, 1, False))
    if last and (not m.tied_embeddings or not first):
        out.append((vocab, h, 1, False))
    return out


@dataclass(frozen=True)
class Compression:
    """What PowerSGD does to one GPU's DP all-reduce per step."""

    compressed_params: float  # elements of the compressed matrices (their error-feedback buffer's size)
    p_elements: float  # elements of P (all-reduced), summed over the compressed matrices
    q_elements: float  # elements of Q (all-reduced)
    flops: float  # the extra compute per step

    @property
    def factor_elements(self) -> float:
        return self.p_elements + self.q_elements

    def held_elements(self, params: float) -> float:
        """fp32 elements the trainer keeps for it, of a sync over `params` parameters: the error feedback
        (compressed matrices), the copy of the rest it reduces, P and Q buffers and the warm-start Q."""
        return params + self.p_elements + 2 * self.q_elements


NONE = Compression(compressed_params=0.0, p_elements=0.0, q_elements=0.0, flops=0.0)


def compression(matrices: list[Matrix], rank: int, experts: bool = False) -> Compression:
    """PowerSGD's figures for the dense matrices of a stage (or its routed experts' with experts=True)."""
    params = p = q = flops = 0.0
    for n, c, k, expert in matrices:
        if expert != experts or not compressed(n, c, rank):
            continue
        r = min(n, c, rank)
        params += k * n * c
        p += k * n * r
        q += k * c * r
        flops += k * (3 * 2 * n * c * r + 2 * (n + c) * r * r)
    return Compression(compressed_params=params, p_elements=p, q_elements=q, flops=flops)

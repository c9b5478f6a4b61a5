"""How transformer layers are split over pipeline stages, and which rank holds which stage.

Stages are numbered in model order 0..pp*virtual_stages-1; with interleaving, pipeline rank r holds
stages r, r+pp, r+2pp, ... (Narayanan et al. 2021, interleaved schedule). The first stage also holds
the token embedding and the last the LM head, so by default they get fewer transformer layers, as
Llama 3 405B does (126 layers on PP=16: 7 on the first and last stage, 8 on the others).
"""

from __future__ import annotations

from trainctl.spec.models import ModelSpec, RunSpec


def layer_params(m: ModelSpec) -> int:
    """Weights of one transformer layer (matmuls only; norms and biases are negligible)."""
    head_dim = m.hidden // m.heads
    kv = m.kv_heads or m.heads
    attn = m.hidden * (m.hidden + 2 * kv * head_dim) + m.hidden * m.hidden
    mlp = (3 if m.activation == "swiglu" else 2) * m.hidden * (m.ffn_hidden or 4 * m.hidden)
    return attn + mlp


def embedding_cost_in_layers(m: ModelSpec) -> float:
    """Embedding / LM-head weight (and LM-head FLOPs) in units of one transformer layer."""
    return m.vocab * m.hidden / layer_params(m)


def balanced_split(layers: int, stages: int, first_cost: float, last_cost: float) -> list[int]:
    """Layer counts per stage minimising the largest stage load (layers + extra cost on the ends)."""
    if stages == 1:
        return [layers]
    extra = [0.0] * stages
    extra[0] += first_cost
    extra[-1] += last_cost

    def capacity(limit: float) -> list[int]:
        return [max(0, int(limit - e + 1e-9)) for e in extra]

    lo, hi = 0.0, layers + max(extra) + 1.0
    for _ in range(100):  # bisection on the largest load; 100 halvings is exact for any sane size
        mid = (lo + hi) / 2
        if sum(capacity(mid)) >= layers:
            hi = mid
        else:
            lo = mid
    counts = capacity(hi)
    excess = sum(counts) - layers
    while excess > 0:  # take surplus layers from the most loaded stages, inner stages first
        order = sorted(range(stages), key=lambda i: (counts[i] + extra[i], 0 < i < stages - 1, i))
        i = order[-1]
        counts[i] -= 1
        excess -= 1
    return counts


def stage_layers(spec: RunSpec) -> list[int]:
    """Transformer layers on each model stage, first to last."""
    p = spec.parallel
    if p.stage_layers is not None:
        return list(p.stage_layers)
    stages = p.pp * p.virtual_stages
    cost = embedding_cost_in_layers(spec.model)
    return balanced_split(spec.model.layers, stages, cost, cost)


def stage_layer_ranges(spec: RunSpec) -> list[range]:
    """Global layer indices of each model stage."""
    out, start = [], 0
    for n in stage_layers(spec):
        out.append(range(start, start + n))
        start += n
    return out


def stages_of_pp_rank(pp_rank: int, spec: RunSpec) -> list[int]:
    """Model stages held by a pipeline rank, in execution order."""
    p = spec.parallel
    return [v * p.pp + pp_rank for v in range(p.virtual_stages)]

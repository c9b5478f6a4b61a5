"""How transformer layers are split over pipeline stages, and which rank holds which stage.

Stages are numbered in model order 0..pp*virtual_stages-1. Which rank holds which stage has one owner,
`stages_of_pp_rank`: with interleaving ("loop" placement) pipeline rank r holds stages r, r+pp, r+2pp, ...
(Narayanan et al. 2021, interleaved schedule); under ZBV ("v" placement, Qi et al. 2023, Sec. 6) rank r
holds stages r and 2*pp-1-r, so rank 0 holds both the first and the last stage. The first stage also holds
the token embedding and the last the LM head, so by default they get fewer transformer layers, as
Llama 3 405B does (126 layers on PP=16: 7 on the first and last stage, 8 on the others).
"""

from __future__ import annotations

import heapq
from collections import Counter

from trainctl.model_shape import ModelShape, embedding_cost
from trainctl.spec.models import RunSpec


def balanced_split(layers: int, stages: int, first_cost: float, last_cost: float) -> list[int]:
    """Layer counts per stage minimising the largest stage load (layers + extra cost on the ends).

    Bisection on the largest load, then surplus layers come off the most loaded stages (inner stages
    first). Stages sharing an extra cost are counted as a group and the surplus removal uses a heap, so
    `plan --auto` can call this for every pp*v cheaply."""
    if stages == 1:
        return [layers]
    extra = [0.0] * stages
    extra[0] += first_cost
    extra[-1] += last_cost
    groups = Counter(extra).items()

    def total(limit: float) -> int:
        return sum(n * max(0, int(limit - e + 1e-9)) for e, n in groups)

    lo, hi = 0.0, layers + max(extra) + 1.0
    for _ in range(100):  # the same bisection, so the same final `hi`, bit for bit
        mid = (lo + hi) / 2
        if total(mid) >= layers:
            hi = mid
        else:
            lo = mid
    counts = [max(0, int(hi - e + 1e-9)) for e in extra]
    excess = sum(counts) - layers
    # balanced_split takes the largest (load, is_inner, index) each time; a heap of negated keys does too.
    inner = [0 < i < stages - 1 for i in range(stages)]
    heap = [(-(counts[i] + extra[i]), -inner[i], -i) for i in range(stages)]
    heapq.heapify(heap)
    while excess > 0:
        i = -heapq.heappop(heap)[2]
        if counts[i] == 0:
            continue  # a stage loaded only by its embedding/head cost has no layer to give up
        counts[i] -= 1
        excess -= 1
        heapq.heappush(heap, (-(counts[i] + extra[i]), -inner[i], -i))
    return counts


def stage_layers(spec: RunSpec) -> list[int]:
    """Transformer layers on each model stage, first to last."""
    p = spec.parallel
    if p.stage_layers is not None:
        return list(p.stage_layers)
    stages = p.pp * p.virtual_stages
    cost = embedding_cost(ModelShape.from_spec(spec.model))
    return balanced_split(spec.model.layers, stages, cost, cost)


def stage_layer_ranges(spec: RunSpec) -> list[range]:
    """Global layer indices of each model stage."""
    out, start = [], 0
    for n in stage_layers(spec):
        out.append(range(start, start + n))
        start += n
    return out


# Schedules that place a rank's two stages in a V (torch's generate_stage_to_rank_mapping(style="v"))
V_SCHEDULES = frozenset({"zbv"})


def v_placement(schedule: str) -> bool:
    return schedule in V_SCHEDULES


def stages_of_pp_rank(pp_rank: int, pp: int, v: int, schedule: str) -> list[int]:
    """Model stages held by a pipeline rank, in the order of its stage modules: loop placement r, r+pp, ...;
    V placement r, 2*pp-1-r (exactly two per rank, a spec rule)."""
    if v_placement(schedule):
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [c * pp + pp_rank for c in range(v)]


def pp_rank_of_stage(stage: int, pp: int, v: int, schedule: str) -> int:
    """The pipeline rank holding a model stage (the inverse of stages_of_pp_rank)."""
    if v_placement(schedule):
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def end_stage_pp_ranks(pp: int, schedule: str) -> tuple[int, int]:
    """Pipeline ranks of the first stage (embedding) and the last (LM head): the same rank under V placement,
    so tied embeddings need no cross-rank sync there."""
    return (0, 0) if v_placement(schedule) else (0, pp - 1)


def spec_stages_of_pp_rank(pp_rank: int, spec: RunSpec) -> list[int]:
    p = spec.parallel
    return stages_of_pp_rank(pp_rank, p.pp, p.virtual_stages, p.schedule)

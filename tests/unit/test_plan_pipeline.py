"""Pipeline schedule arithmetic: bubble, micro-batches in flight, the stage split.

Sources:
- Narayanan et al. 2021 (Megatron-LM, SC21), Sec. 2.2.1: the 1F1B / GPipe bubble time fraction
  t_pb / t_id = (p-1)/m; Sec. 2.2.2: interleaved with v chunks, (p-1)/(v*m).
- Megatron-LM's interleaved schedule (megatron/core/pipeline_parallel/schedules.py,
  forward_backward_pipelining_with_interleaving): warm-up count 2*(p-r-1) + (v-1)*p (all m*v when
  m == p), then one forward (index W+k) and one backward (index k) per step; forward chunk
  (k // p) % v, backward chunk v-1 - (k // p) % v. Simulated here step by step.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainctl.model_shape import ModelShape, embedding_cost
from trainctl.plan import bubble as schedule
from trainctl.plan.estimate import Evaluator
from trainctl.plan.pipeline import balanced_split, stage_layers
from trainctl.plan.plan import candidate_from_spec, context_from_spec
from trainctl.spec import load_spec_text
from trainctl.spec.models import ModelSpec


@pytest.mark.parametrize("p,m,v", [(2, 4, 1), (8, 64, 1), (8, 64, 2), (16, 16, 8), (4, 32, 5), (1, 10, 1)])
def test_bubble_matches_megatron(p, m, v):
    ideal = (p - 1) / (v * m)  # Narayanan et al. 2021, Sec. 2.2.1-2.2.2
    assert schedule.bubble_over_ideal(p, m, v) == pytest.approx(ideal)
    # Our headline figure: the bubble's share of the whole pipelined time, t_pb / (t_id + t_pb).
    assert schedule.bubble_fraction(p, m, v) == pytest.approx(ideal / (1 + ideal))
    assert schedule.bubble_fraction(p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))


def test_gpt3_recipe_bubble():
    """The GPT-3 recipe's comment: pp=8, v=2, 64 micro-batches -> (p-1)/(v*m) = 7/128."""
    assert schedule.bubble_over_ideal(8, 64, 2) == 7 / 128


def simulate_peak(sched: str, p: int, v: int, m: int, r: int, w: tuple[int, ...]) -> int:
    """Largest layer-weighted number of chunk passes rank r holds at any moment, by replaying the order."""
    fwd = lambda k: (k // p) % v  # noqa: E731
    bwd = lambda k: v - 1 - (k // p) % v  # noqa: E731
    total = m * v
    if sched == "gpipe":
        warm = total
    elif sched == "1f1b":
        warm = min(p - r - 1, m)
    else:
        # torch.distributed.pipelining.schedules._get_warmup_ops (ScheduleInterleaved1F1B, factor 2)
        warm = min(2 * (p - r - 1) + (v - 1) * p, total)
    ops = [("f", k) for k in range(warm)]
    for k in range(total - warm):
        ops += [("f", warm + k), ("b", k)]
    ops += [("b", k) for k in range(total - warm, total)]
    counts, best = [0] * v, 0
    for op, k in ops:
        if op == "f":
            counts[fwd(k)] += 1
        else:
            counts[bwd(k)] -= 1
        best = max(best, sum(c * x for c, x in zip(counts, w, strict=True)))
    return best


@settings(max_examples=300, deadline=None)
@given(p=st.integers(2, 8), v=st.integers(1, 4), mult=st.integers(1, 4), r=st.integers(0, 7),
       w=st.lists(st.integers(0, 4), min_size=4, max_size=4), sched=st.sampled_from(["1f1b", "interleaved", "gpipe"]))
def test_in_flight_matches_a_replay_of_the_schedule(p, v, mult, r, w, sched):
    r %= p
    if sched != "interleaved":
        v = 1
    elif v == 1:
        v = 2
    m = p * mult
    weights = tuple(w[:v])
    got = schedule.in_flight(sched, p, v, m, r, weights)
    assert sum(c * x for c, x in zip(got, weights, strict=True)) == simulate_peak(sched, p, v, m, r, weights)


def test_interleaved_first_rank_holds_vp_plus_p_minus_1():
    """Korthikanti et al. 2022 Sec. 4.2.3 / Megatron: v*p + p - 1 chunk passes on the first rank."""
    for p, v in ((4, 2), (8, 3), (16, 8)):
        got = schedule.in_flight("interleaved", p, v, 4 * p, 0)
        assert sum(got) == v * p + p - 1
        assert got[0] == 2 * p - 1 and all(c == p for c in got[1:])


def _brute_force_best_max_load(layers: int, stages: int, first: float, last: float) -> float:
    """Independent check: try every composition of `layers` into `stages` parts."""
    extra = [0.0] * stages
    extra[0] += first
    extra[-1] += last
    best = float("inf")
    for cuts in itertools.combinations(range(layers + stages - 1), stages - 1):
        parts, prev = [], -1
        for c in (*cuts, layers + stages - 1):
            parts.append(c - prev - 1)
            prev = c
        best = min(best, max(n + e for n, e in zip(parts, extra, strict=True)))
    return best


@settings(max_examples=150, deadline=None)
@given(layers=st.integers(1, 12), data=st.data(),
       first=st.floats(0, 4, allow_nan=False), last=st.floats(0, 4, allow_nan=False))
def test_split_minimises_the_largest_stage_load(layers, data, first, last):
    stages = data.draw(st.integers(1, min(layers, 5)))
    got = balanced_split(layers, stages, first, last)
    assert sum(got) == layers and all(n >= 0 for n in got)
    extra = [0.0] * stages
    extra[0] += first
    extra[-1] += last
    load = max(n + e for n, e in zip(got, extra, strict=True))
    assert load <= _brute_force_best_max_load(layers, stages, first, last) + 1e-6


def test_split_on_llama3_405b_matches_the_paper():
    # Llama 3 herd paper (Dubey et al. 2024, section 3.3.2): 126 layers on PP=16 with one layer fewer
    # on the first and the last stage because they hold the embedding and the LM head.
    spec = ModelSpec(preset="llama3-405b")
    cost = embedding_cost(ModelShape.from_spec(spec))
    assert balanced_split(126, 16, cost, cost) == [7] + [8] * 14 + [7]


def test_planner_split_is_the_trainers_split():
    """The layers the plan prints per stage are the ones pipeline.stage_layers gives the trainer."""
    spec = load_spec_text("""
name: split
model: {preset: llama3-405b}
parallel: {tp: 8, pp: 16, dp: auto, schedule: interleaved, virtual_stages: 2, sequence_parallel: true}
train: {global_batch: 2048, steps: 10}
cluster: {nodes: 2048, gpus_per_node: 8, gpu: h100-sxm}
launcher: {backend: slurm}
""")
    ev = Evaluator(context_from_spec(spec))
    assert list(ev.stage_layers(candidate_from_spec(spec))) == stage_layers(spec)


def test_zero_bubble_bubble_is_a_third_of_1f1b_idle_time() -> None:
    """Qi et al. 2023 (Zero Bubble Pipeline Parallelism), Sec. 3.1: ZB-H1 idles (p-1)(T_F + T_B - T_W) per
    rank against 1F1B's (p-1)(T_F + T_B + T_W); with T_F = T_B = T_W that is one third."""
    from trainctl.plan.bubble import bubble_fraction, bubble_over_ideal, in_flight

    for p, m, v in ((2, 4, 1), (4, 8, 2), (8, 32, 4)):
        idle_1f1b = bubble_over_ideal(p, m, v, "interleaved" if v > 1 else "1f1b") * v * m
        idle_zb = bubble_over_ideal(p, m, v, "zero-bubble") * v * m
        assert idle_zb == pytest.approx(idle_1f1b / 3)
        f = bubble_fraction(p, m, v, "zero-bubble")
        assert f == pytest.approx(((p - 1) / 3) / (v * m + (p - 1) / 3))
        # same activations in flight as the schedule it splits the backward of (ZB-H1: 1F1B's memory)
        for r in range(p):
            assert in_flight("zero-bubble", p, v, m, r) == in_flight("interleaved" if v > 1 else "1f1b", p, v, m, r)


def _schedule_order(sched: str, p: int, v: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """Each rank's passes in order, (kind, stage, micro-batch) with kind F (forward), B (the whole backward, or
    its input-gradient part where the schedule splits it) and W (the weight gradient): GPipe and 1F1B as the
    trainer's torch schedules run them (1F1B: p-1-r warm-up forwards, then one forward and one backward, then
    the remaining backwards), interleaved, zero-bubble and ZBV from torch's own action lists."""
    if sched in ("gpipe", "1f1b"):
        out = {}
        for r in range(p):
            warm = m if sched == "gpipe" else min(p - 1 - r, m)
            seq = [("F", r, k) for k in range(warm)]
            for k in range(warm, m):
                seq += [("F", r, k), ("B", r, k - warm)]
            out[r] = seq + [("B", r, k) for k in range(m - warm if sched == "1f1b" else 0, m)]
        return out
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.distributed.pipelining.schedules import _ComputationType as T

    cls = {"interleaved": torch_schedules.ScheduleInterleaved1F1B, "zbv": torch_schedules.ScheduleZBVZeroBubble,
           "zero-bubble": torch_schedules.ScheduleInterleavedZeroBubble}[sched]
    ns = SimpleNamespace(pp_group_size=p, n_local_stages=v, num_stages=p * v, _n_microbatches=m,
                         microbatches_per_round=p)
    letter = {T.FORWARD: "F", T.FULL_BACKWARD: "B", T.BACKWARD_INPUT: "B", T.BACKWARD_WEIGHT: "W"}
    return {r: [(letter[a.computation_type], a.stage_index, a.microbatch_index)
                for a in cls._calculate_single_rank_operations(ns, r) if a is not None] for r in range(p)}


def _replay(sched: str, p: int, v: int, m: int) -> tuple[float, list[float], dict[int, list[list[int]]]]:
    """The order replayed with free communication: F takes 1 unit, a whole backward 2, a split one's B and W 1
    each; a pass starts when its rank is free and its inputs exist (F after the previous stage's F, B after the
    next stage's B or this last stage's F, W after its B). Returns (makespan, each rank's end, per rank the
    micro-batches held per chunk after each pass: from a micro-batch's F until its backward ends, W when split)."""
    _, clock, held = _replay_passes(sched, p, v, m)
    return max(clock), clock, held


def _replay_passes(sched: str, p: int, v: int, m: int
                   ) -> tuple[dict[int, list[tuple[str, int, int, float]]], list[float], dict[int, list[list[int]]]]:
    """_replay's passes: per rank (kind, stage, micro-batch, end time) in its order, each rank's end, the holdings."""
    from trainctl.plan.pipeline import stages_of_pp_rank

    order, last, split = _schedule_order(sched, p, v, m), p * v - 1, sched in ("zero-bubble", "zbv")
    done: dict[tuple[str, int, int], float] = {}
    passes: dict[int, list[tuple[str, int, int, float]]] = {r: [] for r in range(p)}
    clock, pos = [0.0] * p, [0] * p
    held: dict[int, list[list[int]]] = {r: [] for r in range(p)}
    counts = {r: [0] * v for r in range(p)}
    progress = True
    while progress:
        progress = False
        for r in range(p):
            chunks = stages_of_pp_rank(r, p, v, sched)
            while pos[r] < len(order[r]):
                kind, s, k = order[r][pos[r]]
                deps = {"F": [("F", s - 1, k)] if s > 0 else [],
                        "B": [("B", s + 1, k)] if s < last else [("F", s, k)], "W": [("B", s, k)]}[kind]
                if any(d not in done for d in deps):
                    break
                cost = 1.0 if kind == "F" or split else 2.0
                clock[r] = max([clock[r]] + [done[d] for d in deps]) + cost
                done[(kind, s, k)] = clock[r]
                passes[r].append((kind, s, k, clock[r]))
                counts[r][chunks.index(s)] += {"F": 1, "W" if split else "B": -1}.get(kind, 0)
                held[r].append(list(counts[r]))
                pos[r] += 1
                progress = True
    assert pos == [len(order[r]) for r in range(p)], "the replay deadlocked"
    return passes, clock, held


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zbv_bubble_and_memory_match_a_replay_of_torchs_order(p: int) -> None:
    """ZBV's bubble and peak activations, as the planner states them, against torch's own order replayed: the
    makespan is 6m passes of work (F, B, W of two chunks per micro-batch) plus zbv_idle_passes; the planner's
    transcription of the order is torch's; and in_flight's counts are the replay's peak for equal and unequal
    layers per chunk."""
    from trainctl.plan.bubble import bubble_fraction, in_flight, zbv_idle_passes, zbv_order
    from trainctl.plan.pipeline import stages_of_pp_rank

    for m in sorted({1, 2, p, 2 * p - 2, 2 * p - 1, 2 * p, 4 * p + 1} - {0}):
        makespan, _, held = _replay("zbv", p, 2, m)
        idle = makespan - 6 * m
        assert idle == zbv_idle_passes(p, m)
        if m >= 2 * p - 1:
            assert idle == p - 1  # the fill: rank r idles r passes first and p-1-r last
        # in chunk slots (F + B + W = 3 passes), over two chunks' work of m micro-batches each
        assert bubble_fraction(p, m, 2, "zbv") == pytest.approx((idle / 3) / (2 * m + idle / 3))
        for r in range(p):
            # the planner's transcription of torch's order is torch's order
            chunks = stages_of_pp_rank(r, p, 2, "zbv")  # chunk 0 is stage r, chunk 1 stage 2p-1-r, as torch's
            assert [(kind, chunks[c], k) for kind, c, k in zbv_order(p, m, r)] == _schedule_order("zbv", p, 2, m)[r]
            # the peak it states, for chunks of equal and of unequal layers, is the replay's
            for weights in ((1, 1), (3, 1), (1, 3), (0, 2)):
                want = in_flight("zbv", p, 2, m, r, weights)
                assert want in held[r]
                best = max(w0 * h0 + w1 * h1 for h0, h1 in held[r] for w0, w1 in [weights])
                assert weights[0] * want[0] + weights[1] * want[1] == best
            assert sum(in_flight("zbv", p, 2, m, r)) == min(2 * p, max(map(sum, held[r])))


def test_v_placement_matches_torchs_stage_to_rank_mapping() -> None:
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    from trainctl.plan.pipeline import end_stage_pp_ranks, pp_rank_of_stage, stages_of_pp_rank

    for p in (2, 3, 4, 8):
        for style, sched, v in (("v", "zbv", 2), ("loop", "interleaved", 3), ("loop", "1f1b", 1)):
            torch_map = generate_stage_to_rank_mapping(p, p * v, style=style)
            for r in range(p):
                assert sorted(stages_of_pp_rank(r, p, v, sched)) == sorted(s for s, x in torch_map.items() if x == r)
            assert all(pp_rank_of_stage(s, p, v, sched) == x for s, x in torch_map.items())
            assert end_stage_pp_ranks(p, sched) == (torch_map[0], torch_map[p * v - 1])


def test_zbv_plan_keeps_tied_embeddings_on_rank_0() -> None:
    """Under ZBV pipeline rank 0 holds the embedding and the LM head (both tied copies): no embedding-group
    traffic, both tables in rank 0's parameters, and every stage boundary but the V's turn crosses ranks."""
    from paths import TINY_RECIPE

    from trainctl.model_shape import ModelShape
    from trainctl.plan.plan import build_plan
    from trainctl.spec import load_spec

    plans = {s: build_plan(load_spec(TINY_RECIPE, overrides=[f"parallel.schedule={s}"])).to_json()
             for s in ("1f1b", "zbv")}
    comm = {s: j["communication"]["per_kind"] for s, j in plans.items()}
    assert comm["1f1b"]["embedding"]["bytes"] > 0 and comm["zbv"]["embedding"]["bytes"] == 0
    assert comm["zbv"]["pp"]["bytes"] == 2 * comm["1f1b"]["pp"]["bytes"]  # 2 remote boundaries per rank, not 1
    spec = load_spec(TINY_RECIPE)
    shape = ModelShape.from_spec(spec.model)
    table = shape.padded_vocab(spec.parallel.tp) * shape.hidden / spec.parallel.tp
    zbv, plain = plans["zbv"]["params"]["per_rank"], plans["1f1b"]["params"]["per_rank"]
    # one layer per stage: rank 1 holds two layers only; rank 0 two layers, both tables, norm (and positions)
    assert sum(zbv) == sum(plain) and zbv[0] - zbv[1] >= 2 * table


@pytest.mark.parametrize("sched,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4),
                                     ("zero-bubble", 2), ("zbv", 2)])
def test_the_drain_is_what_the_ranks_wait_after_their_last_pass(sched: str, v: int) -> None:
    """The drain (bubble.drain_share of the bubble) against each schedule's order replayed: the mean over the
    ranks of the time from a rank's last pass to the last rank's. The replay's whole backward costs two
    forwards (no recompute: backward_share 2/3), or its B and W one each, as the planner's zero-bubble and ZBV
    assume; a slot is one micro-batch's forward and backward through a rank's v chunks."""
    slot = 3 * v
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            span, ends, _ = _replay(sched, p, v, m)
            waited = sum(span - e for e in ends) / p
            bubble = schedule.bubble_slots(p, v, sched, m) * slot
            assert waited == pytest.approx(bubble * schedule.drain_share(p, v, sched, m, backward_share=2 / 3)), (p, m)
            if sched != "zbv":
                assert span == pytest.approx(m * slot + bubble)  # the planner's bubble is the replay's


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (8, 4, 16), (6, 8, 24), (4, 8, 4)])
def test_the_interleaved_gradient_reduction_left_over_matches_a_replay(p: int, v: int, m: int) -> None:
    """bubble.reduce_exposed against the interleaved order replayed (a backward of 2 units: one micro-batch's
    backward through a rank's v chunks is 2v). Each rank starts a chunk's gradient reduction, R/v on its DP link
    and one after another, when the chunk's last micro-batch backward is done, or r passes later on pipeline rank r
    (Megatron-Core's --delay-grad-reduce, the default); what runs past the pipeline's end, on the worst rank, is
    the exposed part."""
    passes, clock, _ = _replay_passes("interleaved", p, v, m)
    span = max(clock)
    for reduce_s in (1.0, 4.0, 16.0, 64.0):
        for delayed in (False, True):
            worst = 0.0
            for r in range(p):
                backward = [(k, t) for kind, _, k, t in passes[r] if kind == "B"]
                starts = []
                for i, (k, _) in enumerate(backward):
                    if k == m - 1:  # the chunk's last micro-batch
                        j = i + (r if delayed else 0)
                        starts.append(backward[j][1] if j < len(backward) else clock[r])
                free = 0.0
                for start in sorted(starts):
                    free = max(free, start) + reduce_s / v
                worst = max(worst, free - span)
            assert worst == pytest.approx(schedule.reduce_exposed(reduce_s, p, v, "interleaved", 2.0 * v)), (
                reduce_s, delayed)

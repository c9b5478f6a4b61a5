"""`plan --auto`'s pruned best-layout search and the node-count sweep (trainctl/plan/scale.py).

- The pruned search (auto.best_layout: floors, floor order, early stop) picks exactly the layout, MFU and step
  time that scoring every candidate and ranking them as `plan --auto` does picks: on recipes of every kind
  (dense, MoE, long-context with CP, a CPU rank with the nominal peak) and at several node counts.
- The sweep's point at each count is that count's `plan --auto` answer; its front is the Pareto front.
- Bad input is one UsageError (exit 2): an empty or malformed range, a money budget without a price.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from paths import REPO
from test_plan_auto import small_spec

from trainctl.errors import SpecError, UsageError
from trainctl.plan import scale
from trainctl.plan.auto import (
    NOMINAL_PEAK,
    best_layout,
    enumerate_candidates,
    enumerate_shapes,
    max_world,
    search,
    search_context,
)
from trainctl.plan.estimate import Evaluator
from trainctl.spec import load_spec


def exhaustive_best(spec):
    """Every candidate scored, the fitting ones ranked as plan --auto ranks them (independently of best_layout)."""
    ctx, _ = search_context(spec)
    ev = Evaluator(ctx)
    cap = ctx.hw.usable_bytes
    tight = 0.9 * cap if cap is not None else float("inf")
    flops = ev.model_flops_per_token * ev.tokens_per_step
    rows = []
    for i, c in enumerate(enumerate_candidates(spec, {})):
        step, mem, _, host_fits = ev.score_dp(c)
        if (cap is None or mem <= cap) and host_fits:
            mfu = flops / (step * ctx.world * (ctx.hw.peak_flops or NOMINAL_PEAK))
            rows.append(((mem > tight, -round(mfu, 12), mem, i), c, step))
    return min(rows, key=lambda r: r[0]) if rows else None


CASES = [("llama3-8b", None), ("llama3-8b", 1), ("mixtral-8x7b", None), ("llama3-405b", None), ("llama3-405b", 300),
         ("llama3-405b-long-context", None), ("tiny-cpu", None), ("tiny-moe-cpu", None)]


@pytest.mark.parametrize(("recipe", "nodes"), CASES, ids=[f"{r}@{n or 'recipe'}" for r, n in CASES])
def test_pruned_best_is_the_exhaustive_best(recipe, nodes):
    spec = load_spec(REPO / "recipes" / f"{recipe}.yaml")
    spec = scale.spec_at(spec, nodes) if nodes else spec
    ctx, _ = search_context(spec)
    best, scored = best_layout(spec, Evaluator(ctx))
    full = exhaustive_best(spec)
    assert full is not None and best is not None
    assert best.cand == full[1] and best.est.step_time == full[2] and -round(best.mfu, 12) == full[0][1]
    assert scored <= len(enumerate_candidates(spec, {}))
    top = search(spec, top=1).top[0][0]  # what `plan --auto` prints first
    assert (top.cand, top.mfu, top.est.step_time) == (best.cand, best.mfu, best.est.step_time)


@settings(max_examples=25, deadline=None)
@given(nodes=st.integers(1, 4), gpn=st.sampled_from([1, 2, 4, 8]), layers=st.integers(1, 8),
       heads=st.sampled_from([2, 4, 8]), gb=st.sampled_from([1, 6, 8, 16, 48]),
       gpu=st.sampled_from(["h100-sxm", "a100-40gb", "cpu"]))
def test_pruned_best_on_small_clusters(nodes, gpn, layers, heads, gb, gpu):
    try:
        spec = small_spec(nodes, gpn, layers, heads, heads, gb, gpu)
    except SpecError:  # the starting layout (tp = pp = 1, dp = world) is refused; the search needs a valid spec
        assume(False)
    best, _ = best_layout(spec, Evaluator(search_context(spec)[0]))
    full = exhaustive_best(spec)
    assert (best is None) == (full is None)
    if best is not None:
        assert (best.cand, best.est.step_time) == (full[1], full[2])


def test_sweep_points_are_each_counts_auto_answer():
    spec = load_spec(REPO / "recipes" / "llama3-8b.yaml", ["cluster.gpu_hour_price=2.5"])
    res = scale.sweep(spec, nodes=(1, 8), objective="cost")
    assert [p.nodes for p in res.points] + res.empty and sorted([p.nodes for p in res.points] + res.empty) == list(
        range(1, 9))
    for p in res.points:
        top = search(scale.spec_at(spec, p.nodes), top=1).top[0][0]
        assert (p.best.cand, p.best.mfu) == (top.cand, top.mfu)
        assert p.cost == pytest.approx(p.gpu_hours * 2.5)
    for p in res.points:  # the front holds exactly the points nothing beats on both days and GPU-hours
        beaten = any(q.days <= p.days and q.gpu_hours <= p.gpu_hours and (q.days, q.gpu_hours) != (p.days, p.gpu_hours)
                     for q in res.points)
        assert (p in res.front) == (not beaten)
    assert res.answer == min(res.points, key=lambda p: (p.gpu_hours, p.days))


def test_deadline_and_budget_pick_and_refuse():
    spec = load_spec(REPO / "recipes" / "llama3-8b.yaml")
    res = scale.sweep(spec, nodes=(1, 8))
    slowest = max(res.points, key=lambda p: p.days)
    met = scale.sweep(spec, nodes=(1, 8), deadline_days=slowest.days)
    assert met.answer == min(res.points, key=lambda p: (p.gpu_hours, p.days))
    fastest = min(p.days for p in res.points)
    with pytest.raises(UsageError, match="--deadline .* no node count in 1..8 meets it; the fastest"):
        scale.sweep(spec, nodes=(1, 8), deadline_days=fastest * 0.5)
    cheapest = min(p.gpu_hours for p in res.points)
    with pytest.raises(UsageError, match="--budget .* over"):
        scale.sweep(spec, nodes=(1, 8), budget=(cheapest * 0.5, True))


@pytest.mark.parametrize("text", ["512..16", "16..", "a..b", "0..4", "-4..8", "16...32"])
def test_bad_node_ranges(text):
    with pytest.raises(UsageError, match="--nodes"):
        scale.parse_nodes(text)


def test_parsing():
    assert scale.parse_nodes("16..512") == (16, 512) and scale.parse_nodes("64") == (64, 64)
    assert scale.parse_deadline("30d") == 30 and scale.parse_deadline("36h") == 1.5
    assert scale.parse_budget("2e6gpuh", None) == (2e6, True) and scale.parse_budget("5e6", 2.0) == (5e6, False)
    with pytest.raises(UsageError, match="cluster.gpu_hour_price"):
        scale.parse_budget("5e6", None)
    for bad in ("-3", "0", "lots"):
        with pytest.raises(UsageError, match="--budget"):
            scale.parse_budget(bad, 2.0)
        with pytest.raises(UsageError, match="--deadline"):
            scale.parse_deadline(bad)


@pytest.mark.parametrize(("lo", "hi", "has", "want"), [
    (100, 1000, lambda n: True, ([100, 1000], [])),  # once both points snapped to 512
    (3, 40, lambda n: True, ([3, 40], [])),  # once 16 and 32
    # an end without a layout is reported, and its window still gives a count (the most even nearest it)
    (3, 40, lambda n: n % 2 == 0, ([16, 40], [3])),
    (3, 41, lambda n: n % 2 == 0, ([16, 32], [3, 41])),
])
def test_the_ends_of_the_range_are_searched(lo, hi, has, want):
    assert scale.node_counts(lo, hi, 2, has) == want


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(1, 10**6), width=st.integers(0, 10**30), counts=st.integers(2, 80),
       modulus=st.integers(1, 12))
def test_geometric_counts_in_bounded_calls(lo, width, counts, modulus):
    """Any range, however wide: both ends searched, counts distinct and in range, and at most SNAP_TRIES + 1
    layout checks per point (the windows are never listed: the old code sorted each one, 6 GB for 1..1e9)."""
    hi = lo + width
    asked: list[int] = []

    def has_layout(n):
        asked.append(n)
        return n % modulus == 0

    found, left_out = scale.node_counts(lo, hi, counts, has_layout)
    assert found == sorted(set(found)) and left_out == sorted(set(left_out)) and not set(found) & set(left_out)
    assert all(lo <= n <= hi for n in found + left_out) and all(n % modulus == 0 for n in found)
    assert {lo, hi} <= set(found) | set(left_out) and {lo, hi} <= set(asked)
    assert len(asked) <= counts * (scale.SNAP_TRIES + 1)


def test_no_layout_above_the_rules_bound():
    """auto.max_world bounds every layout: tp divides gcd(heads, kv_heads) (llama3-8b: 8), and dp x pp is at
    most global_batch (512, micro-batches >= pp) -> 4,096 GPUs; 512 nodes of 8 is the last count with one."""
    spec = load_spec(REPO / "recipes" / "llama3-8b.yaml")
    assert max_world(spec)[0] == 8 * 512
    assert enumerate_shapes(scale.spec_at(spec, 512), {}) and not enumerate_shapes(scale.spec_at(spec, 513), {})
    long = load_spec(REPO / "recipes" / "llama3-405b-long-context.yaml")
    m = long.model  # cp: the largest power of two leaving each rank MIN_CP_TOKENS (4,096) tokens
    assert max_world(long)[0] == math.gcd(m.heads, m.kv_heads) * (m.seq_len // 4096) * long.train.global_batch


@settings(max_examples=40, deadline=None)
@given(gpn=st.sampled_from([1, 2, 4, 8]), layers=st.integers(1, 8), heads=st.sampled_from([2, 4, 8]),
       kv_div=st.sampled_from([1, 2]), gb=st.sampled_from([1, 6, 8, 16, 48]))
def test_max_world_bounds_every_layout(gpn, layers, heads, kv_div, gb):
    try:
        spec = small_spec(1, gpn, layers, heads, heads // kv_div, gb)
    except SpecError:
        assume(False)
    top = max_world(spec)[0] // gpn
    for nodes in range(1, top + 4):
        if enumerate_shapes(scale.spec_at(spec, nodes), {}):
            assert nodes <= top


def test_geometric_counts_snap_to_counts_with_layouts():
    counts, left_out = scale.node_counts(256, 16384, 64, lambda n: n <= 2048)
    assert counts and max(counts) <= 2048 and min(counts) == 256 and len(counts) + len(left_out) <= 64
    assert all(n > 2048 for n in left_out)
    every, none = scale.node_counts(1, 8, 64, lambda n: n % 3 != 0)
    assert every == [1, 2, 4, 5, 7, 8] and none == [3, 6]

"""Rank placement and process groups (Megatron order: tp fastest, then dp, then pp).

Properties from the issue's "Done when": placement is a bijection between ranks and (node, gpu); every
kind of group partitions the ranks; TP groups lie inside an NVLink domain iff tp_fits_nvlink. Also the
planner's closed forms for which link class each group kind uses (trainctl.plan.comm), checked against
the explicit groups. Megatron-LM's order: megatron/core/parallel_state.py (RankGenerator, "tp-dp-pp").
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from trainctl.plan import comm
from trainctl.plan.placement import (
    Groups,
    Layout,
    coords,
    placement,
    placement_table,
    rank_of,
    tp_fits_nvlink,
    tp_groups_outside_nvlink,
)

layouts = st.builds(
    lambda tp, pp, dp, g, dom: Layout(tp, pp, dp, g, dom),
    tp=st.sampled_from([1, 2, 3, 4, 8]), pp=st.integers(1, 4), dp=st.integers(1, 6),
    g=st.sampled_from([1, 2, 4, 8]), dom=st.sampled_from([1, 2, 3, 4, 8, 16, 72]),
)


@settings(max_examples=200, deadline=None)
@given(layouts)
def test_placement_is_a_bijection(layout):
    ranks = placement(layout)
    world = layout.world_size
    assert [r.rank for r in ranks] == list(range(world))
    spots = {(r.node, r.local_gpu) for r in ranks}
    assert len(spots) == world  # injective
    assert all(0 <= r.local_gpu < layout.gpus_per_node and 0 <= r.node < layout.nodes for r in ranks)
    for r in ranks:
        assert r.node * layout.gpus_per_node + r.local_gpu == r.rank  # and back: (node, gpu) -> rank
        assert (r.tp, r.dp, r.pp) == coords(r.rank, layout)
        assert rank_of(r.tp, r.dp, r.pp, layout) == r.rank
    assert len({(r.tp, r.dp, r.pp) for r in ranks}) == world
    assert len(placement_table(layout)) == world


@settings(max_examples=200, deadline=None)
@given(layouts)
def test_every_kind_of_group_partitions_the_ranks(layout):
    g = Groups(layout)
    world = layout.world_size
    sizes = {"tp": layout.tp, "dp": layout.dp, "pp": layout.pp, "model_parallel": layout.tp * layout.pp}
    for kind, size in sizes.items():
        groups = getattr(g, kind)
        flat = [r for grp in groups for r in grp]
        assert sorted(flat) == list(range(world)), kind
        assert all(len(grp) == size for grp in groups), kind
    emb = [r for grp in g.embedding for r in grp]
    assert len(emb) == len(set(emb))  # disjoint: the first and last stage of each pipeline chain
    # Megatron order: a TP group is a run of consecutive ranks.
    assert all(grp == list(range(grp[0], grp[0] + layout.tp)) for grp in g.tp)


@settings(max_examples=300, deadline=None)
@given(layouts)
def test_tp_inside_nvlink_iff_tp_fits_nvlink(layout):
    assert (not tp_groups_outside_nvlink(layout)) == tp_fits_nvlink(layout)


def _inside(groups: list[list[int]], domain: int) -> bool:
    return all(len({r // domain for r in grp}) == 1 for grp in groups)


@settings(max_examples=300, deadline=None)
@given(layouts)
def test_link_classes_match_the_explicit_groups(layout):
    """comm.tp_link / dp_link / pp_link (closed forms used by the planner and --auto) against the groups."""
    g, d, w = Groups(layout), layout.nvlink_domain, layout.world_size
    assert (comm.tp_link(layout.tp, w, d) == comm.NVLINK) == _inside(g.tp, d)
    assert (comm.dp_link(layout.tp, layout.dp, w, d) == comm.NVLINK) == _inside(g.dp, d)
    # PP: every pair of neighbouring stages inside one domain.
    edges = [[a, b] for chain in g.pp for a, b in zip(chain, chain[1:], strict=False)]
    assert (comm.pp_link(layout.pp, w, d) == comm.NVLINK) == _inside(edges, d)


def test_llama3_405b_layout_groups():
    """16,384 GPUs as TP 8 x DP 128 x PP 16: TP inside each 8-GPU node, DP and PP across nodes."""
    layout = Layout(8, 16, 128, 8, 8)
    assert tp_fits_nvlink(layout)
    assert comm.dp_link(8, 128, layout.world_size, 8) == comm.INTER_NODE
    assert comm.pp_link(16, layout.world_size, 8) == comm.INTER_NODE
    assert coords(8 * 128, layout) == (0, 0, 1)  # the first rank of pipeline stage 1


def test_of_rank_for_a_middle_pipeline_stage():
    # PP=4: ranks of stages 1 and 2 hold neither the embedding nor the LM head, so they are alone.
    layout = Layout(tp=1, pp=4, dp=1, gpus_per_node=4, nvlink_domain=4)
    groups = Groups(layout)
    assert groups.of_rank(1)["embedding"] == [1]
    assert groups.of_rank(0)["embedding"] == [0, 3] and groups.of_rank(2)["pp"] == [0, 1, 2, 3]

"""Rank placement and process groups (Megatron-Core order tp-cp-ep-dp-pp: tp fastest, then cp, then dp, then pp).

Properties: placement is a bijection between ranks and (node, gpu); every
kind of group partitions the ranks; TP groups lie inside an NVLink domain iff tp_fits_nvlink. Also the
planner's closed forms for which link class each group kind uses (trainctl.plan.comm), checked against
the explicit groups. Megatron-LM's order: megatron/core/parallel_state.py (RankGenerator, "tp-cp-ep-dp-pp").
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from paths import RECIPES

from trainctl.hardware.topology import aligned_domain_size
from trainctl.plan import comm
from trainctl.plan.placement import (
    Groups,
    Layout,
    coords,
    cp_coord,
    cp_fits_nvlink,
    cp_groups_outside_nvlink,
    placement,
    placement_table,
    rank_of,
    tp_fits_nvlink,
    tp_groups_outside_nvlink,
)
from trainctl.plan.plan import build_plan
from trainctl.spec import load_spec
from trainctl.units import dur

layouts = st.builds(
    lambda tp, pp, dp, g, dom, cp: Layout(tp=tp, pp=pp, dp=dp, gpus_per_node=g, nvlink_domain=dom, cp=cp),
    tp=st.sampled_from([1, 2, 3, 4, 8]), pp=st.integers(1, 4), dp=st.integers(1, 6),
    g=st.sampled_from([1, 2, 4, 8]), dom=st.sampled_from([1, 2, 3, 4, 8, 16, 72]), cp=st.sampled_from([1, 1, 2, 4]),
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
        assert (r.tp, r.dp, r.pp) == coords(r.rank, layout) and r.cp == cp_coord(r.rank, layout)
        assert rank_of(r.tp, r.dp, r.pp, layout, r.cp) == r.rank
    assert len({(r.tp, r.cp, r.dp, r.pp) for r in ranks}) == world
    assert len(placement_table(layout)) == world


@settings(max_examples=200, deadline=None)
@given(layouts)
def test_every_kind_of_group_partitions_the_ranks(layout):
    g = Groups(layout)
    world = layout.world_size
    sizes = {"tp": layout.tp, "dp": layout.dp, "pp": layout.pp, "cp": layout.cp, "dp_cp": layout.dp * layout.cp,
             "model_parallel": layout.tp * layout.cp * layout.pp}
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
    assert (comm.dp_link(layout.tp * layout.cp, layout.dp, w, d) == comm.NVLINK) == _inside(g.dp, d)
    assert (comm.dp_link(layout.tp, layout.dp * layout.cp, w, d) == comm.NVLINK) == _inside(g.dp_cp, d)
    assert (comm.cp_link(layout.tp, layout.cp, w, d) == comm.NVLINK) == _inside(g.cp, d) == cp_fits_nvlink(layout)
    assert (not cp_groups_outside_nvlink(layout)) == cp_fits_nvlink(layout)
    # PP: every pair of neighbouring stages inside one domain.
    edges = [[a, b] for chain in g.pp for a, b in zip(chain, chain[1:], strict=False)]
    assert (comm.pp_link(layout.pp, w, d) == comm.NVLINK) == _inside(edges, d)


def test_llama3_405b_layout_groups():
    """16,384 GPUs as TP 8 x DP 128 x PP 16: TP inside each 8-GPU node, DP and PP across nodes."""
    layout = Layout(tp=8, pp=16, dp=128, gpus_per_node=8, nvlink_domain=8)
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


def test_context_parallel_groups_in_megatron_core_order():
    """tp 2 x cp 2 x dp 2: r = tp + 2*(cp + 2*dp) (Megatron-Core RankGenerator, order "tp-cp-ep-dp-pp")."""
    layout = Layout(tp=2, pp=1, dp=2, gpus_per_node=8, nvlink_domain=8, cp=2)
    g = Groups(layout)
    assert g.cp[:2] == [[0, 2], [1, 3]]  # CP rank varies right after TP
    assert sorted(g.dp) == [[0, 4], [1, 5], [2, 6], [3, 7]]  # replicas of one (tp, cp) position
    assert g.dp_cp == [[0, 2, 4, 6], [1, 3, 5, 7]]  # gradients of every parameter reduce over dp x cp
    assert (coords(6, layout), cp_coord(6, layout)) == ((0, 1, 0), 1)
    without_cp = Layout(tp=2, pp=1, dp=4, gpus_per_node=8, nvlink_domain=8)
    assert {"cp", "dp_cp"} <= set(g.as_dict()) and "cp" not in Groups(without_cp).as_dict()


def test_llama3_405b_long_context_layout_groups():
    """The 131K-token stage: TP 8 x CP 16 x PP 16 x DP 8 = 16,384 GPUs (Llama 3 paper, Table 4). TP fills a
    node; each CP group spans 16 nodes (one GPU of each, stride 8), so its K/V exchange is inter-node."""
    layout = Layout(tp=8, pp=16, dp=8, gpus_per_node=8, nvlink_domain=8, cp=16)
    assert layout.world_size == 16_384 and tp_fits_nvlink(layout) and not cp_fits_nvlink(layout)
    assert comm.cp_link(8, 16, layout.world_size, 8) == comm.INTER_NODE
    assert Groups(layout).cp[0] == list(range(0, 8 * 16, 8))


def test_a_job_that_fills_nvlink_domains_in_part_is_told_the_aligned_allocation() -> None:
    """GB200 NVL72: 128 GPUs fill one 72-GPU NVLink domain and 56 of the next, so the data-parallel pairs of the
    pipeline stage on ranks 64-79 straddle the boundary and reduce over InfiniBand. The plan says so and prices two
    domains of 64 (whole groups of 16 four-GPU nodes) exactly as the plan with cluster.nvlink_domain: 64 prices
    them; a job of whole domains (144 GPUs) and a part with one domain per node (H100) are not told."""
    spec = RECIPES / "published" / "dgxc2505-llama31-405b-gb200.yaml"
    j = build_plan(load_spec(spec)).to_json()
    split = next(w["message"] for w in j["warnings"] if w["code"] == "NVLINK_DOMAIN_SPLIT")
    aligned = build_plan(load_spec(spec, ["cluster.nvlink_domain=64"])).to_json()
    step, alt = j["prediction"]["step_time_s"], aligned["prediction"]["step_time_s"]
    assert alt < 0.98 * step
    assert "as 2 domains of 64" in split and f"cluster.nvlink_domain: 64) the predicted step is {dur(alt)}" in split
    assert not [w for w in aligned["warnings"] if w["code"] == "NVLINK_DOMAIN_SPLIT"]
    assert (aligned_domain_size(128, 72, 4), aligned_domain_size(144, 72, 4),
            aligned_domain_size(256, 8, 8)) == (64, None, None)
    assert aligned_domain_size(100, 72, 4) == 20  # the largest domain of whole nodes that divides the job

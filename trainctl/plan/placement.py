"""Rank placement and process groups, Megatron-Core order `tp-cp-ep-dp-pp`: TP varies fastest, then CP,
then DP (EP carved from its fast part), then PP.

Global rank `r = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))`; with cp = 1 this is Megatron's
`tp-dp-pp`. A CP group (same tp, dp, pp) is cp ranks at stride tp inside an aligned block of tp*cp ranks.
Gradients of every parameter are reduced, and ZeRO shards, over the data-parallel x context-parallel group
(`dp_cp`: dp*cp ranks at stride tp inside an aligned block of tp*cp*dp ranks, CP varying fastest), as
Megatron-Core does: every CP rank computes gradients from its own tokens of the same sequences.

Expert parallelism follows the same order: EP is carved from the DP group and varies fastest inside it,
dp_rank = ep_rank + ep * edp_rank, so the global rank is
`tp_rank + tp * (cp_rank + cp * (ep_rank + ep * (edp_rank + dp/ep * pp_rank)))`. An EP group (same tp, cp,
edp, pp) is ep ranks at stride tp*cp inside an aligned block of tp*cp*ep ranks; an expert-data-parallel
group (same tp, cp, ep, pp) is dp/ep ranks at stride tp*cp*ep. Expert TP = tp. (The trainer refuses cp > 1
with MoE for now, spec/rules.py.)

This is the single source of truth for the layout: `trainctl plan` prints it and the bundled trainer
builds its process groups from it, so what the plan shows is what the job does. Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

from trainctl.hardware.topology import aligned_groups_fit, nvlink_domain_size
from trainctl.plan.pipeline import end_stage_pp_ranks
from trainctl.spec.models import RunSpec


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    gpus_per_node: int
    nvlink_domain: int  # GPUs per NVLink domain (may span several nodes, e.g. GB200 NVL72)
    ep: int = 1  # expert-parallel size, carved from dp (divides it)
    cp: int = 1  # context-parallel size (between tp and dp in rank order)
    schedule: str = "1f1b"  # the pipeline schedule: which pipeline rank holds the last stage (plan/pipeline.py)

    @classmethod
    def from_spec(cls, spec: RunSpec) -> Layout:
        return cls(tp=spec.parallel.tp, pp=spec.parallel.pp, dp=spec.dp, gpus_per_node=spec.cluster.gpus_per_node,
                   nvlink_domain=nvlink_domain_size(spec.cluster), ep=spec.parallel.ep, cp=spec.parallel.cp,
                   schedule=spec.parallel.schedule)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the replicas of each expert shard (dp / ep)."""
        return self.dp // self.ep

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    node: int
    local_gpu: int
    tp: int
    dp: int
    pp: int
    nvlink_domain: int  # index of the NVLink domain this GPU belongs to
    ep: int = 0  # expert-parallel rank (dp % ep)
    edp: int = 0  # expert-data-parallel rank (dp // ep)
    cp: int = 0  # context-parallel rank


def expert_coords(dp_rank: int, layout: Layout) -> tuple[int, int]:
    """(ep, edp) coordinates of a data-parallel rank: EP varies fastest inside DP (Megatron-Core)."""
    return dp_rank % layout.ep, dp_rank // layout.ep


def coords(rank: int, layout: Layout) -> tuple[int, int, int]:
    """(tp, dp, pp) coordinates of a global rank (its cp coordinate: `cp_coord`)."""
    inner = layout.tp * layout.cp
    return rank % layout.tp, (rank // inner) % layout.dp, rank // (inner * layout.dp)


def cp_coord(rank: int, layout: Layout) -> int:
    """The context-parallel rank of a global rank."""
    return (rank // layout.tp) % layout.cp


def rank_of(tp: int, dp: int, pp: int, layout: Layout, cp: int = 0) -> int:
    return tp + layout.tp * (cp + layout.cp * (dp + layout.dp * pp))


def placement(layout: Layout) -> list[RankInfo]:
    """Every rank's node, local GPU and coordinates, assuming ranks fill nodes in order."""
    out = []
    for rank in range(layout.world_size):
        t, d, p = coords(rank, layout)
        e, ed = expert_coords(d, layout)
        out.append(RankInfo(rank=rank, node=rank // layout.gpus_per_node, local_gpu=rank % layout.gpus_per_node, tp=t,
                            dp=d, pp=p, nvlink_domain=rank // layout.nvlink_domain, ep=e, edp=ed,
                            cp=cp_coord(rank, layout)))
    return out


@dataclass(frozen=True)
class Groups:
    """Process groups as lists of global ranks; each kind partitions the ranks."""

    layout: Layout

    @cached_property
    def tp(self) -> list[list[int]]:
        L = self.layout
        return [[rank_of(t, d, p, L, c) for t in range(L.tp)]
                for p in range(L.pp) for d in range(L.dp) for c in range(L.cp)]

    @cached_property
    def dp(self) -> list[list[int]]:
        """Data-parallel replicas of one (tp, cp, pp) position: the loader deals the batch over these."""
        L = self.layout
        return [[rank_of(t, d, p, L, c) for d in range(L.dp)]
                for p in range(L.pp) for c in range(L.cp) for t in range(L.tp)]

    @cached_property
    def cp(self) -> list[list[int]]:
        """Context-parallel groups: the ranks holding the chunks of the same sequences (K/V all-gather)."""
        L = self.layout
        return [[rank_of(t, d, p, L, c) for c in range(L.cp)]
                for p in range(L.pp) for d in range(L.dp) for t in range(L.tp)]

    @cached_property
    def dp_cp(self) -> list[list[int]]:
        """Data x context parallel: where every parameter's gradients are reduced and ZeRO shards (CP
        fastest, so the index in the group is cp_rank + cp * dp_rank). The dp groups when cp = 1."""
        L = self.layout
        return [[rank_of(t, d, p, L, c) for d in range(L.dp) for c in range(L.cp)]
                for p in range(L.pp) for t in range(L.tp)]

    @cached_property
    def pp(self) -> list[list[int]]:
        L = self.layout
        return [[rank_of(t, d, p, L, c) for p in range(L.pp)]
                for d in range(L.dp) for c in range(L.cp) for t in range(L.tp)]

    @cached_property
    def ep(self) -> list[list[int]]:
        """Expert-parallel groups: the ranks that exchange tokens (all-to-all) and split the experts."""
        L = self.layout
        return [[rank_of(t, e + L.ep * ed, p, L, c) for e in range(L.ep)]
                for p in range(L.pp) for ed in range(L.edp) for c in range(L.cp) for t in range(L.tp)]

    @cached_property
    def expert_dp(self) -> list[list[int]]:
        """Expert-data-parallel groups: the replicas of one expert shard (expert gradients reduce here)."""
        L = self.layout
        return [[rank_of(t, e + L.ep * ed, p, L, c) for ed in range(L.edp)]
                for p in range(L.pp) for e in range(L.ep) for c in range(L.cp) for t in range(L.tp)]

    @cached_property
    def model_parallel(self) -> list[list[int]]:
        """TP x CP x PP: the ranks holding one full model replica's work (one data-parallel replica)."""
        L = self.layout
        return [[rank_of(t, d, p, L, c) for p in range(L.pp) for c in range(L.cp) for t in range(L.tp)]
                for d in range(L.dp)]

    @cached_property
    def embedding(self) -> list[list[int]]:
        """The ranks of the first and last pipeline stage of each (dp, cp, tp) chain: tied embeddings sync their
        grads here. One rank when it holds both (pp = 1, or ZBV's V placement: the sync is local)."""
        first, last = end_stage_pp_ranks(self.layout.pp, self.layout.schedule)
        if first == last:
            return [[r] for chain in self.pp for r in chain]
        return [[chain[first], chain[last]] for chain in self.pp]

    def of_rank(self, rank: int) -> dict[str, list[int]]:
        """The groups a rank belongs to, by kind; a rank in no group of a kind (a middle pipeline stage
        has no embedding group) is alone in it."""
        return {kind: next((g for g in groups if rank in g), [rank]) for kind, groups in self.as_dict().items()}

    def as_dict(self) -> dict[str, list[list[int]]]:
        kinds = (("tp", "dp", "pp", "model_parallel", "embedding") + (("cp", "dp_cp") if self.layout.cp > 1 else ())
                 + (("ep", "expert_dp") if self.layout.ep > 1 else ()))
        return {k: getattr(self, k) for k in kinds}


def tp_fits_nvlink(layout: Layout) -> bool:
    """Closed form of `not tp_groups_outside_nvlink(layout)` (TP groups are aligned runs of tp ranks)."""
    return aligned_groups_fit(layout.tp, layout.world_size, layout.nvlink_domain)


def tp_groups_outside_nvlink(layout: Layout) -> list[list[int]]:
    """TP groups whose GPUs do not all lie inside one NVLink domain (these cross a slow link)."""
    ranks = placement(layout)
    return [g for g in Groups(layout).tp if len({ranks[r].nvlink_domain for r in g}) > 1]


def cp_fits_nvlink(layout: Layout) -> bool:
    """Closed form: every CP group lies inside one NVLink domain (CP groups sit in aligned blocks of tp*cp)."""
    return layout.cp == 1 or aligned_groups_fit(layout.tp * layout.cp, layout.world_size, layout.nvlink_domain)


def cp_groups_outside_nvlink(layout: Layout) -> list[list[int]]:
    """CP groups whose GPUs do not all lie inside one NVLink domain (their K/V exchange crosses the fabric)."""
    ranks = placement(layout)
    return [g for g in Groups(layout).cp if len({ranks[r].nvlink_domain for r in g}) > 1]


def ep_fits_nvlink(layout: Layout) -> bool:
    """Closed form: every EP group lies inside one NVLink domain (EP groups sit in aligned blocks of tp*ep)."""
    return layout.ep == 1 or aligned_groups_fit(layout.tp * layout.cp * layout.ep, layout.world_size,
                                                layout.nvlink_domain)


def ep_groups_outside_nvlink(layout: Layout) -> list[list[int]]:
    """EP groups whose GPUs do not all lie inside one NVLink domain (their all-to-all crosses the fabric)."""
    ranks = placement(layout)
    return [g for g in Groups(layout).ep if len({ranks[r].nvlink_domain for r in g}) > 1]


def tp_groups_across_nodes(layout: Layout) -> list[list[int]]:
    ranks = placement(layout)
    return [g for g in Groups(layout).tp if len({ranks[r].node for r in g}) > 1]


def placement_table(layout: Layout) -> list[dict[str, int]]:
    return [asdict(r) for r in placement(layout)]

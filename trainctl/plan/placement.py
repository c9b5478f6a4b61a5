"""Rank placement and process groups, Megatron order: TP varies fastest, then DP, then PP.

This is the single source of truth for the layout: `trainctl plan` prints it and the bundled trainer
builds its process groups from it, so what the plan shows is what the job does. Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

from trainctl.hardware.topology import aligned_groups_fit, nvlink_domain_size
from trainctl.spec.models import RunSpec


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    gpus_per_node: int
    nvlink_domain: int  # GPUs per NVLink domain (may span several nodes, e.g. GB200 NVL72)

    @classmethod
    def from_spec(cls, spec: RunSpec) -> Layout:
        return cls(spec.parallel.tp, spec.parallel.pp, spec.dp, spec.cluster.gpus_per_node,
                   nvlink_domain_size(spec.cluster))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

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


def coords(rank: int, layout: Layout) -> tuple[int, int, int]:
    """(tp, dp, pp) coordinates of a global rank."""
    return rank % layout.tp, (rank // layout.tp) % layout.dp, rank // (layout.tp * layout.dp)


def rank_of(tp: int, dp: int, pp: int, layout: Layout) -> int:
    return tp + layout.tp * (dp + layout.dp * pp)


def placement(layout: Layout) -> list[RankInfo]:
    """Every rank's node, local GPU and coordinates, assuming ranks fill nodes in order."""
    out = []
    for rank in range(layout.world_size):
        t, d, p = coords(rank, layout)
        out.append(RankInfo(rank, rank // layout.gpus_per_node, rank % layout.gpus_per_node, t, d, p,
                            rank // layout.nvlink_domain))
    return out


@dataclass(frozen=True)
class Groups:
    """Process groups as lists of global ranks; each kind partitions the ranks."""

    layout: Layout

    @cached_property
    def tp(self) -> list[list[int]]:
        L = self.layout
        return [[rank_of(t, d, p, L) for t in range(L.tp)] for p in range(L.pp) for d in range(L.dp)]

    @cached_property
    def dp(self) -> list[list[int]]:
        L = self.layout
        return [[rank_of(t, d, p, L) for d in range(L.dp)] for p in range(L.pp) for t in range(L.tp)]

    @cached_property
    def pp(self) -> list[list[int]]:
        L = self.layout
        return [[rank_of(t, d, p, L) for p in range(L.pp)] for d in range(L.dp) for t in range(L.tp)]

    @cached_property
    def model_parallel(self) -> list[list[int]]:
        """TP x PP: the ranks holding one full model replica (grad-norm reduction spans these)."""
        L = self.layout
        return [[rank_of(t, d, p, L) for p in range(L.pp) for t in range(L.tp)] for d in range(L.dp)]

    @cached_property
    def embedding(self) -> list[list[int]]:
        """First and last pipeline stage of each (dp, tp) chain: tied embeddings sync their grads here."""
        if self.layout.pp == 1:
            return [[r] for chain in self.pp for r in chain]
        return [[chain[0], chain[-1]] for chain in self.pp]

    def of_rank(self, rank: int) -> dict[str, list[int]]:
        """The groups a rank belongs to, by kind; a rank in no group of a kind (a middle pipeline stage
        has no embedding group) is alone in it."""
        return {kind: next((g for g in groups if rank in g), [rank]) for kind, groups in self.as_dict().items()}

    def as_dict(self) -> dict[str, list[list[int]]]:
        return {k: getattr(self, k) for k in ("tp", "dp", "pp", "model_parallel", "embedding")}


def tp_fits_nvlink(layout: Layout) -> bool:
    """Closed form of `not tp_groups_outside_nvlink(layout)` (TP groups are aligned runs of tp ranks)."""
    return aligned_groups_fit(layout.tp, layout.world_size, layout.nvlink_domain)


def tp_groups_outside_nvlink(layout: Layout) -> list[list[int]]:
    """TP groups whose GPUs do not all lie inside one NVLink domain (these cross a slow link)."""
    ranks = placement(layout)
    return [g for g in Groups(layout).tp if len({ranks[r].nvlink_domain for r in g}) > 1]


def tp_groups_across_nodes(layout: Layout) -> list[list[int]]:
    ranks = placement(layout)
    return [g for g in Groups(layout).tp if len({ranks[r].node for r in g}) > 1]


def placement_table(layout: Layout) -> list[dict[str, int]]:
    return [asdict(r) for r in placement(layout)]

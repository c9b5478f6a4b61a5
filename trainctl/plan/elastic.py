"""Elastic node ranges (cluster.min_nodes): the layout a run takes on the nodes it has left. No torch.

tp x cp x pp (and ep) stay as the spec says; the data-parallel size follows the world, dp = world / (tp*cp*pp),
and train.global_batch stays, so the micro-batches per step (gradient accumulation) become
global_batch / (micro_batch x dp). The trainer builds its layout from `for_world` (runtime/entry.py), the
planner lists the node counts a run may shrink to with `shrink_options` (docs/design/launch.md, "Elastic node
ranges").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainctl.errors import TrainctlError
from trainctl.spec import rules
from trainctl.spec.models import RunSpec


class CannotShrink(TrainctlError):
    """The world torchrun formed cannot hold the spec's layout with its global batch."""


@dataclass(frozen=True)
class NodeCount:
    """The run on `nodes` nodes: its dp and micro-batches per step, or why it cannot run there."""

    nodes: int
    dp: int | None = None
    micro_batches: int | None = None
    why_not: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "dp": self.dp, "micro_batches": self.micro_batches, "why_not": self.why_not}


def resized(spec: RunSpec, nodes: int) -> RunSpec:
    """`spec` on `nodes` nodes: dp follows (an explicit parallel.dp is recomputed, `auto` stays auto), the rest
    stays. The backend is pinned to the spec's, which `auto` would otherwise derive from the node count."""
    c, p = spec.cluster, spec.parallel
    world = nodes * c.gpus_per_node
    dp = p.dp if p.dp == "auto" else max(1, world // spec.model_parallel)
    return spec.model_copy(update={
        "cluster": c.model_copy(update={"nodes": nodes}),
        "parallel": p.model_copy(update={"dp": dp}),
        "launcher": spec.launcher.model_copy(update={"backend": spec.backend}),
    })


def on_nodes(spec: RunSpec, nodes: int) -> NodeCount:
    """Whether the layout runs on `nodes` nodes, and how (the spec rules decide, with their words)."""
    world = nodes * spec.cluster.gpus_per_node
    names = "tp*cp*pp" if spec.parallel.cp > 1 else "tp*pp"
    if world % spec.model_parallel:
        return NodeCount(nodes, why_not=f"{names} = {spec.model_parallel} does not divide its {world} ranks")
    small = resized(spec, nodes)
    problems = rules.check(small).problems
    if problems:
        return NodeCount(nodes, why_not=problems[0])
    return NodeCount(nodes, small.dp, small.micro_batches)


def shrink_options(spec: RunSpec) -> list[NodeCount]:
    """Every node count from cluster.min_nodes up to cluster.nodes, fewest first ([] when not elastic)."""
    if not spec.cluster.elastic:
        return []
    assert spec.cluster.min_nodes is not None
    return [on_nodes(spec, n) for n in range(spec.cluster.min_nodes, spec.cluster.nodes + 1)]


def for_world(spec: RunSpec, world_size: int) -> RunSpec:
    """The spec the trainer runs with `world_size` ranks: the spec itself at its own size (or when it is not
    elastic: the trainer then refuses the mismatch), the resized one inside the elastic range."""
    c = spec.cluster
    if world_size == c.world_size or not c.elastic or world_size % c.gpus_per_node:
        return spec
    nodes = world_size // c.gpus_per_node
    where = f"{nodes} of cluster.nodes = {c.nodes} node{'s' if c.nodes != 1 else ''}"
    if c.min_nodes is not None and nodes < c.min_nodes:
        raise CannotShrink(f"cannot continue on {where}: below cluster.min_nodes = {c.min_nodes}")
    fit = on_nodes(spec, nodes)
    if fit.why_not is not None:
        raise CannotShrink(f"cannot continue on {where}: {fit.why_not}",
                           hint="choose a layout and global batch that every node count from cluster.min_nodes up "
                                "divides (`trainctl plan` lists them), or raise cluster.min_nodes")
    return resized(spec, nodes)


def summary(options: list[NodeCount]) -> str:
    """One line for `trainctl plan`: the smallest layout it may shrink to, and the node counts it cannot use."""
    ok = [o for o in options if o.why_not is None and o.nodes < options[-1].nodes]
    bad = [o for o in options if o.why_not is not None]
    parts = []
    if ok:
        o = ok[0]
        parts.append(f"may shrink to {o.nodes} node{'s' if o.nodes != 1 else ''} "
                     f"(dp {o.dp} x {o.micro_batches} micro-batches, same global batch)")
    if bad:
        parts.append(f"cannot run on {node_list(bad)} node(s)")
    return "; ".join(parts) or "does not shrink"


def node_list(options: list[NodeCount], limit: int = 6) -> str:
    """'1, 2, 3, ... 31' (the first ones and the last)."""
    counts = [str(o.nodes) for o in options]
    return ", ".join(counts) if len(counts) <= limit else ", ".join(counts[:limit - 1]) + f", ... {counts[-1]}"


def resize_event(nominal: RunSpec, spec: RunSpec, events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The `elastic_resize` event's fields when an elastic run starts on another world than its previous start
    (or, on its first, than the spec's); None otherwise."""
    if not nominal.cluster.elastic:
        return None
    starts = [e for e in events if e.get("event") == "start" and isinstance(e.get("world_size"), int)]
    before = starts[-1] if starts else None
    was_world = before["world_size"] if before else nominal.world_size
    if was_world == spec.world_size:
        return None
    G = nominal.cluster.gpus_per_node
    was_nodes, was_dp = was_world // G, (before or {}).get("dp") or resized(nominal, was_world // G).dp
    was_mb = nominal.train.global_batch // (nominal.parallel.micro_batch * was_dp)
    n = spec.cluster.nodes
    return {"nodes": n, "world_size": spec.world_size, "dp": spec.dp, "micro_batches": spec.micro_batches,
            "previous_nodes": was_nodes, "previous_world_size": was_world, "previous_dp": was_dp,
            "previous_micro_batches": was_mb, "spec_nodes": nominal.cluster.nodes,
            "global_batch": spec.train.global_batch,
            "message": f"elastic: {was_nodes} -> {n} node{'s' if n != 1 else ''} ({spec.world_size} rank"
                       f"{'s' if spec.world_size != 1 else ''}): dp "
                       f"{was_dp} -> {spec.dp}, micro-batches per step {was_mb} -> {spec.micro_batches}, global "
                       f"batch {spec.train.global_batch} kept"}

"""NVLink-domain arithmetic shared by the spec rules and the placement (pure, no torch)."""

from __future__ import annotations

from typing import Any

from trainctl.hardware.catalog import ACCELERATORS


def nvlink_domain_size(cluster: Any) -> int:
    """GPUs per NVLink domain: the spec's override, else the catalog's, capped at one node unless the
    catalog says the domain spans nodes (rack-scale systems such as GB200 NVL72). 0 means 'a node'."""
    if cluster.nvlink_domain is not None:
        return cluster.nvlink_domain
    acc = ACCELERATORS.get(cluster.gpu)
    size = acc.nvlink_domain if acc else cluster.gpus_per_node
    if size <= 0:
        return cluster.gpus_per_node
    if getattr(acc, "domain_spans_nodes", False):
        return size
    return min(size, cluster.gpus_per_node)


def aligned_groups_fit(group_size: int, world_size: int, domain: int) -> bool:
    """Do aligned runs of `group_size` consecutive ranks each lie inside one domain of `domain` ranks?

    Runs start at multiples of group_size and domains at multiples of domain, so every run fits exactly
    when group_size divides domain (or everything is one domain)."""
    if world_size <= domain:
        return True
    return group_size <= domain and domain % group_size == 0

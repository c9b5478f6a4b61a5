"""NVLink-domain arithmetic shared by the spec rules and the placement (pure, no torch)."""

from __future__ import annotations

from typing import Any

from trainctl.hardware.catalog import ACCELERATORS, resolve_accelerator


def nvlink_domain_size(cluster: Any) -> int:
    """GPUs per NVLink domain for this cluster (see `resolve_accelerator` for the capping rules)."""
    if cluster.gpu not in ACCELERATORS and (cluster.peak_tflops is None or cluster.memory_gb is None):
        # An unknown part is reported by the spec rules; assume a node is one domain meanwhile.
        return cluster.nvlink_domain or cluster.gpus_per_node
    return resolve_accelerator(cluster).nvlink_domain


def aligned_groups_fit(group_size: int, world_size: int, domain: int) -> bool:
    """Do aligned runs of `group_size` consecutive ranks each lie inside one domain of `domain` ranks?

    Runs start at multiples of group_size and domains at multiples of domain, so every run fits exactly
    when group_size divides domain (or everything is one domain)."""
    if world_size <= domain:
        return True
    return group_size <= domain and domain % group_size == 0


def aligned_domain_size(world_size: int, domain: int, gpus_per_node: int) -> int | None:
    """Where an NVLink domain spans nodes (GB200 NVL72) and the job fills some domains only in part: the largest
    domain of whole nodes that divides the job, so every domain is full; None where the domains already divide
    the job, or the domain is a node's."""
    if domain <= gpus_per_node or world_size <= domain or world_size % domain == 0:
        return None
    return next((d for d in range(domain - domain % gpus_per_node, gpus_per_node, -gpus_per_node)
                 if world_size % d == 0), None)

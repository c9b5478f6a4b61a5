"""Placement proof at start-up: where every rank really runs, written to RUN/placement.json by rank 0.

Call once after the process groups exist (collective: every rank must call it). The node of a rank is
what the rank reports (SLURMD_NODENAME under Slurm, else the hostname), never derived from the rank
number: torchrun's c10d rendezvous hands out node ranks in join order, so global ranks 0..G-1 may run
on the second node of the allocation. If a TP group spans two nodes although the plan said none would
(`tp_groups_across_nodes`), the job stops with a clear error instead of training at a fraction of the
speed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainctl.fileio import replace_file
from trainctl.hardware.hostname import this_host
from trainctl.plan.pipeline import stages_of_pp_rank
from trainctl.plan.placement import Groups, Layout, coords, cp_coord, tp_groups_across_nodes
from trainctl.rundir.paths import PLACEMENT, RunPaths, record_event
from trainctl.runtime.parallel.process_groups import runs_on_gpu
from trainctl.spec.models import RunSpec


class PlacementError(RuntimeError):
    pass


def report(local_rank: int, on_gpu: bool) -> dict[str, Any]:
    """What this rank can say about itself; `on_gpu`: it trains on its CUDA device."""
    host = this_host()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu: str | None = None
    if on_gpu:
        idx = torch.cuda.current_device()
        ids = visible.split(",") if visible else []
        gpu = ids[idx] if idx < len(ids) else str(idx)  # the physical id where the launcher says it
        uuid = getattr(torch.cuda.get_device_properties(idx), "uuid", None)
        gpu_uuid = str(uuid) if uuid is not None else None
    else:
        gpu_uuid = None
        ids = visible.split(",") if visible else []
        # CPU ranks on a (possibly emulated) GPU allocation: the GPU this local rank would use.
        gpu = ids[local_rank] if local_rank < len(ids) else None
    return {"host": host, "node": os.environ.get("SLURMD_NODENAME") or host,
            "slurm_node_id": os.environ.get("SLURM_NODEID"), "local_rank": local_rank, "gpu": gpu,
            "gpu_uuid": gpu_uuid, "cuda_visible_devices": visible, "pid": os.getpid()}


def build_map(reports: list[dict[str, Any]], layout: Layout, virtual_stages: int = 1) -> dict[str, Any]:
    """Rank -> (host, node, gpu, tp, cp, dp, pp, the model stages it holds), and the TP groups that really
    span nodes. Pure."""
    order: list[str] = []  # node index by the lowest rank on it: node 0 holds rank 0
    for r in reports:
        if r["node"] not in order:
            order.append(r["node"])
    ranks = []
    for rank, r in enumerate(reports):
        t, d, p = coords(rank, layout)
        ranks.append({"rank": rank, "host": r["host"], "node": r["node"], "node_index": order.index(r["node"]),
                      "slurm_node_id": r.get("slurm_node_id"), "local_rank": r["local_rank"], "gpu": r["gpu"],
                      "tp": t, "cp": cp_coord(rank, layout), "dp": d, "pp": p, "pid": r.get("pid"),
                      "stages": stages_of_pp_rank(p, layout.pp, virtual_stages, layout.schedule)})
    groups = Groups(layout)
    across = [g for g in groups.tp if len({reports[x]["node"] for x in g}) > 1]
    seen: dict[tuple[str, str], list[int]] = {}
    for x in ranks:
        if x["gpu"] is not None:
            seen.setdefault((x["node"], x["gpu"]), []).append(x["rank"])
    shared = {f"{n}:{g}": rs for (n, g), rs in seen.items() if len(rs) > 1}
    return {"world_size": len(reports), "layout": {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp,
                                                   "gpus_per_node": layout.gpus_per_node,
                                                   "schedule": layout.schedule, "virtual_stages": virtual_stages},
            "nodes": order, "ranks": ranks, "tp_groups_across_nodes": across,
            "tp_groups_across_nodes_planned": tp_groups_across_nodes(layout), "shared_gpus": shared}


def check(mapping: dict[str, Any]) -> None:
    """Raise if the job runs a placement the plan did not promise."""
    planned, actual = mapping["tp_groups_across_nodes_planned"], mapping["tp_groups_across_nodes"]
    if actual and not planned:
        by_rank = {x["rank"]: x["node"] for x in mapping["ranks"]}
        g = actual[0]
        where = ", ".join(f"rank {r} on {by_rank[r]}" for r in g)
        raise PlacementError(
            f"placement: {len(actual)} tensor-parallel group(s) span two nodes although the plan put every TP "
            f"group inside one node, e.g. TP group {g}: {where}. The launcher placed ranks differently from "
            f"the plan (ranks per node must be cluster.gpus_per_node, consecutive ranks on one node); see "
            f"{PLACEMENT}")


def prove_placement(spec: RunSpec, paths: RunPaths, rank: int, local_rank: int,
                    world_size: int) -> dict[str, Any] | None:
    """Collective. Every rank reports; rank 0 writes RUN/placement.json; every rank raises on a bad map."""
    mine = report(local_rank, runs_on_gpu(spec))
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        reports: list[Any] = [None] * world_size
        dist.all_gather_object(reports, mine)
    else:
        reports = [mine]
    mapping = build_map(reports, Layout.from_spec(spec), spec.parallel.virtual_stages)
    if rank == 0:
        replace_file(paths.placement, (json.dumps(mapping, indent=1) + "\n").encode())
        # Per attempt (placement.json keeps only the latest): rendezvous may order the nodes differently in
        # every attempt, and `trainctl logs --rank N` finds a rank's files of each attempt from this.
        record_event(paths, "placement", nodes=mapping["nodes"],
                     tp_groups_across_nodes=len(mapping["tp_groups_across_nodes"]),
                     ranks=[[x["node"], x["local_rank"]] for x in mapping["ranks"]],
                     pp=[x["pp"] for x in mapping["ranks"]],  # stragglers: judged within a stage (rundir/steptimes.py)
                     job_id=os.environ.get("SLURM_JOB_ID"), slurm_restart=os.environ.get("SLURM_RESTART_COUNT", "0"),
                     torchrun_restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    check(mapping)  # the same decision on every rank: all stop together
    return mapping


def read_placement(root: Path) -> dict[str, Any] | None:
    try:
        return json.loads(RunPaths(root).placement.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None

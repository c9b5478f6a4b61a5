"""Rank variables, process-group start-up, the parallel groups of the plan, and a clean exit.

Groups come from `trainctl.plan.placement.Groups`, the same lists `trainctl plan` prints, so the job
runs exactly the placement the plan shows.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from trainctl.plan.placement import Groups, Layout, coords, cp_coord, expert_coords
from trainctl.spec.models import RunSpec

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankEnv:
    rank: int
    local_rank: int
    world_size: int

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> RankEnv:
        """torchrun's RANK/LOCAL_RANK/WORLD_SIZE, else srun's SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS."""
        e = dict(os.environ if env is None else env)
        if "RANK" in e and "WORLD_SIZE" in e:
            return cls(int(e["RANK"]), int(e.get("LOCAL_RANK", "0")), int(e["WORLD_SIZE"]))
        if "SLURM_PROCID" in e and "SLURM_NTASKS" in e:
            return cls(int(e["SLURM_PROCID"]), int(e.get("SLURM_LOCALID", "0")), int(e["SLURM_NTASKS"]))
        return cls(0, 0, 1)  # a plain `python -m trainctl.runtime RUN_DIR`: one process

    def export(self) -> None:
        """init_process_group's env:// rendezvous reads RANK/WORLD_SIZE; srun only sets SLURM_*."""
        os.environ.setdefault("RANK", str(self.rank))
        os.environ.setdefault("WORLD_SIZE", str(self.world_size))
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")


def attempt_store(env: RankEnv) -> dist.Store:
    """The rendezvous store, under a prefix unique to this attempt.

    torchrun keeps one agent store across worker restarts, and every process group created after the
    default one (new_group, our checkpoint group) looks up its peers' addresses under keys that do not
    change between attempts: a restarted worker then reads the dead attempt's addresses and gloo fails
    with "connectFullMesh ... Connection refused" (seen here with torch 2.13). A per-attempt prefix
    makes every key fresh. Without torchrun's agent, rank 0 hosts the store itself.
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                         is_master=env.rank == 0 and not agent, timeout=timedelta(seconds=timeout_s()))
    # torchrun does not count a restart for new nodes joining (a membership change), but the world then
    # grows: the world size keeps those attempts apart (docs/design/launch.md, "Elastic node ranges").
    attempt = (f"{os.environ.get('SLURM_RESTART_COUNT', '0')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
               f".w{env.world_size}")
    return dist.PrefixStore(f"trainctl/attempt-{attempt}/", base)


def timeout_s() -> float:
    return float(os.environ.get("TRAINCTL_TIMEOUT_S", DEFAULT_TIMEOUT_S))


@dataclass
class Parallel:
    """This rank's place in the layout and its process groups (None where the group is trivial).

    `dp_rank`, `dp_group` and `dp` are the group gradients are reduced over and ZeRO/FSDP shard over: data x
    context parallel (Megatron-Core's data-parallel group with context parallelism; plan/placement.py
    `Groups.dp_cp`), index cp_rank + cp * replica. With cp = 1 that is the data-parallel group. The data
    loader deals batches over the `replicas` (layout.dp) by `replica`; CP ranks of one replica share them."""

    env: RankEnv
    layout: Layout
    device: torch.device
    tp_rank: int
    dp_rank: int
    pp_rank: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    embedding_group: dist.ProcessGroup | None  # first + last pipeline stage, for tied embeddings
    ranks: dict[str, list[int]]
    world_group: dist.ProcessGroup | None = None  # all ranks of the layout (None: the default group)
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None  # the ranks holding the other chunks of the same sequences
    ep_group: dist.ProcessGroup | None = None  # expert parallelism: the ranks that exchange tokens
    expert_dp_group: dist.ProcessGroup | None = None  # the replicas of this rank's experts (dp/ep ranks)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def dp(self) -> int:
        """Size of the gradient-reduction group: data x context parallel."""
        return self.layout.dp * self.layout.cp

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of the gradient-reduction group, in dp_rank order."""
        return self.ranks.get("dp_cp", self.ranks["dp"])

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def replica(self) -> int:
        """Which data-parallel replica this rank belongs to (the batch share it reads)."""
        return self.dp_rank // self.layout.cp

    @property
    def replicas(self) -> int:
        return self.layout.dp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def ep_rank(self) -> int:
        return expert_coords(self.replica, self.layout)[0]

    @property
    def edp_rank(self) -> int:
        """Expert-data-parallel rank (this rank's place among the replicas of its experts)."""
        return expert_coords(self.replica, self.layout)[1]


def init(spec: RunSpec, env: RankEnv) -> Parallel:
    layout = Layout.from_spec(spec)
    if layout.world_size != env.world_size:
        raise RuntimeError(f"the spec's layout tp*cp*pp*dp = {layout.tp}*{layout.cp}*{layout.pp}*{layout.dp} = "
                           f"{layout.world_size} ranks but {env.world_size} processes were started; "
                           "fix cluster.nodes/gpus_per_node or the launcher's process count")
    device = start_process_group(env, runs_on_gpu(spec))
    par = parallel_groups(layout, env, device)
    assert par is not None  # the layout covers the whole world
    return par


def runs_on_gpu(spec: RunSpec) -> bool:
    """A rank trains on its GPU when the spec names one and CUDA sees one: `cluster.gpu: cpu` stays on the CPU
    on a machine with GPUs too (an 8-rank CPU recipe on a 1-GPU box would otherwise put ranks 1-7 on GPUs
    that do not exist), and a GPU spec on a machine without one still runs, on the CPU."""
    return spec.cluster.gpu != "cpu" and torch.cuda.is_available()


def start_process_group(env: RankEnv, gpu: bool) -> torch.device:
    """The default process group (NCCL on GPUs, gloo on the CPU) on the per-attempt store; this rank's device."""
    if gpu:
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    env.export()
    dist.init_process_group(backend, store=attempt_store(env), rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout_s()),
                            device_id=device if backend == "nccl" else None)
    return device


def parallel_groups(layout: Layout, env: RankEnv, device: torch.device) -> Parallel | None:
    """This rank's groups for `layout`, laid on global ranks [0, layout.world_size) of the running process
    group. Every rank of the process group calls it (new_group is collective); ranks beyond the layout get
    None. A layout smaller than the world (several layouts in one process group: the equivalence matrix)
    gets its own world group; groups already made for the same rank lists are reused."""
    world = dist.get_world_size()
    if layout.world_size > world:
        raise RuntimeError(f"layout needs {layout.world_size} ranks, the process group has {world}")
    groups = Groups(layout)
    kinds = ("tp", "dp_cp", "pp", "embedding", "cp") + (("ep", "expert_dp") if layout.ep > 1 else ())
    made = {kind: _subgroup(getattr(groups, kind), env.rank) for kind in kinds}
    world_group = None if layout.world_size == world else _subgroup([list(range(layout.world_size))], env.rank)
    if env.rank >= layout.world_size:
        return None
    t, d, p = coords(env.rank, layout)
    c = cp_coord(env.rank, layout)
    sub_env = RankEnv(env.rank, env.local_rank, layout.world_size)
    return Parallel(env=sub_env, layout=layout, device=device, tp_rank=t, dp_rank=c + layout.cp * d, pp_rank=p,
                    tp_group=made["tp"], dp_group=made["dp_cp"], pp_group=made["pp"],
                    embedding_group=made["embedding"], ranks=groups.of_rank(env.rank), world_group=world_group,
                    cp_rank=c, cp_group=made["cp"], ep_group=made.get("ep"), expert_dp_group=made.get("expert_dp"))


_made_groups: dict[tuple[tuple[int, ...], ...], dist.ProcessGroup | None] = {}


def _subgroup(lists: list[list[int]], rank: int) -> dist.ProcessGroup | None:
    """Every rank creates every group of a kind in the same order (new_group is collective)."""
    if all(len(g) == 1 for g in lists):
        return None
    key = tuple(tuple(g) for g in lists)
    if key not in _made_groups:
        mine, _ = dist.new_subgroups_by_enumeration(lists, timeout=timedelta(seconds=timeout_s()))
        _made_groups[key] = mine
    return _made_groups[key]


def exit_now(code: int, barrier: bool) -> NoReturn:
    """Leave without running interpreter shutdown: it SIGABRTs at random after gloo/FSDP
    (docs/design/checked-facts.md, "Checked facts: PyTorch distributed on CPU/gloo").

    On success every rank meets at a barrier first so no rank tears down sockets another still uses;
    on failure there is no barrier (the peers may be dead) and torchrun stops the rest."""
    if barrier and dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        except Exception as e:  # a peer that died at the very end still gives an exit code
            print(f"trainctl: final barrier failed: {e}", file=sys.stderr)
            code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

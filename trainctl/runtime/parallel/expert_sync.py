"""Gradients of a model with expert parallelism: the dense parameters are reduced over the data-parallel
group, the routed experts over the expert-data-parallel group (docs/design/trainer.md, "MoE block").

Composed, not written again: one `GradSync` for the dense parameters on the DP group and one for the expert
parameters on the expert-DP group (the dp/ep replicas of this rank's experts), each with its own buckets,
ZeRO-1/2 slices and fp32 master copies, behind `ExpertSplitSync`, which has GradSync's interface. Under
ZeRO-3 FSDP2 shards each MoE layer's routed experts (one unit) over the expert-DP mesh (`shard_experts`)
before the blocks are sharded over the DP mesh, so the blocks' FSDP units leave the experts out.

The scaling: the loss of every DP replica is its own mean, and a rank's expert gradient sums the
contributions of the tokens every EP peer sent it; summed over the expert-DP group it holds all dp replicas'
contributions, so it is divided by dp (not by the expert-DP size dp/ep). GradSync pre-divides by the size of
its own group, so `finish` divides the experts' gradients by ep once more; FSDP2 is given dp as its divide
factor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import Tensor, nn

from trainctl.plan.memory import bf16_params
from trainctl.runtime.model.moe import RoutedExperts, is_expert_param
from trainctl.runtime.parallel.data_parallel import GradSync, ParamInfo, fsdp_policy, offload_policy
from trainctl.runtime.parallel.process_groups import Parallel


def expert_view(par: Parallel) -> Parallel:
    """`par` as the experts see data parallelism: the expert-DP group in place of the DP group (no tied
    embedding among the experts)."""
    layout = replace(par.layout, dp=par.layout.edp, ep=1)
    return replace(par, layout=layout, dp_rank=par.edp_rank, dp_group=par.expert_dp_group, embedding_group=None,
                   ranks={**par.ranks, "dp": par.ranks["expert_dp"]})


class ExpertSplitSync:
    """GradSync's interface over the dense parameters' sync and the experts' (module docstring); `finish`
    multiplies the experts' reduced gradients by `expert_scale`."""

    def __init__(self, dense: GradSync, experts: GradSync, expert_scale: float):
        self.dense, self.experts, self.expert_scale = dense, experts, expert_scale

    def parts(self) -> list[GradSync]:
        """The two syncs, each with its own `par` (its data-parallel group): checkpointing walks them."""
        return [self.dense, self.experts]

    def start_step(self, step: int = 1) -> None:
        for s in self.parts():
            s.start_step(step)

    def backward_done(self, stage: int) -> None:
        for s in self.parts():
            s.backward_done(stage)

    def finish(self) -> None:
        for s in self.parts():
            s.finish()
        grads = self.experts.all_grads()  # none on a pipeline rank without MoE layers
        if grads and self.expert_scale != 1.0:
            torch._foreach_mul_(grads, self.expert_scale)  # to the mean over all dp replicas

    def reset_compression(self) -> None:
        for s in self.parts():
            s.reset_compression()

    def norm_pieces(self) -> Iterable[tuple[Tensor, bool]]:
        for s in self.parts():
            yield from s.norm_pieces()

    def all_grads(self) -> list[Tensor]:
        return [g for s in self.parts() for g in s.all_grads()]

    def optimizer_groups(self) -> list[tuple[list[Tensor], bool]]:
        out: dict[bool, list[Tensor]] = {True: [], False: []}
        for s in self.parts():
            for tensors, decays in s.optimizer_groups():
                out[decays].extend(tensors)
        return [(out[True], True), (out[False], False)]

    def held(self) -> dict[str, list[Tensor]]:
        parts = [s.held() for s in self.parts()]
        return {k: [t for h in parts for t in h[k]] for k in parts[0]}

    def before_step(self) -> None:
        for s in self.parts():
            s.before_step()

    def after_step(self) -> None:
        for s in self.parts():
            s.after_step()

    def full_master(self) -> dict[int, Tensor]:
        return {k: v for s in self.parts() for k, v in s.full_master().items()}


def grad_sync(infos: list[ParamInfo], par: Parallel, zero: int, micro_batches: int,
              reduce_dtype: torch.dtype | None, precision: str, powersgd: tuple[int, int, int] | None = None,
              offload: bool = False) -> GradSync | ExpertSplitSync:
    """The trainer's gradient sync without FSDP: one GradSync, or the split one under expert parallelism.
    Parameters are bf16 where their own reduction group shards the optimizer (plan/memory.py bf16_params):
    the experts' group is the expert-DP one (dp / ep ranks). `offload`: each sync whose group shards keeps its
    optimizer slice on the host."""
    def sync(group: list[ParamInfo], on: Parallel, dp: int) -> GradSync:
        dtype = torch.bfloat16 if bf16_params(precision, zero, dp) else None
        return GradSync(group, on, zero, micro_batches, reduce_dtype=reduce_dtype, param_dtype=dtype,
                        powersgd=powersgd, offload=offload)

    if par.ep == 1:
        return sync(infos, par, par.dp)
    dense, experts = _split(infos)
    return ExpertSplitSync(sync(dense, par, par.dp), sync(experts, expert_view(par), par.dp // par.ep),
                           1.0 / par.ep)


def _split(infos: list[ParamInfo]) -> tuple[list[ParamInfo], list[ParamInfo]]:
    return [i for i in infos if not is_expert_param(i.name)], [i for i in infos if is_expert_param(i.name)]


def shard_experts(modules: list[nn.Module], par: Parallel, reduce_dtype: torch.dtype | None,
                  reshard_after_forward: bool, param_dtype: torch.dtype | None = None, offload: bool = False) -> None:
    """ZeRO-3 under expert parallelism: fully_shard each layer's routed experts over the expert-DP mesh,
    dividing their gradients by dp (the module docstring). Call before the blocks are sharded over the DP
    mesh."""
    if par.ep == 1:
        return
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    group = par.expert_dp_group if par.expert_dp_group is not None else _alone(par)
    mesh = DeviceMesh.from_group(group, par.device.type, mesh=torch.tensor(par.ranks["expert_dp"]),
                                 mesh_dim_names=("expert_dp",))
    mp = fsdp_policy(reduce_dtype, param_dtype)
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, RoutedExperts):
                fully_shard(sub, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                            **offload_policy(par, offload))
                sub.set_gradient_divide_factor(float(par.dp))
                if par.expert_dp_group is not None:  # gloo has no PREMUL_SUM for the factor; on a one-rank
                    sub.set_force_sum_reduction_for_comms(True)  # mesh this would divide twice (torch 2.13)


_alone_groups: dict[int, object] = {}


def _alone(par: Parallel):
    """A one-rank process group (ep = dp: the experts have no replica; FSDP2 still wants a mesh)."""
    if par.rank not in _alone_groups:
        import torch.distributed as dist

        _alone_groups[par.rank] = dist.new_group([par.rank], use_local_synchronization=True)
    return _alone_groups[par.rank]

"""Parallelize built stages from outside, in one step: compile, shard, sync gradients.

The model's own layers already hold their TP and CP (runtime/model/parallel_context.py: hand-written layers,
faster here than DTensor's); what is applied to the built stages afterwards is here, in torchtitan's order:
torch.compile of every block first, then ZeRO-3 (FSDP2: the experts over the expert-DP group, then the blocks
over the DP group), then the object that reduces gradients over DP every step (ZeRO-0/1/2, expert sync,
PowerSGD, optimizer offload; FSDP's own under ZeRO-3). The trainer reads build -> parallelize -> loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainctl.runtime.model.fp8 import Fp8Recipe
from trainctl.runtime.model.transformer import StageModule, compile_blocks
from trainctl.runtime.parallel import data_parallel, expert_sync
from trainctl.runtime.parallel.process_groups import Parallel
from trainctl.runtime.parallel.tensor_parallel import enable_fp8
from trainctl.spec.models import RunSpec

GradSync = data_parallel.GradSync | expert_sync.ExpertSplitSync | data_parallel.FsdpSync


@dataclass(frozen=True)
class Parallelized:
    """What the loop needs of the parallelized stages."""

    sync: GradSync  # reduces gradients over DP, holds the optimizer's view of the parameters
    fsdp: bool  # ZeRO-3: FSDP2 gathers each block's parameters around its forward and backward


def parallelize(modules: list[StageModule], spec: RunSpec, par: Parallel, *, precision: str,
                micro_batches: int) -> Parallelized:
    """Apply compile, FSDP2 and gradient sync to this rank's built (and initialised) stages, in place.
    `precision`: the one the run computes in (plan/memory.py compute_precision)."""
    t, p = spec.train, spec.parallel
    if t.precision == "fp8":  # before compile traces the layers (docs/design/trainer.md, "FP8 training")
        recipe = Fp8Recipe.named(t.fp8_recipe)
        for m in modules:
            enable_fp8(m, recipe)
    compile_blocks(modules, t.compile_with)  # before FSDP wraps the blocks, as torchtitan orders them
    fsdp = p.zero == 3 and par.dp > 1
    reduce_dtype = torch.bfloat16 if p.grad_reduce_dtype == "bf16" else None
    offload = p.offload == "optimizer"
    if fsdp:
        # zero-bubble schedules run weight-gradient passes after later forwards: with FSDP2's default
        # resharding they train on wrong weights (docs/design/checked-facts.md, "Checked facts: PyTorch distributed
        # on CPU/gloo")
        reshard = p.schedule not in ("zero-bubble", "zbv")
        bf16 = torch.bfloat16 if precision == "bf16" else None
        for shard in (expert_sync.shard_experts, data_parallel.apply_fsdp):  # experts first, over expert-DP
            shard(modules, par, reduce_dtype, reshard_after_forward=reshard, param_dtype=bf16, offload=offload)
    infos = param_infos(modules, par)
    if fsdp:
        return Parallelized(sync=data_parallel.FsdpSync(infos, par), fsdp=True)
    # bf16 parameters under bf16 ZeRO-1/2: the fp32 master slice is the truth (plan/memory.py bf16_params)
    psgd = (p.powersgd.rank, p.powersgd.start_step, t.seed) if p.powersgd else None  # runtime/parallel/powersgd.py
    sync = expert_sync.grad_sync(infos, par, zero=p.zero, micro_batches=micro_batches, reduce_dtype=reduce_dtype,
                                 precision=precision, powersgd=psgd, offload=offload)
    return Parallelized(sync=sync, fsdp=False)


def param_infos(modules: list[StageModule], par: Parallel) -> list[data_parallel.ParamInfo]:
    """Every parameter of this rank's stages as the gradient sync sees it: replicated over TP or not, tied
    (the embedding and its last-stage copy) or not, and its stage."""
    infos = []
    # the tied copies' grads are summed over the embedding group, or on this rank when it holds both ends
    # (ZBV's V placement: data_parallel.sum_tied)
    tied_sync = par.embedding_group is not None or (
        len(modules) > 1 and all(any(getattr(m, end) for m in modules) for end in ("first", "last")))
    for stage, m in enumerate(modules):
        meta = m.named_param_meta()
        tied = m.tied_parameter_names() if tied_sync else set()
        for name, q in m.named_parameters():
            is_tied = name in tied
            infos.append(data_parallel.ParamInfo(
                name, q, tp_replicated=meta[name].shard is None if name in meta else True,
                tied=is_tied, tied_copy=is_tied and m.last and not m.first, stage=stage))
    return infos

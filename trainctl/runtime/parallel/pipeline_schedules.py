"""Forward/backward over the micro-batches of one optimizer step: a plain accumulation loop (pp=1) or a
pipeline schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble, ZBV) from
torch.distributed.pipelining.

Native pipelining: checked on CPU/gloo against one process at PP=2/4 with every schedule here
(docs/design/checked-facts.md, "Checked facts: PyTorch distributed on CPU/gloo"), and measured as fast as a
hand-written 1F1B on the tiny model (24-27 vs 22-23 ms/step). Its stages infer activation shapes from the
first micro-batch at run time, so sequence-parallel chunks [B, T/tp, H] need no special handling, and loss_fn
may run TP collectives (every TP rank runs the same schedule in lockstep).
DDP is not used with it (it crashes; data_parallel.GradSync does the DP reduction).

Loss scaling: each micro-batch loss is divided by the number of micro-batches inside loss_fn (so
`scale_grads=False`: the schedule never rescales gradients behind the DP hooks' back), which makes the
gradients the mean over this replica's batch; GradSync's pre-division by dp makes them the global mean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

LossFn = Callable[[Tensor, Tensor], Tensor]
BackwardDone = Callable[[int], None]  # this rank's stage module i finished a micro-batch's weight gradients


class Executor(Protocol):
    def run(self, inputs: Tensor, targets: Tensor) -> Tensor | None:
        """inputs/targets [micro_batches, micro_batch, seq]; returns the replica's mean loss (a 0-d tensor)
        on ranks holding the last stage, else None."""


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


class Accumulate:
    """pp=1: forward + backward one micro-batch at a time, gradients accumulating in place."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, micro_batches: int, device: torch.device,
                 autocast_dtype: torch.dtype | None, fsdp: bool, on_backward: BackwardDone = lambda _stage: None):
        self.model = model
        self.on_backward = on_backward
        self.loss_fn = loss_fn
        self.micro_batches = micro_batches
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.fsdp = fsdp

    def run(self, inputs: Tensor, targets: Tensor) -> Tensor:
        total = torch.zeros((), device=self.device)
        for i in range(self.micro_batches):
            if self.fsdp:  # FSDP2: reduce-scatter once, after the last micro-batch's backward
                self.model.set_requires_gradient_sync(i == self.micro_batches - 1)
            with _autocast(self.device, self.autocast_dtype):
                logits = self.model(inputs[i])
                loss = self.loss_fn(logits, targets[i]) / self.micro_batches
            loss.backward()
            self.on_backward(0)
            total += loss.detach()
        return total


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (it is sent to the previous stage as is)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g.contiguous()


def contiguous_boundaries(module: nn.Module, first: bool, last: bool) -> None:
    """Every tensor that crosses a pipeline boundary is contiguous, in both directions.

    torch.distributed.pipelining sends a stage's output and its input's gradient as they are, and allocates
    the peer's receive buffers with the strides of the first micro-batch's output; gloo and NCCL need
    contiguous buffers. The model keeps its activations contiguous (tensor_parallel._batch_major), so these
    hooks cost nothing; they keep a future layer's view from breaking the pipeline. Hooks rather than a
    wrapper module: PipelineStage treats an FSDP-wrapped stage specially by its type."""
    if not first:
        module.register_forward_pre_hook(
            lambda _m, args: tuple(_ContiguousGrad.apply(a) if isinstance(a, Tensor) and a.requires_grad else a
                                   for a in args))
    if not last:
        module.register_forward_hook(lambda _m, _args, out: out.contiguous())


class Pipelined:
    """pp>1: PipelineStage per model stage held by this rank, driven by a native schedule."""

    def __init__(self, modules: list[nn.Module], stage_ids: list[int], n_stages: int, schedule: str,
                 loss_fn: LossFn, micro_batches: int, device: torch.device, pp_group,
                 autocast_dtype: torch.dtype | None, on_backward: BackwardDone = lambda _stage: None):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
        )

        self.micro_batches = micro_batches
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.has_first = 0 in stage_ids
        self.has_last = n_stages - 1 in stage_ids
        for m, s in zip(modules, stage_ids, strict=True):
            contiguous_boundaries(m, first=s == 0, last=s == n_stages - 1)
        stage_cls = _reporting_stage(PipelineStage)
        stages = [stage_cls(m, s, n_stages, device, group=pp_group, on_backward=lambda i=i: on_backward(i))
                  for i, (m, s) in enumerate(zip(modules, stage_ids, strict=True))]

        def scaled_loss(out: Tensor, target: Tensor) -> Tensor:
            return loss_fn(out, target) / micro_batches

        # ZBV maps stage indices to ranks in a V itself (generate_stage_to_rank_mapping(style="v")): this rank's
        # stages must be r and 2*pp-1-r, which plan/pipeline.stages_of_pp_rank gives for schedule "zbv"
        multi = {"interleaved": ScheduleInterleaved1F1B, "zero-bubble": ScheduleInterleavedZeroBubble,
                 "zbv": ScheduleZBVZeroBubble}
        if schedule in multi:
            self.schedule = multi[schedule](stages, micro_batches, loss_fn=scaled_loss, scale_grads=False)
        else:
            if len(stages) != 1:
                raise ValueError(f"schedule {schedule!r} runs one stage per pipeline rank, got {len(stages)}")
            cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
            self.schedule = cls(stages[0], micro_batches, loss_fn=scaled_loss, scale_grads=False)

    def run(self, inputs: Tensor, targets: Tensor) -> Tensor | None:
        # the schedule splits the whole replica batch along dim 0 into equal micro-batches, in order
        args = (inputs.reshape(-1, inputs.shape[-1]).to(self.device),) if self.has_first else ()
        losses: list[Tensor] = []
        kwargs = {"target": targets.reshape(-1, targets.shape[-1]).to(self.device), "losses": losses} \
            if self.has_last else {}
        with _autocast(self.device, self.autocast_dtype):
            self.schedule.step(*args, return_outputs=False, **kwargs)
        if not self.has_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()


def _reporting_stage(base: type) -> type:
    """A PipelineStage that reports when a micro-batch's weight gradients are complete (data_parallel.GradSync
    `backward_done`): after a full backward, or after the weight pass of a split one (zero-bubble schedules,
    whose weight pass assigns `.grad` outside autograd's accumulation, so no gradient hook fires there)."""

    class ReportingStage(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, on_backward: Callable[[], None], **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._on_backward = on_backward

        def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                               last_backward: bool = False):
            out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                             last_backward=last_backward)
            if full_backward:
                self._on_backward()
            return out

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False):
            out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            self._on_backward()
            return out

    return ReportingStage

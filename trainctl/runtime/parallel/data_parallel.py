"""Data parallelism: bucketed gradient reduction overlapped with backward, ZeRO-1/2, FSDP2 for ZeRO-3.

Why the gradient reduction is written by hand instead of DDP: DDP combined with torch.distributed.pipelining
crashes (reducer.cpp internal assert), and composable `replicate()` gives silently wrong losses with TP or PP
(docs/design/checked-facts.md, "Checked facts: PyTorch distributed on CPU/gloo").
A post-accumulate-grad hook per parameter sees each micro-batch's gradient; buckets
(flat runs of parameters in roughly the order backward produces them, never spanning two stage modules,
each padded to a multiple of dp) are reduced asynchronously, strictly in bucket order so every DP rank
issues the same collectives in the same order. This works unchanged under the pipeline schedules.

How a gradient reaches its bucket (docs/design/memory.md, "Memory model"):
- in place (fp32 parameters, ZeRO-0/1): `param.grad` is a view of the bucket's flat fp32 buffer and autograd
  accumulates every micro-batch into it (DDP's gradient_as_bucket_view);
- handed over (bf16 parameters; ZeRO-2): the hook adds the micro-batch's gradient into an fp32 buffer and
  drops it (`param.grad = None`), Megatron's main_grad. Zero-bubble schedules assign weight gradients
  outside autograd's accumulation (pipelining's W pass), where no hook fires: `backward_done` hands those
  over.

When a bucket is reduced:
- ZeRO-0/1: once per step, when every parameter of the bucket has seen all micro-batches (launched then, so
  the reductions overlap the rest of backward): ZeRO-0 all-reduces its full fp32 buffer (a bf16 copy of it
  with grad_reduce_dtype bf16); ZeRO-1 reduce-scatters it instead, in place, since AdamW steps this rank's
  slice only (Megatron's distributed optimizer; half the gradient bytes of an all-reduce: plan/comm.py
  `dp_traffic`). With PowerSGD from its start step on, ZeRO-0 and ZeRO-1 all-reduce the low-rank factors of
  its matrices and the rest uncompressed (runtime/parallel/powersgd.py).
- ZeRO-2: once per micro-batch (DeepSpeed's stage 2): the gradients are added into one of ZERO2_SLOTS
  bucket-sized buffers, which is reduce-scattered into a slice-sized buffer and added into this rank's fp32
  gradient slice; no full-size gradient buffer exists. The executor reports the end of each stage module's
  backward of a micro-batch (`backward_done`), which reduces every bucket of that module not reduced yet in
  this round, so each bucket is reduced exactly once per micro-batch on every DP rank, even when one of its
  parameters got no gradient.

ZeRO-1/2 use Megatron's distributed-optimizer layout: DP rank r owns the r-th slice of every bucket, keeps
the fp32 master and AdamW state of that slice only, and all-gathers the updated slice into the flat
parameter buffer (the parameters are views of it) after the step. Under bf16 compute that buffer is bf16
(plan/memory.py `bf16_params`): the all-gather moves bf16 and the fp32 master is the weights' only fp32 copy.

Optimizer offload (`parallel.offload: optimizer`, ZeRO-1/2): the fp32 master slice and the AdamW moments live in
host memory (pinned on CUDA) and AdamW steps them on the CPU: `before_step` copies this rank's fp32 gradient
slice device -> host after the reduction, clipping and unscaling (which still run on the device), and
`after_step` copies the updated master slice host -> device into the parameter slice before the all-gather.
The host tensors are separate from the device ones even when the device is the CPU, so the CPU-only tests run
the same copies. ZeRO-3 uses FSDP2's CPUOffloadPolicy (`apply_fsdp`).

Tied embedding/LM-head weights on different pipeline ranks get a bucket of their own, so the bucket (and
its dp slices) has the same layout on the first and the last stage; after the DP reduction it is summed
over the placement's `embedding` group (sum commutes with the DP reduction).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainctl.plan.memory import ZERO2_SLOTS, dp_bucket_numel, zero2_slot_numel
from trainctl.runtime.parallel.powersgd import BucketCompression, PowerSGD
from trainctl.runtime.parallel.process_groups import Parallel
from trainctl.runtime.parallel.tensor_parallel import (  # torch's renames, one home
    _all_gather_single,
    _reduce_scatter_single,
)
from trainctl.runtime.train import faults
from trainctl.runtime.train.optim import decays


@dataclass(frozen=True)
class ParamInfo:
    """What the grad-norm needs to count each gradient element exactly once over the whole job."""

    name: str
    param: nn.Parameter
    tp_replicated: bool  # same values on every TP rank: counted on TP rank 0 only
    tied: bool  # a tied embedding/LM-head weight whose grad is summed over the embedding group (pp > 1)
    tied_copy: bool  # the LM head's copy of a tied embedding on the last stage: counted on the first stage
    stage: int = 0  # which of this rank's stage modules holds it (a bucket never spans two)


@dataclass
class Slot:
    """ZeRO-2: one transient bucket-sized buffer and the slice-sized result of its reduce-scatter."""

    buf: Tensor  # the micro-batch's gradients of one bucket, fp32 (zero while free)
    recv: Tensor  # this rank's slice of the reduced bucket (the reduction's dtype)
    comm: Tensor | None  # a bf16 copy of buf on the wire (grad_reduce_dtype bf16)


@dataclass
class Bucket:
    params: list[ParamInfo]
    offsets: list[int]
    numel: int  # padded to a multiple of dp
    tied: bool
    stage: int
    grad: Tensor | None = None  # the full fp32 gradient buffer (ZeRO-0/1; ZeRO-2 has none)
    pending: int = 0
    work: dist.Work | None = None
    shard: tuple[int, int] = (0, 0)
    grad_shard: Tensor | None = None
    param_flat: Tensor | None = None
    master: Tensor | None = None  # fp32, on the host under optimizer offload
    host_grad: Tensor | None = None  # offload: the host copy of grad_shard that AdamW reads
    host_param: Tensor | None = None  # offload with 16-bit parameters: the master rounded on the host, then sent
    step_grads: list[Tensor] = field(default_factory=list)  # per fragment, the gradient AdamW reads
    fragments: list[tuple[ParamInfo, Tensor, Tensor]] = field(default_factory=list)  # (info, master, grad)
    comm: Tensor | None = None  # low-precision copy the DP collective runs on (grad_reduce_dtype bf16)
    slot: Slot | None = None  # ZeRO-2: where this micro-batch's gradients are being added
    reported: int = 0  # ZeRO-2: parameters handed over since the bucket was last reduced
    psgd: BucketCompression | None = None  # PowerSGD's split of the bucket (ZeRO-0/1 with compression)


def sum_tied(grads: list[Tensor], embedding_group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of the tied embedding/LM-head copies in place, so both copies take the same step:
    over the embedding group (first and last stage on two ranks, one copy each), or here when this rank holds
    both copies (ZBV's V placement puts the first and last stage on pipeline rank 0; no group then). The
    copies are sliced alike (same shape, bucket padding and DP shard), so the sum is elementwise."""
    if len(grads) > 1:
        if embedding_group is not None:
            raise RuntimeError("tied copies on one rank and an embedding group: placement owners disagree")
        total = torch.stack(grads).sum(0)
        for g in grads:
            g.copy_(total)
    elif grads and embedding_group is not None:
        dist.all_reduce(grads[0], group=embedding_group)


class GradSync:
    """Per-step DP gradient reduction (zero 0: all-reduce per step; zero 1: reduce-scatter per step; zero 2:
    reduce-scatter per micro-batch) plus the tied sync."""

    def __init__(self, infos: list[ParamInfo], par: Parallel, zero: int, micro_batches: int,
                 bucket_numel: int | None = None, reduce_dtype: torch.dtype | None = None,
                 param_dtype: torch.dtype | None = None, powersgd: tuple[int, int, int] | None = None,
                 offload: bool = False):
        self.par = par
        self.reduce_dtype = reduce_dtype  # None: reduce in the gradients' own dtype (fp32)
        self.dp = par.dp
        self.zero = zero if par.dp > 1 else 0  # one replica: nothing to shard
        # 16-bit parameters need the fp32 master slice that only a sharded optimizer keeps
        self.param_dtype = param_dtype if self.zero in (1, 2) and param_dtype != torch.float32 else None
        self.handover = self.dp > 1 and (self.zero == 2 or self.param_dtype is not None)
        self.offload = offload and self.zero in (1, 2)  # one replica keeps no separate optimizer slice
        self.micro_batches = micro_batches
        self.infos = infos
        p0 = infos[0].param if infos else None
        self.grad_dtype = torch.float64 if p0 is not None and p0.dtype == torch.float64 else torch.float32
        bucket_numel = bucket_numel or dp_bucket_numel()
        # one replica: no DP collective, so no flat buffers either; grads are set to None each step and
        # autograd's first accumulation steals its result (no zeroing, no in-place add: bare-loop speed)
        self.buckets = self._make_buckets(infos, bucket_numel) if self.dp > 1 else []
        # PowerSGD (rank, start step, seed): the once-per-step all-reduce of ZeRO-0/1 only (a spec rule)
        self.powersgd = (PowerSGD(*powersgd, group=par.dp_group, dp=self.dp)
                         if powersgd is not None and self.dp > 1 and self.zero < 2 else None)
        self._compress = False  # this step's reduction is compressed
        if self.powersgd is not None:
            for b in self.buckets:
                assert b.grad is not None
                b.psgd = self.powersgd.bucket([(i.name, b.grad[o:o + i.param.numel()], tuple(i.param.shape))
                                               for i, o in zip(b.params, b.offsets, strict=True)])
        self._where: dict[int, tuple[Bucket, int]] = {}
        self._stage_buckets: dict[int, list[Bucket]] = {}
        for b in self.buckets:
            self._stage_buckets.setdefault(b.stage, []).append(b)
            for info, off in zip(b.params, b.offsets, strict=True):
                self._where[id(info.param)] = (b, off)
        self._counts: dict[int, int] = {}
        self._next = 0
        self._next_in_stage = dict.fromkeys(self._stage_buckets, 0)  # ZeRO-2: the round's next bucket
        self.slots: list[Slot] = []
        self._free: list[Slot] = []
        self._in_flight: deque[tuple[Bucket, Slot, dist.Work]] = deque()
        if self.zero == 2:
            n = zero2_slot_numel(sum(i.param.numel() for i in infos), max(i.param.numel() for i in infos),
                                 self.dp, bucket_numel)
            for _ in range(ZERO2_SLOTS):
                self._add_slot(n)
        if self.dp > 1:
            for info in infos:
                info.param.register_post_accumulate_grad_hook(self._on_grad)

    # -- layout ----------------------------------------------------------------------------------
    def _make_buckets(self, infos: list[ParamInfo], bucket_numel: int) -> list[Bucket]:
        groups: list[tuple[list[ParamInfo], bool]] = []
        current: list[ParamInfo] = []
        size = 0
        for info in reversed(infos):  # roughly the order backward produces gradients
            n = info.param.numel()
            if info.tied:
                groups.append(([info], True))
                continue
            if current and (size + n > bucket_numel or info.stage != current[0].stage):
                groups.append((current, False))
                current, size = [], 0
            current.append(info)
            size += n
        if current:
            groups.append((current, False))
        return [self._bucket(ps, tied) for ps, tied in groups]

    def _bucket(self, infos: list[ParamInfo], tied: bool) -> Bucket:
        offsets, total = [], 0
        for info in infos:
            offsets.append(total)
            total += info.param.numel()
        padded = -(-total // self.dp) * self.dp
        device = infos[0].param.device
        b = Bucket(infos, offsets, padded, tied, infos[0].stage)
        if self.zero < 2:
            b.grad = torch.zeros(padded, dtype=self.grad_dtype, device=device)
            if not self.handover:
                for info, off in zip(infos, offsets, strict=True):
                    # autograd accumulates in place into an existing .grad, so the bucket sees every micro-batch
                    info.param.grad = b.grad[off:off + info.param.numel()].view_as(info.param)
            if self.reduce_dtype is not None and self.reduce_dtype != b.grad.dtype:
                b.comm = torch.empty(padded, dtype=self.reduce_dtype, device=device)
        per = padded // self.dp
        b.shard = (self.par.dp_rank * per, (self.par.dp_rank + 1) * per)
        if self.zero >= 1:
            self._shard_bucket(b)
        return b

    def _shard_bucket(self, b: Bucket) -> None:
        a, e = b.shard
        flat = torch.zeros(b.numel, dtype=b.params[0].param.dtype, device=b.params[0].param.device)
        for info, off in zip(b.params, b.offsets, strict=True):
            flat[off:off + info.param.numel()].copy_(info.param.detach().reshape(-1))
        b.master = flat[a:e].detach().clone().float()  # fp32 master weights of the owned slice
        if self.offload:
            b.master = _host(b.master, pin=flat.is_cuda)
        if self.param_dtype is not None:
            flat = flat.to(self.param_dtype)  # the weights the compute reads; the master is the truth
        for info, off in zip(b.params, b.offsets, strict=True):
            info.param.data = flat[off:off + info.param.numel()].view_as(info.param)  # all-gather writes them
        b.param_flat = flat
        if self.zero == 1:
            assert b.grad is not None
            b.grad_shard = b.grad[a:e]
        else:
            b.grad_shard = torch.zeros(e - a, dtype=self.grad_dtype, device=flat.device)
        step_grad = b.grad_shard
        if self.offload:
            step_grad = b.host_grad = _host(torch.zeros(e - a, dtype=self.grad_dtype), pin=flat.is_cuda)
            if self.param_dtype is not None:
                b.host_param = _host(torch.zeros(e - a, dtype=self.param_dtype), pin=flat.is_cuda)
        for info, off in zip(b.params, b.offsets, strict=True):
            lo, hi = max(off, a), min(off + info.param.numel(), e)
            if lo < hi:
                b.fragments.append((info, b.master[lo - a:hi - a], b.grad_shard[lo - a:hi - a]))
                b.step_grads.append(step_grad[lo - a:hi - a])

    def _add_slot(self, numel: int) -> Slot:
        device = self.infos[0].param.device
        low = self.reduce_dtype is not None and self.reduce_dtype != self.grad_dtype
        slot = Slot(buf=torch.zeros(numel, dtype=self.grad_dtype, device=device),
                    recv=torch.empty(numel // self.dp, dtype=self.reduce_dtype if low else self.grad_dtype,
                                     device=device),
                    comm=torch.empty(numel, dtype=self.reduce_dtype, device=device) if low else None)
        self.slots.append(slot)
        self._free.append(slot)
        return slot

    # -- per step --------------------------------------------------------------------------------
    def start_step(self, step: int = 1) -> None:
        """Before step `step` (1-based): fresh gradient buffers."""
        self._compress = self.powersgd is not None and self.powersgd.active(step)
        if self.dp == 1 or self.handover:
            for info in self.infos:
                info.param.grad = None
        for b in self.buckets:
            if b.grad is not None:
                b.grad.zero_()
            elif b.grad_shard is not None:
                b.grad_shard.zero_()
            b.pending = len(b.params)
            b.work = None
            b.reported = 0
        self._counts = {id(i.param): 0 for i in self.infos}
        self._next = 0
        self._next_in_stage = dict.fromkeys(self._stage_buckets, 0)

    def _on_grad(self, p: Tensor) -> None:
        b, off = self._where[id(p)]
        if self.handover:
            g, p.grad = p.grad, None
            if g is None:
                return
            target = b.grad if self.zero < 2 else self._filling(b)
            assert target is not None
            target[off:off + g.numel()].add_(g.reshape(-1))
        if self.zero == 2:
            b.reported += 1
            if b.reported == len(b.params):
                self._reduce_ready(b.stage)
            return
        key = id(p)
        self._counts[key] += 1
        if self._counts[key] == self.micro_batches:
            b.pending -= 1
            self._launch_ready()

    def backward_done(self, stage: int) -> None:
        """The executor's report that stage module `stage` of this rank finished the backward of a micro-batch:
        hand over gradients that arrived without a hook (pipelining's W pass), and under ZeRO-2 reduce every
        bucket of the module not reduced yet in this round."""
        if self.dp == 1:
            return
        buckets = self._stage_buckets.get(stage, [])
        if self.handover:
            for b in buckets:
                for info in b.params:
                    if info.param.grad is not None:
                        self._on_grad(info.param)
        if self.zero == 2 and buckets:
            for b in buckets[self._next_in_stage[stage]:]:
                self._reduce_micro_batch(b)
            self._next_in_stage[stage] = 0

    # ZeRO-0/1: once per step
    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets) and (force or self.buckets[self._next].pending == 0):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        assert b.grad is not None
        if self._compress and b.psgd is not None:
            # PowerSGD all-reduces even under ZeRO-1: each rank compresses whole matrices (P = M Q needs every
            # row of M, and its error feedback is the whole local matrix), so it needs the full reduced
            # factors, not a slice; it divides what it reduces uncompressed, the factors give the mean
            b.psgd.launch()
            return
        send = self._on_wire(b.grad, b.comm)
        if self.zero == 1:
            # only this rank's slice of the mean is read (by its AdamW slice): reduce-scatter in place, the
            # output being the input's slice at this rank's offset (NCCL's in-place layout; Megatron's
            # distributed optimizer does the same), so no buffer is added
            a, e = b.shard
            b.work = _reduce_scatter_single(send[a:e], send, group=self.par.dp_group, async_op=True)
        else:
            b.work = dist.all_reduce(send, group=self.par.dp_group, async_op=True)

    def _on_wire(self, buf: Tensor, comm: Tensor | None) -> Tensor:
        """What a DP reduction of the gradients `buf` sends: `buf` pre-divided by dp in fp32 (gloo has no AVG; the
        sum of grad/dp is the DP mean), rounded once into `comm` when the reduction runs in a lower dtype."""
        buf.div_(self.dp)
        return comm.copy_(buf) if comm is not None else buf

    # ZeRO-2: once per micro-batch
    def _filling(self, b: Bucket) -> Tensor:
        if b.slot is None:
            b.slot = self._take_slot()
        return b.slot.buf

    def _take_slot(self) -> Slot:
        if self._free:
            return self._free.pop()
        if self._in_flight:  # wait for the oldest reduction: its buffer is the next free one
            self._land_oldest()
            return self._free.pop()
        # every slot is being filled (gradients of more buckets than slots arrived interleaved): one more
        self._add_slot(self.slots[0].buf.numel())
        return self._free.pop()

    def _reduce_ready(self, stage: int) -> None:
        buckets, i = self._stage_buckets[stage], self._next_in_stage[stage]
        while i < len(buckets) and buckets[i].reported == len(buckets[i].params):
            self._reduce_micro_batch(buckets[i])
            i += 1
        self._next_in_stage[stage] = i

    def _reduce_micro_batch(self, b: Bucket) -> None:
        slot = b.slot if b.slot is not None else self._take_slot()  # no gradient this round: zeros
        b.slot, b.reported = None, 0
        n = b.numel
        send = self._on_wire(slot.buf[:n], slot.comm[:n] if slot.comm is not None else None)
        work = _reduce_scatter_single(slot.recv[:n // self.dp], send, group=self.par.dp_group, async_op=True)
        self._in_flight.append((b, slot, work))

    def _land_oldest(self) -> None:
        b, slot, work = self._in_flight.popleft()
        work.wait()
        assert b.grad_shard is not None
        b.grad_shard.add_(slot.recv[:b.numel // self.dp])  # fp32 accumulation over the micro-batches
        slot.buf[:b.numel].zero_()
        self._free.append(slot)

    def finish(self) -> None:
        """Wait for the DP reductions (launching any bucket whose params got no grad) and sum tied grads."""
        if self.dp > 1 and self.zero == 2:
            for stage, buckets in self._stage_buckets.items():  # a round the executor did not close
                if self._next_in_stage[stage] or any(b.slot is not None for b in buckets):
                    self.backward_done(stage)
            while self._in_flight:
                self._land_oldest()
        elif self.dp > 1:
            self._launch_ready(force=True)
            if self._compress:  # every bucket's P is on its way: Q in bucket order, then the approximations
                for b in self.buckets:
                    if b.psgd is not None:
                        b.psgd.finish_p()
                for b in self.buckets:
                    if b.psgd is not None:
                        b.psgd.land()
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
                    if b.comm is None:
                        continue
                    if b.grad_shard is not None:  # ZeRO-1's reduced bf16 slice back into its fp32 slice
                        b.grad_shard.copy_(b.comm[b.shard[0]:b.shard[1]])
                    else:  # ZeRO-0's whole reduced bf16 gradient back into the fp32 buffer
                        assert b.grad is not None
                        b.grad.copy_(b.comm)
        # ZeRO-1/2 hold the reduced gradient in their slice only (the rest of a ZeRO-1 buffer is this rank's own)
        tied = [b.grad_shard if self.zero >= 1 else b.grad for b in self.buckets if b.tied]
        if self.dp == 1:
            tied += [info.param.grad for info in self.infos if info.tied and info.param.grad is not None]
        sum_tied([t for t in tied if t is not None], self.par.embedding_group)

    def reset_compression(self) -> None:
        """A skipped (non-finite) step: PowerSGD's state starts afresh (runtime/parallel/powersgd.py `reset`)."""
        if self.powersgd is not None:
            self.powersgd.reset()

    # -- what the optimizer and the grad norm see --------------------------------------------------
    def norm_pieces(self) -> Iterable[tuple[Tensor, bool]]:
        """(gradient piece, counted in the global norm) covering this rank's share."""
        t0 = self.par.tp_rank == 0
        if self.zero >= 1:
            for b in self.buckets:
                for info, _, g in b.fragments:
                    yield g, (t0 or not info.tp_replicated) and not info.tied_copy
        else:
            owner = self.par.dp_rank == 0  # grads are replicated over dp after the all-reduce
            for info in self.infos:
                if info.param.grad is None:
                    continue
                yield info.param.grad, owner and (t0 or not info.tp_replicated) and not info.tied_copy

    def all_grads(self) -> list[Tensor]:
        """Every gradient tensor the optimizer reads (for clipping)."""
        if self.zero >= 1:
            return [b.grad_shard for b in self.buckets if b.grad_shard is not None]
        if self.dp == 1:
            return [i.param.grad for i in self.infos if i.param.grad is not None]
        return [b.grad for b in self.buckets if b.grad is not None]

    def optimizer_groups(self) -> list[tuple[list[Tensor], bool]]:
        """(tensors, decays) for AdamW: the owned fp32 master fragments (ZeRO) or the parameters."""
        if self.zero >= 1:
            dec, nodec = [], []
            for b in self.buckets:
                for (info, m, _), g in zip(b.fragments, b.step_grads, strict=True):
                    m.grad = g  # the device slice, or its host copy under offload
                    (dec if decays(info.name, info.param) else nodec).append(m)
            return [(dec, True), (nodec, False)]
        return [([i.param for i in self.infos if decays(i.name, i.param)], True),
                ([i.param for i in self.infos if not decays(i.name, i.param)], False)]

    def held(self) -> dict[str, list[Tensor]]:
        """Every buffer this sync keeps, by memory component: the gradient buffers (full buckets, ZeRO
        slices, ZeRO-2's bucket buffers, low-precision reduction copies) and the fp32 master slices (ZeRO)."""
        if self.dp == 1:
            return {"gradients": [i.param.grad for i in self.infos if i.param.grad is not None], "master": [],
                    "host": []}
        grads = [t for b in self.buckets for t in (b.grad, b.grad_shard, b.comm) if t is not None]
        if self.powersgd is not None:
            grads += self.powersgd.buffers()
            grads += [t for b in self.buckets if b.psgd is not None for t in b.psgd.buffers()]
        grads += [t for s in self.slots for t in (s.buf, s.recv, s.comm) if t is not None]
        host = [t for b in self.buckets for t in (b.host_grad, b.host_param) if t is not None]
        return {"gradients": grads, "master": [b.master for b in self.buckets if b.master is not None],
                "host": host}

    def before_step(self) -> None:
        """Offload: this rank's reduced (clipped, unscaled) fp32 gradient slices device -> host for the CPU step."""
        if not self.offload:
            return
        for b in self.buckets:
            assert b.host_grad is not None and b.grad_shard is not None
            b.host_grad.copy_(b.grad_shard, non_blocking=True)
        if self.par.device.type == "cuda":
            torch.cuda.current_stream(self.par.device).synchronize()  # AdamW on the CPU reads them next

    def after_step(self) -> None:
        """ZeRO: write the updated owned slices back into every replica's parameters (rounded to their dtype)."""
        if self.zero == 0:
            return
        if (slow := faults.get_float("slow_gather_s")) > 0:  # test fault: the gather's time counts as DP sync
            time.sleep(slow)
        works = []
        for b in self.buckets:
            assert b.param_flat is not None and b.master is not None
            a, e = b.shard
            src = b.master
            if b.host_param is not None:  # round on the host: the copy moves the parameters' bytes
                src = b.host_param.copy_(b.master)
            # the local slice (the all-gather overwrites it with itself); from pinned host memory under offload
            b.param_flat[a:e].copy_(src, non_blocking=self.offload)
            works.append(_all_gather_single(b.param_flat, b.param_flat[a:e].clone(), group=self.par.dp_group,
                                            async_op=True))
        for w in works:
            w.wait()

    def full_master(self) -> dict[int, Tensor]:
        """The full fp32 weights by id(parameter), gathered from every DP rank's master slice (a collective
        over dp); {} when the parameters are fp32 themselves (then they equal the master)."""
        if self.param_dtype is None:
            return {}
        out: dict[int, Tensor] = {}
        for b in self.buckets:
            assert b.master is not None
            device = self.par.device  # offload keeps the master on the host, where NCCL cannot gather
            full = torch.empty(b.numel, dtype=b.master.dtype, device=device)
            _all_gather_single(full, b.master.to(device), group=self.par.dp_group)
            for info, off in zip(b.params, b.offsets, strict=True):
                out[id(info.param)] = full[off:off + info.param.numel()].view(info.param.shape)
        return out


# ---------------------------------------------------------------------------------------------------------
# ZeRO-3: FSDP2
# ---------------------------------------------------------------------------------------------------------


def apply_fsdp(modules: list[nn.Module], par: Parallel, reduce_dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None,
               offload: bool = False) -> None:
    """fully_shard each transformer block, the ends (below), then the stage root, over this rank's DP group.

    Native FSDP2 here: sharding parameters themselves (gather before use, free after) is what FSDP2 does
    well and checked on CPU/gloo with TP and every PP schedule we use (docs/design/checked-facts.md, "Checked
    facts: PyTorch distributed on CPU/gloo"). DP mesh built from the placement's DP group so its ranks are the
    plan's."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    dp_ranks = par.dp_ranks  # data x context parallel
    mesh = DeviceMesh.from_group(par.dp_group, par.device.type, mesh=torch.tensor(dp_ranks),
                                 mesh_dim_names=("dp",))
    # The sharded parameters stay fp32 (they are the master); under bf16 compute FSDP gathers them in bf16
    # (param_dtype) and reduce-scatters the gradients in fp32 (or bf16 with grad_reduce_dtype), which it
    # also accumulates over micro-batches in fp32. The blocks' inputs keep their dtype (the residual stream
    # is fp32 in every layout: docs/design/memory.md, "Memory model").
    mp = fsdp_policy(reduce_dtype, param_dtype)
    kw = offload_policy(par, offload)
    for m in modules:
        blocks = getattr(m, "layers", None)  # the model keeps its blocks in an nn.ModuleDict
        if blocks is not None:
            for block in blocks.values():
                fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, **kw)
        # The ends as torchtitan wraps them: the embedding a unit of its own, the final norm and LM head another
        # that stays gathered from its forward to its backward (its backward comes next). In the root with the
        # embedding, the head's reduce-scatter waited for the embedding's backward, the last of the step, and
        # the head's gather could not be prefetched behind the blocks. Tied embeddings share the head's weight,
        # which one unit must own: they stay in the root.
        if not m.cfg.tied_embeddings:
            if getattr(m, "embed", None) is not None:
                fully_shard(m.embed, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, **kw)
            if getattr(m, "head", None) is not None:
                fully_shard([m.final_norm, m.head], mesh=mesh, mp_policy=mp, reshard_after_forward=False, **kw)
        fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, **kw)


def offload_policy(par: Parallel, offload: bool) -> dict[str, object]:
    """fully_shard's keyword for optimizer offload: FSDP2's CPUOffloadPolicy keeps the fp32 weight, gradient and
    (through the optimizer) moment shards on the host and steps there. Pinned only on a GPU: pinning needs the
    accelerator (docs/design/trainer.md, "Optimizer offload")."""
    if not offload:
        return {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    return {"offload_policy": CPUOffloadPolicy(pin_memory=par.device.type == "cuda")}


def fsdp_policy(reduce_dtype: torch.dtype | None, param_dtype: torch.dtype | None):
    """FSDP2's mixed-precision policy for the trainer's shards (fp32 master, `apply_fsdp`'s comment)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if param_dtype is None:
        return MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype or torch.float32,
                                cast_forward_inputs=False)


class FsdpSync:
    """The GradSync interface over FSDP2-sharded parameters (FSDP does the DP reduce-scatter itself)."""

    def __init__(self, infos: list[ParamInfo], par: Parallel):
        self.infos = infos
        self.par = par

    def start_step(self, step: int = 1) -> None:
        for info in self.infos:
            info.param.grad = None

    def backward_done(self, stage: int) -> None:
        pass  # FSDP reduces its gradients itself

    def reset_compression(self) -> None:
        pass  # no compression under ZeRO-3 (a spec rule)

    def finish(self) -> None:
        # the tied copies are sharded identically over dp on both stages: sum the local shards
        sum_tied([_local(i.param.grad) for i in self.infos if i.tied and i.param.grad is not None],
                 self.par.embedding_group)

    def norm_pieces(self) -> Iterable[tuple[Tensor, bool]]:
        t0 = self.par.tp_rank == 0
        for info in self.infos:
            if info.param.grad is not None:  # each DP rank owns its shard: counted everywhere
                yield _local(info.param.grad), (t0 or not info.tp_replicated) and not info.tied_copy

    def all_grads(self) -> list[Tensor]:
        return [_local(i.param.grad) for i in self.infos if i.param.grad is not None]

    def optimizer_groups(self) -> list[tuple[list[Tensor], bool]]:
        return [([i.param for i in self.infos if decays(i.name, i.param)], True),
                ([i.param for i in self.infos if not decays(i.name, i.param)], False)]

    def held(self) -> dict[str, list[Tensor]]:
        return {"gradients": [_local(i.param.grad) for i in self.infos if i.param.grad is not None], "master": [],
                "host": []}

    def before_step(self) -> None:
        pass  # under offload FSDP2 already left the gradient shards on the host

    def after_step(self) -> None:
        pass

    def full_master(self) -> dict[int, Tensor]:
        return {}  # the fp32 shards are the parameters


def _host(t: Tensor, pin: bool) -> Tensor:
    """`t` in host memory, pinned when the weights live on a GPU (asynchronous copies; pinning needs the
    accelerator, and a CPU run must not start a CUDA context), always a separate tensor from `t`."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    return out.copy_(t)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t

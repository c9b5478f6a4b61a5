"""Data parallelism: bucketed gradient all-reduce overlapped with backward, ZeRO-1/2, FSDP2 for ZeRO-3.

Why the gradient all-reduce is written by hand instead of DDP: DDP combined with
torch.distributed.pipelining crashes (reducer.cpp internal assert, see the CPU notes), and composable
`replicate()` gives silently wrong losses with TP or PP. A post-accumulate-grad hook per parameter counts
the micro-batch backwards of the step; when a parameter has seen all of them its gradient is final, and
when every parameter of a bucket is final the bucket's collective is launched asynchronously, strictly in
bucket order so every DP rank issues the same collectives in the same order. This works unchanged under
the pipeline schedules (the last micro-batch's backward of each stage completes the buckets).

Gradients live in flat per-bucket buffers (`param.grad` is a view, accumulated in place by autograd, as
DDP's gradient_as_bucket_view does), so a bucket is one collective. Every bucket is padded to a multiple
of dp: for ZeRO-1/2 DP rank r owns the r-th slice of every bucket (Megatron's distributed optimizer
layout), keeps the fp32 master copy and AdamW state of that slice only, and all-gathers the updated slice
into the shared flat parameter buffer (parameters are views of it) after the step. ZeRO-2 reduce-scatters
the bucket instead of all-reducing it, so only the owned slice of the summed gradient exists.

Tied embedding/LM-head weights on different pipeline ranks get a bucket of their own, so the bucket (and
its dp slices) has the same layout on the first and the last stage; after the DP reduction it is summed
over the placement's `embedding` group (sum commutes with the DP reduction).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainctl.runtime.distributed import Parallel
from trainctl.runtime.optim import decays

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

DEFAULT_BUCKET_NUMEL = 4_000_000  # 16 MB of fp32 gradients per collective (DDP's default is 25 MB)


def default_bucket_numel() -> int:
    """Env TRAINCTL_BUCKET_NUMEL overrides (tests use small buckets to exercise overlap and slicing)."""
    return int(os.environ.get("TRAINCTL_BUCKET_NUMEL", DEFAULT_BUCKET_NUMEL))


@dataclass(frozen=True)
class ParamInfo:
    """What the grad-norm needs to count each gradient element exactly once over the whole job."""

    name: str
    param: nn.Parameter
    tp_replicated: bool  # same values on every TP rank: counted on TP rank 0 only
    tied: bool  # a tied embedding/LM-head weight whose grad is summed over the embedding group (pp > 1)
    tied_copy: bool  # the LM head's copy of a tied embedding on the last stage: counted on the first stage


@dataclass
class Bucket:
    params: list[ParamInfo]
    offsets: list[int]
    numel: int  # padded to a multiple of dp
    grad: Tensor
    tied: bool
    pending: int = 0
    work: dist.Work | None = None
    launched: bool = False
    shard: tuple[int, int] = (0, 0)
    grad_shard: Tensor | None = None
    param_flat: Tensor | None = None
    master: Tensor | None = None
    fragments: list[tuple[ParamInfo, Tensor, Tensor]] = field(default_factory=list)  # (info, master, grad)
    comm: Tensor | None = None  # low-precision copy the DP collective runs on (grad_reduce_dtype bf16)
    comm_shard: Tensor | None = None  # ZeRO-2: its reduce-scatter output


class GradSync:
    """Per-step DP gradient reduction (zero 0/1: all-reduce; zero 2: reduce-scatter) plus the tied sync."""

    def __init__(self, infos: list[ParamInfo], par: Parallel, zero: int, micro_batches: int,
                 bucket_numel: int | None = None, reduce_dtype: torch.dtype | None = None):
        self.par = par
        self.reduce_dtype = reduce_dtype  # None: reduce in the gradients' own dtype (fp32)
        self.dp = par.dp
        self.zero = zero if par.dp > 1 else 0  # one replica: nothing to shard
        self.micro_batches = micro_batches
        self.infos = infos
        # one replica: no DP collective, so no flat buffers either; grads are set to None each step and
        # autograd's first accumulation steals its result (no zeroing, no in-place add: bare-loop speed)
        self.buckets = self._make_buckets(infos, bucket_numel or default_bucket_numel()) if self.dp > 1 else []
        self._bucket_of: dict[int, Bucket] = {}
        self._counts: dict[int, int] = {}
        for b in self.buckets:
            for info in b.params:
                self._bucket_of[id(info.param)] = b
        self._next = 0
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
            if current and size + n > bucket_numel:
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
        p0 = infos[0].param
        grad = torch.zeros(padded, dtype=torch.float32 if p0.dtype != torch.float64 else p0.dtype, device=p0.device)
        for info, off in zip(infos, offsets, strict=True):
            # autograd accumulates in place into an existing .grad, so the bucket sees every micro-batch
            info.param.grad = grad[off:off + info.param.numel()].view_as(info.param)
        b = Bucket(infos, offsets, padded, grad, tied)
        per = padded // self.dp
        b.shard = (self.par.dp_rank * per, (self.par.dp_rank + 1) * per)
        if self.zero >= 1:
            self._shard_bucket(b)
        if self.reduce_dtype is not None and self.reduce_dtype != grad.dtype:
            b.comm = torch.empty(padded, dtype=self.reduce_dtype, device=grad.device)
            if self.zero == 2:
                b.comm_shard = torch.empty(per, dtype=self.reduce_dtype, device=grad.device)
        return b

    def _shard_bucket(self, b: Bucket) -> None:
        a, e = b.shard
        flat = torch.zeros(b.numel, dtype=b.params[0].param.dtype, device=b.grad.device)
        for info, off in zip(b.params, b.offsets, strict=True):
            n = info.param.numel()
            flat[off:off + n].copy_(info.param.detach().reshape(-1))
            info.param.data = flat[off:off + n].view_as(info.param)  # all-gather writes the params
        b.param_flat = flat
        b.master = flat[a:e].detach().clone().float()  # fp32 master weights of the owned slice
        b.grad_shard = b.grad[a:e] if self.zero == 1 else torch.zeros(e - a, dtype=b.grad.dtype, device=b.grad.device)
        for info, off in zip(b.params, b.offsets, strict=True):
            lo, hi = max(off, a), min(off + info.param.numel(), e)
            if lo < hi:
                b.fragments.append((info, b.master[lo - a:hi - a], b.grad_shard[lo - a:hi - a]))

    # -- per step --------------------------------------------------------------------------------
    def start_step(self) -> None:
        if self.dp == 1:
            for info in self.infos:
                info.param.grad = None
        for b in self.buckets:
            b.grad.zero_()
            b.pending = len(b.params)
            b.launched = False
            b.work = None
        self._counts = {id(i.param): 0 for i in self.infos}
        self._next = 0

    def _on_grad(self, p: Tensor) -> None:
        key = id(p)
        self._counts[key] += 1
        if self._counts[key] == self.micro_batches:
            self._bucket_of[key].pending -= 1
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets) and (force or self.buckets[self._next].pending == 0):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        b.grad.div_(self.dp)  # pre-divide (in fp32): gloo has no AVG; sum of grad/dp is the DP mean
        send = b.grad
        if b.comm is not None:
            send = b.comm.copy_(b.grad)  # the accumulated fp32 gradient, rounded once for the wire
        if self.zero == 2:
            out = b.comm_shard if b.comm_shard is not None else b.grad_shard
            b.work = _reduce_scatter_single(out, send, group=self.par.dp_group, async_op=True)
        else:
            b.work = dist.all_reduce(send, group=self.par.dp_group, async_op=True)
        b.launched = True

    def _land(self, b: Bucket) -> None:
        """After a low-precision reduction: the result back into the fp32 gradient the optimizer reads."""
        if b.comm_shard is not None:
            b.grad_shard.copy_(b.comm_shard)
        elif b.comm is not None:
            b.grad.copy_(b.comm)

    def finish(self) -> None:
        """Wait for the DP reductions (launching any bucket whose params got no grad) and sum tied grads."""
        if self.dp > 1:
            self._launch_ready(force=True)
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
                    self._land(b)
        if self.par.embedding_group is not None:
            for b in self.buckets:
                if b.tied:
                    t = b.grad_shard if self.zero == 2 else b.grad
                    dist.all_reduce(t, group=self.par.embedding_group)
            if self.dp == 1:
                for info in self.infos:
                    if info.tied and info.param.grad is not None:
                        dist.all_reduce(info.param.grad, group=self.par.embedding_group)

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
            return [b.grad_shard for b in self.buckets]
        if self.dp == 1:
            return [i.param.grad for i in self.infos if i.param.grad is not None]
        return [b.grad for b in self.buckets]

    def optimizer_groups(self) -> list[tuple[list[Tensor], bool]]:
        """(tensors, decays) for AdamW: the owned fp32 master fragments (ZeRO) or the parameters."""
        if self.zero >= 1:
            dec, nodec = [], []
            for b in self.buckets:
                for info, m, g in b.fragments:
                    m.grad = g
                    (dec if decays(info.name, info.param) else nodec).append(m)
            return [(dec, True), (nodec, False)]
        return [([i.param for i in self.infos if decays(i.name, i.param)], True),
                ([i.param for i in self.infos if not decays(i.name, i.param)], False)]

    def held(self) -> dict[str, list[Tensor]]:
        """Every buffer this sync keeps, by memory component: the gradient buffers (full buckets, ZeRO
        shards, low-precision reduction copies) and the optimizer's fp32 master slices (ZeRO)."""
        if self.dp == 1:
            return {"gradients": [i.param.grad for i in self.infos if i.param.grad is not None], "master": []}
        grads = [t for b in self.buckets for t in (b.grad, b.grad_shard, b.comm, b.comm_shard) if t is not None]
        return {"gradients": grads, "master": [b.master for b in self.buckets if b.master is not None]}

    def after_step(self) -> None:
        """ZeRO: write the updated owned slices back into every replica's parameters."""
        if self.zero == 0:
            return
        works = []
        for b in self.buckets:
            a, e = b.shard
            b.param_flat[a:e].copy_(b.master)  # the local slice (the all-gather overwrites it with itself)
            works.append(_all_gather_single(b.param_flat, b.param_flat[a:e].clone(), group=self.par.dp_group,
                                            async_op=True))
        for w in works:
            w.wait()


# ---------------------------------------------------------------------------------------------------------
# ZeRO-3: FSDP2
# ---------------------------------------------------------------------------------------------------------


def apply_fsdp(modules: list[nn.Module], par: Parallel, reduce_dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True) -> None:
    """fully_shard each transformer block, then the stage root, over this rank's DP group.

    Native FSDP2 here: sharding parameters themselves (gather before use, free after) is what FSDP2 does
    well and checked on CPU/gloo with TP and every PP schedule we use (docs/ARCHITECTURE.md, "Checked
    facts"). DP mesh built from the placement's DP group so its ranks are the plan's."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp_ranks = par.dp_ranks  # data x context parallel
    mesh = DeviceMesh.from_group(par.dp_group, par.device.type, mesh=torch.tensor(dp_ranks),
                                 mesh_dim_names=("dp",))
    # parameters stay fp32 (autocast does the compute casts); only the gradient reduce-scatter may be bf16
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for m in modules:
        blocks = getattr(m, "layers", None)  # the model keeps its blocks in an nn.ModuleDict
        if blocks is not None:
            for block in blocks.values():
                fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


class FsdpSync:
    """The GradSync interface over FSDP2-sharded parameters (FSDP does the DP reduce-scatter itself)."""

    def __init__(self, infos: list[ParamInfo], par: Parallel):
        self.infos = infos
        self.par = par

    def start_step(self) -> None:
        for info in self.infos:
            info.param.grad = None

    def finish(self) -> None:
        # the tied copies are sharded identically over dp on both stages: sum the local shards
        if self.par.embedding_group is not None:
            for info in self.infos:
                if info.tied and info.param.grad is not None:
                    dist.all_reduce(_local(info.param.grad), group=self.par.embedding_group)

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
        return {"gradients": [_local(i.param.grad) for i in self.infos if i.param.grad is not None], "master": []}

    def after_step(self) -> None:
        pass


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t

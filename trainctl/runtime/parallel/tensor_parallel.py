"""Megatron-style tensor parallelism written by hand (Shoeybi et al. 2019; Korthikanti et al. 2022 for SP).

Why hand-written and not DTensor: DTensor's per-op dispatch costs more than the collectives save on the
models a CPU can train. Measured side by side at TP=2 on this 2-core machine (bench/bench_tp.py, fp32,
forward+backward), DTensor `parallelize_module` + `loss_parallel` takes 2.2-2.4x the time of this path on
the tiny test model (hidden 64) and 1.3-1.4x at hidden 256-512; on large GPU matmuls the gap should close,
so measure before switching. The math is the same, and DTensor stays the checked reference: an unfused
DTensor model (tests/dist/dtensor_ref_worker.py) loaded with the same weights gives the same loss and gradients
as this path to ~1e-16 in fp64, with and without SP (tests/dist/test_tp_dtensor_reference.py); both also equal
one process (tests/dist/test_tensor_parallel.py). The fused QKV / gate-up weights are split per part over TP,
which a plain DTensor Shard(0) does not express; that is why the reference is unfused.

The four conjugate communication functions (activations are [B, T, H]; the sequence dim is 1):

    copy_to_tp_region        identity fwd        / all-reduce bwd        ("f" in the paper)
    reduce_from_tp_region    all-reduce fwd      / identity bwd          ("g")
    gather_from_sp_region    all-gather(T) fwd   / reduce-scatter(T) bwd (sequence parallel "g")
    reduce_scatter_to_sp     reduce-scatter(T)   / all-gather(T) bwd     (sequence parallel "g-bar")
    scatter_to_sp_region     split(T) fwd        / all-gather(T) bwd

Layers:
    ColumnParallelLinear   weight [out/tp, in]: input replicated (or sequence-sharded and gathered with SP,
                           keeping only the shard for backward), output sharded on the last dim; never
                           gathers its output.
    RowParallelLinear      weight [out, in/tp]: input sharded on the last dim; output all-reduced
                           (or reduce-scattered along T with SP); bias added after the reduction.
                           `reduce_output=False` returns the partial sum without the bias (the MoE block
                           reduces all its experts' outputs at once).
    VocabParallelEmbedding weight [V_padded/tp, H]: each rank looks up the ids in its vocab range.
    vocab_parallel_cross_entropy: softmax cross-entropy over vocab-sharded logits with three small
                           all-reduces ([B, T] max, sum-exp and target logit); padded columns are masked.

Every parameter carries `ParamMeta` (its full shape, how it is sharded, how it is initialised) so that
init (trainctl.runtime.model.init) and checkpoint resharding can go between the full tensor and a rank's shard.

Sequence-parallel parameters (norm weights/biases, row-parallel biases under SP) see only this rank's
sequence chunk, so their gradients are partial sums over the TP group. By default the sum happens inside
autograd (a `copy_to_tp_region` on the parameter: one small all-reduce per parameter per backward), which
is correct with no help from the engine. An engine that prefers one flattened all-reduce per optimizer step
builds its TPContext with `defer_sp_grad_sync=True` and calls `sync_sequence_parallel_grads(module, tp)`
after the last backward of the step (before grad clipping).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from trainctl.runtime.model import fp8 as fp8_gemms
from trainctl.runtime.model.fp8 import Fp8Recipe
from trainctl.runtime.parallel.comm_wait import COMM  # time in TP collectives (straggler detection)

SEQ_DIM = 1  # activations are [batch, seq, hidden]


@dataclass(frozen=True)
class TPContext:
    """The tensor-parallel group of this rank. `group` None or `size` 1 means no tensor parallelism."""

    group: Any  # torch.distributed.ProcessGroup | None
    size: int
    rank: int
    sequence_parallel: bool
    # Additive to the agreed interface: see the module docstring (sequence-parallel grad sync).
    defer_sp_grad_sync: bool = False

    @staticmethod
    def single() -> TPContext:
        return TPContext(None, 1, 0, False)

    @staticmethod
    def from_group(group: Any, sequence_parallel: bool = False, defer_sp_grad_sync: bool = False) -> TPContext:
        size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        return TPContext(group, size, rank, sequence_parallel and size > 1, defer_sp_grad_sync)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (only meaningful with more than one TP rank)."""
        return self.sequence_parallel and self.size > 1


# ---------------------------------------------------------------------------------------------------------
# Parameter metadata: full shape, TP sharding, init
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardSpec:
    """How a full tensor maps to TP shards.

    The full tensor's `dim` is a concatenation of `parts` (e.g. fused QKV: q, k, v rows); every part is
    split evenly over the TP ranks and rank r's shard is the concatenation of the r-th piece of each part.
    `logical` is the unpadded size along `dim` for vocab-padded tensors (rows beyond it are padding, zeros).
    """

    dim: int
    parts: tuple[int, ...]
    logical: int | None = None

    @property
    def padded(self) -> int:
        return sum(self.parts)

    def for_tp(self, size: int) -> ShardSpec:
        """The same tensor's spec at another TP size: only the vocab padding (a multiple of tp) changes."""
        if self.logical is None:
            return self
        if len(self.parts) != 1:
            raise ValueError("a padded tensor has one part")
        return ShardSpec(self.dim, (-(-self.logical // size) * size,), self.logical)

    def local_shape(self, full_shape: tuple[int, ...], size: int) -> tuple[int, ...]:
        """The shape of one of `size` shards of a tensor whose logical full shape is `full_shape`."""
        shape = list(full_shape)
        shape[self.dim] = self.padded // size
        return tuple(shape)


@dataclass(frozen=True)
class ParamMeta:
    full_shape: tuple[int, ...]  # logical full shape (vocab unpadded)
    shard: ShardSpec | None  # None: replicated over the TP group
    init: str  # "normal" | "ones" | "zeros"
    std: float = 0.0
    sequence_parallel: bool = False  # grad is a partial sum over TP ranks (see module docstring)


def shard_tensor(full: Tensor, spec: ShardSpec | None, rank: int, size: int) -> Tensor:
    """This rank's shard of a full (logical, unpadded) tensor."""
    if spec is None:
        return full
    if spec.logical is not None and full.shape[spec.dim] < spec.padded:
        pad_shape = list(full.shape)
        pad_shape[spec.dim] = spec.padded - full.shape[spec.dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=spec.dim)
    pieces = []
    for part in full.split(list(spec.parts), dim=spec.dim):
        if part.shape[spec.dim] % size:
            raise ValueError(f"cannot split size {part.shape[spec.dim]} over {size} tensor-parallel ranks")
        pieces.append(part.chunk(size, dim=spec.dim)[rank])
    return torch.cat(pieces, dim=spec.dim).contiguous()


def unshard_tensors(shards: list[Tensor], spec: ShardSpec | None) -> Tensor:
    """The full (logical, unpadded) tensor from every rank's shard, in TP-rank order."""
    if spec is None:
        return shards[0]
    size = len(shards)
    local_parts = [p // size for p in spec.parts]
    split = [s.split(local_parts, dim=spec.dim) for s in shards]
    full = torch.cat([torch.cat([split[r][i] for r in range(size)], dim=spec.dim)
                      for i in range(len(spec.parts))], dim=spec.dim)
    if spec.logical is not None:
        full = full.narrow(spec.dim, 0, spec.logical)
    return full


# ---------------------------------------------------------------------------------------------------------
# Collectives (gloo and NCCL; torch >= 2.13 renames the *_into_tensor / *_tensor variants)
# ---------------------------------------------------------------------------------------------------------

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_reduce(x: Tensor, tp: TPContext) -> Tensor:
    x = x.contiguous()
    with COMM:
        dist.all_reduce(x, group=tp.group)
    return x


def _all_gather_seq(x: Tensor, tp: TPContext) -> Tensor:
    """[B, T/tp, ...] on each rank -> [B, T, ...]."""
    x0 = x.movedim(SEQ_DIM, 0).contiguous()
    out = x0.new_empty((tp.size * x0.shape[0], *x0.shape[1:]))
    with COMM:
        _all_gather_single(out, x0, group=tp.group)
    return _batch_major(out)


def _reduce_scatter_seq(x: Tensor, tp: TPContext) -> Tensor:
    """[B, T, ...] partial sums on each rank -> this rank's [B, T/tp, ...] of the sum."""
    x0 = x.movedim(SEQ_DIM, 0).contiguous()
    if x0.shape[0] % tp.size:
        raise ValueError(f"sequence length {x0.shape[0]} is not divisible by tp={tp.size} (sequence parallel)")
    out = x0.new_empty((x0.shape[0] // tp.size, *x0.shape[1:]))
    with COMM:
        _reduce_scatter_single(out, x0, group=tp.group)
    return _batch_major(out)


def _batch_major(seq_major: Tensor) -> Tensor:
    """[T', B, ...] collective output -> a contiguous [B, T', ...] tensor.

    Returning `movedim(0, SEQ_DIM)` alone would hand out a view whose memory is sequence-major (strides
    (H, B*H, 1)): contiguous at B = 1 but not at B >= 2. Elementwise ops keep their inputs' layout, so
    that layout would spread along the residual stream to the stage output, and torch.distributed.pipelining
    allocates its receive buffers with the output's strides (gloo and NCCL refuse non-contiguous buffers;
    docs/design/trainer.md, "Activation layout"). Every activation is batch-major and contiguous."""
    return seq_major.movedim(0, SEQ_DIM).contiguous()


def _split_seq(x: Tensor, tp: TPContext) -> Tensor:
    if x.shape[SEQ_DIM] % tp.size:
        raise ValueError(f"sequence length {x.shape[SEQ_DIM]} is not divisible by tp={tp.size} (sequence parallel)")
    return x.chunk(tp.size, dim=SEQ_DIM)[tp.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        # autograd may hand the same grad tensor to several branches (e.g. a residual add): never reduce in place
        return _all_reduce(g.clone(), ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        # in place on our own fresh matmul/embedding output (as Megatron does); copy views to be safe
        return _all_reduce(x.clone() if x._base is not None else x, tp)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _all_gather_seq(x, tp)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_seq(g, ctx.tp), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_seq(g, ctx.tp), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _split_seq(x, tp)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_seq(g, ctx.tp), None


class _SequenceParallelLinear(torch.autograd.Function):
    """y = all-gather_T(x) W^T + b keeping only the sequence-sharded x for backward (Korthikanti et al. 2022,
    Sec. 4.2.2; Megatron's LinearWithGradAccumulationAndAsyncCommunication): backward all-gathers x again for
    the weight gradient and reduce-scatters the input gradient. Saving the gathered input instead would keep
    tp times the bytes on every rank.

    Under autocast the input is cast to the compute dtype before the gather (the same values as casting
    after it; half the bytes on the wire and saved), the weight is cast again in backward rather than kept,
    and the input gradient is reduce-scattered in the input's dtype (an fp32 sum, as before the change), so
    the ops, and hence the results, are those autograd would run for a gather and an autocast F.linear.
    Under a zero-bubble schedule the weight pass re-runs this backward whole (torch.distributed.pipelining
    splits at autograd nodes): correct, at the cost of a second all-gather and input gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp, fp8):
        dtype, ctx.in_dtype = compute_dtype(x), x.dtype
        x = x.to(dtype)
        full = _all_gather_seq(x, tp)
        with torch.autocast(x.device.type, enabled=False):
            y = _linear_forward(full, weight, bias, dtype, fp8)
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.has_bias, ctx.fp8 = tp, bias is not None, fp8
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        full = _all_gather_seq(x, ctx.tp)
        grad_full, grad_w, grad_b = _linear_backward(ctx, g, full, weight)
        grad_x = _reduce_scatter_seq(grad_full, ctx.tp) if grad_full is not None else None
        return grad_x, grad_w, grad_b, None, None


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T + b with its three GEMMs in FP8 (runtime/model/fp8.py); it keeps for backward what autocast's
    F.linear keeps (the input in the compute dtype, the weight itself) and returns gradients in the same dtypes."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8):
        dtype, ctx.in_dtype = compute_dtype(x), x.dtype
        x = x.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            y = _linear_forward(x, weight, bias, dtype, fp8)
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.fp8 = bias is not None, fp8
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        return *_linear_backward(ctx, g, x, weight), None


def _linear_forward(x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype,
                    fp8: Fp8Recipe | None) -> Tensor:
    """x W^T + b in `dtype` (autocast off): F.linear, or the FP8 forward GEMM under a recipe."""
    if fp8 is None:
        return F.linear(x, weight.to(dtype), bias.to(dtype) if bias is not None else None)
    y = fp8_gemms.forward_gemm(x.reshape(-1, x.shape[-1]), weight, fp8, dtype).view(*x.shape[:-1], weight.shape[0])
    return y + bias.to(dtype) if bias is not None else y


def _linear_backward(ctx: Any, g: Tensor, x: Tensor, weight: Tensor
                     ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(input, weight, bias) gradients of `_linear_forward` for output gradient g and input x, each where
    ctx.needs_input_grad asks; the input gradient in ctx.in_dtype, the others in the weight's dtype."""
    g2d, x2d = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    fp8, need = ctx.fp8, ctx.needs_input_grad
    grad_x = grad_w = grad_b = None
    if need[0]:
        gx = g2d.mm(weight.to(g.dtype)) if fp8 is None else fp8_gemms.grad_input_gemm(g2d, weight, fp8, g.dtype)
        grad_x = gx.view(x.shape).to(ctx.in_dtype)
    if need[1]:
        gw = g2d.t().mm(x2d) if fp8 is None else fp8_gemms.grad_weight_gemm(g2d, x2d, fp8, g.dtype)
        grad_w = gw.to(weight.dtype)
    if ctx.has_bias and need[2]:
        grad_b = g2d.sum(0).to(weight.dtype)
    return grad_x, grad_w, grad_b


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype x's matmuls compute in: autocast's where it is on, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, fp8: Fp8Recipe | None = None) -> Tensor:
    """F.linear, or its FP8 version under a recipe (`_Fp8Linear`)."""
    return F.linear(x, weight, bias) if fp8 is None else _Fp8Linear.apply(x, weight, bias, fp8)


def column_parallel_linear(x: Tensor, weight: Tensor, bias: Tensor | None, tp: TPContext,
                           fp8: Fp8Recipe | None = None) -> Tensor:
    """A column-parallel matmul: x replicated [B, T, in], or this rank's [B, T/tp, in] under SP (gathered
    along T here, and only the shard kept for backward: `_SequenceParallelLinear`); out [B, T, out/tp]."""
    if tp.sp:
        return _SequenceParallelLinear.apply(x, weight, bias, tp, fp8)
    return linear(copy_to_tp_region(x, tp), weight, bias, fp8)


def copy_to_tp_region(x: Tensor, tp: TPContext) -> Tensor:
    return _CopyToTP.apply(x, tp) if tp.enabled else x


def reduce_from_tp_region(x: Tensor, tp: TPContext) -> Tensor:
    return _ReduceFromTP.apply(x, tp) if tp.enabled else x


def gather_from_sp_region(x: Tensor, tp: TPContext) -> Tensor:
    return _GatherFromSP.apply(x, tp) if tp.enabled else x


def reduce_scatter_to_sp_region(x: Tensor, tp: TPContext) -> Tensor:
    return _ReduceScatterToSP.apply(x, tp) if tp.enabled else x


def scatter_to_sp_region(x: Tensor, tp: TPContext) -> Tensor:
    return _ScatterToSP.apply(x, tp) if tp.enabled else x


def sp_param(p: Tensor, tp: TPContext) -> Tensor:
    """A sequence-parallel parameter as used in forward: its grad is summed over the TP group in backward,
    unless the engine defers that to `sync_sequence_parallel_grads`."""
    if tp.sp and not tp.defer_sp_grad_sync:
        return _CopyToTP.apply(p, tp)
    return p


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    out = []
    for m in module.modules():
        metas: dict[str, ParamMeta] = getattr(m, "param_meta", {})
        for pname, meta in metas.items():
            p = getattr(m, pname, None)
            if meta.sequence_parallel and isinstance(p, nn.Parameter):
                out.append(p)
    return out


def sync_sequence_parallel_grads(module: nn.Module, tp: TPContext) -> None:
    """Sum the partial grads of sequence-parallel parameters over the TP group with one flattened
    all-reduce. Only needed (and only does anything) when `tp.defer_sp_grad_sync` is set."""
    if not (tp.sp and tp.defer_sp_grad_sync):
        return
    grads = [p.grad for p in sequence_parallel_params(module) if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp.group)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


# ---------------------------------------------------------------------------------------------------------
# Dropout with TP-aware randomness
# ---------------------------------------------------------------------------------------------------------


def _mix_seed(a: int, b: int) -> int:
    h = hashlib.blake2b(f"{a}/{b}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class tp_rng_fork:
    """Context manager: run the body with an RNG stream that differs across TP ranks (Megatron's
    'model-parallel RNG'), derived from the default stream.

    The default RNG must be identical on every rank of a TP group (the engine seeds it that way). Inside the
    TP region, where activations are sharded (attention heads, or the sequence chunk under SP), dropout
    masks must differ across TP ranks; outside it, where activations are replicated, they must be equal -
    that is what the default stream gives. Instead of keeping a separate tracked generator state (Megatron's
    CudaRNGStatesTracker, which needs its own checkpoint function), we draw one 63-bit seed from the default
    CPU stream (identical on all TP ranks), mix it with the TP rank and run the body under that seed,
    restoring the default streams afterwards. Because the draw comes from the default stream,
    torch.utils.checkpoint(preserve_rng_state=True) replays it exactly in recompute, so recomputed dropout
    masks equal the original ones with no extra machinery.
    """

    def __init__(self, tp: TPContext, device: torch.device):
        self.tp = tp
        self.device = device
        self._fork = None

    def __enter__(self):
        if not self.tp.enabled:
            return self
        base = int(torch.randint(0, 2**62, (1,)).item())  # advances the default CPU stream identically
        devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
            if self.device.type == "cuda" else []
        self._fork = torch.random.fork_rng(devices=devices, device_type="cuda")
        self._fork.__enter__()
        seed = _mix_seed(base, self.tp.rank)
        torch.manual_seed(seed)  # seeds the CPU and the CUDA streams; restored on exit
        return self

    def __exit__(self, *exc):
        if self._fork is not None:
            self._fork.__exit__(*exc)
            self._fork = None
        return False


def tp_dropout(x: Tensor, p: float, training: bool, tp: TPContext, sharded: bool) -> Tensor:
    """Dropout; `sharded` says whether x differs across TP ranks (then masks must differ too)."""
    if not training or p == 0.0:
        return x
    if sharded and tp.enabled:
        with tp_rng_fork(tp, x.device):
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


# ---------------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------------


def _check_div(n: int, size: int, what: str) -> int:
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {size}")
    return n // size


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by output rows. Input: replicated [B, T, in] (or [B, T/tp, in] under SP,
    all-gathered along T here); output: this rank's [B, T, out/tp] (never gathered).

    `parts` lists fused sub-matrices along the output dim (e.g. q, k, v) that are each split over TP."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, bias: bool = False,
                 parts: Iterable[int] | None = None, std: float = 0.02, logical_out: int | None = None,
                 gather_input: bool = True):
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features  # full (padded) output size
        parts = tuple(parts) if parts is not None else (out_features,)
        if sum(parts) != out_features:
            raise ValueError(f"parts {parts} do not add up to {out_features}")
        for p in parts:
            _check_div(p, tp.size, "output features")
        self.local_out = out_features // tp.size
        self.gather_input = gather_input
        self.fp8: Fp8Recipe | None = None  # set by fp8.convert (train.precision fp8)
        spec = ShardSpec(0, parts, logical_out)
        full_out = logical_out if logical_out is not None else out_features
        self.weight = nn.Parameter(torch.empty(self.local_out, in_features))
        self.param_meta = {"weight": ParamMeta((full_out, in_features), spec, "normal", std)}
        if bias:
            self.bias = nn.Parameter(torch.empty(self.local_out))
            self.param_meta["bias"] = ParamMeta((full_out,), ShardSpec(0, parts, logical_out), "zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        if self.gather_input:
            return column_parallel_linear(x, self.weight, self.bias, self.tp, self.fp8)
        return linear(x, self.weight, self.bias, self.fp8)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by input columns. Input: this rank's [B, T, in/tp]; output: the full
    [B, T, out] all-reduced (or this rank's [B, T/tp, out] reduce-scattered along T under SP)."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, bias: bool = False,
                 std: float = 0.02, reduce_output: bool = True):
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.reduce_output = reduce_output
        self.fp8: Fp8Recipe | None = None  # set by fp8.convert (train.precision fp8)
        self.local_in = _check_div(in_features, tp.size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in))
        self.param_meta = {"weight": ParamMeta((out_features, in_features), ShardSpec(1, (in_features,)),
                                               "normal", std)}
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            self.param_meta["bias"] = ParamMeta((out_features,), None, "zeros", sequence_parallel=tp.sp)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        y = linear(x, self.weight, None, self.fp8)
        if not self.reduce_output:  # the caller reduces (and adds the bias): routed experts, runtime/model/moe.py
            return y
        y = reduce_scatter_to_sp_region(y, self.tp) if self.tp.sp else reduce_from_tp_region(y, self.tp)
        if self.bias is not None:
            y = y + sp_param(self.bias, self.tp).to(y.dtype)  # an fp32 bias would promote a bf16 stream to fp32
        return y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocab split over TP ranks: [V_padded/tp, H] per rank.

    Each rank looks up the ids in its range and zeroes the rest; the partial results are summed over the
    TP group: all-reduced (replicated [B, T, H] out) or, with `scatter_output` under SP, reduce-scattered
    along T ([B, T/tp, H] out)."""

    def __init__(self, vocab_size: int, padded_vocab: int, dim: int, tp: TPContext, std: float = 0.02,
                 scatter_output: bool = False):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.padded_vocab = padded_vocab
        self.local_vocab = _check_div(padded_vocab, tp.size, "padded vocab")
        self.start = tp.rank * self.local_vocab
        self.scatter_output = scatter_output and tp.sp
        self.weight = nn.Parameter(torch.empty(self.local_vocab, dim))
        self.param_meta = {"weight": ParamMeta((vocab_size, dim), ShardSpec(0, (padded_vocab,), vocab_size),
                                               "normal", std)}

    def forward(self, ids: Tensor) -> Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        local = local.masked_fill(outside, 0)
        out = F.embedding(local, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.scatter_output:
            return reduce_scatter_to_sp_region(out, self.tp)
        return reduce_from_tp_region(out, self.tp)


# ---------------------------------------------------------------------------------------------------------
# Vocab-parallel cross-entropy
# ---------------------------------------------------------------------------------------------------------


class _VocabParallelCE(torch.autograd.Function):
    """Mean softmax cross-entropy over vocab-sharded logits (Megatron's _VocabParallelCrossEntropy).

    Only shard-sized tensors ([N, V_padded/tp]) and [N] vectors exist on a rank; columns at or beyond
    `vocab_size` (padding) are masked out of the softmax, so the loss does not depend on tp."""

    @staticmethod
    def forward(ctx, logits, targets, tp, vocab_size):
        local_v = logits.shape[-1]
        start = tp.rank * local_v
        x = logits.reshape(-1, local_v)
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()  # softmax statistics in fp32
        t = targets.reshape(-1)
        n_tokens = t.numel()
        n_valid_local = max(0, min(local_v, vocab_size - start))  # unpadded columns held here
        if n_valid_local == 0:  # a rank holding only padding (tiny vocab, large tp)
            local_max = torch.full((x.shape[0],), -math.inf, dtype=x.dtype, device=x.device)
        else:
            local_max = x[:, :n_valid_local].max(dim=-1).values
        gmax = local_max
        if tp.enabled:
            with COMM:
                dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=tp.group)
        e = x - gmax.unsqueeze(-1)  # a fresh buffer: the caller's logits are never written
        if n_valid_local < local_v:
            e[:, n_valid_local:] = -math.inf  # padded vocab columns: exp() = 0, out of the softmax
        local_t = t - start
        in_range = (local_t >= 0) & (local_t < local_v)
        local_t = local_t.masked_fill(~in_range, 0)
        pred = e.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~in_range, 0.0)
        e.exp_()  # padded columns: exp(-inf) = 0
        sum_exp = e.sum(dim=-1)
        if tp.enabled:
            both = torch.stack([pred, sum_exp])
            with COMM:
                dist.all_reduce(both, group=tp.group)
            pred, sum_exp = both[0], both[1]
        loss = torch.log(sum_exp) - pred  # per token
        e.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(e, local_t, in_range)
        ctx.n_tokens = n_tokens
        ctx.shape = logits.shape
        ctx.dtype = logits.dtype
        return loss.mean()  # fp32 for half-precision logits, else the logits' dtype

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, in_range = ctx.saved_tensors
        grad = softmax  # reused in place (backward runs once)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= in_range.to(grad.dtype)
        grad.mul_(g.to(grad.dtype) / ctx.n_tokens)
        return grad.view(ctx.shape).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits_shard: Tensor, targets: Tensor, tp: TPContext, vocab_size: int) -> Tensor:
    """Mean cross-entropy over all tokens; logits_shard [..., V_padded/tp], targets [...] int64 in [0, vocab).

    Never all-gathers the full-vocab logits. Backward may be run once (it reuses the saved softmax)."""
    return _VocabParallelCE.apply(logits_shard, targets, tp, vocab_size)


def enable_fp8(module: nn.Module, recipe: Fp8Recipe) -> int:
    """Run the GEMMs of `module`'s linear layers in FP8 (train.precision fp8): the attention projections and
    the MLPs, shared and routed experts included, column- and row-parallel alike. The LM head stays in the base
    precision (its logits feed the loss directly, and the vocabulary's rare rows have tiny amax; torchtitan and
    Megatron keep it in bf16 too), and so do the embeddings and the MoE router, which are not linear layers
    here. Returns the number of layers converted."""
    n = 0
    for name, m in module.named_modules():
        if isinstance(m, ColumnParallelLinear | RowParallelLinear) and name.rsplit(".", 1)[-1] != "head":
            m.fp8 = recipe
            n += 1
    return n

"""The mixture-of-experts MLP of an MoE layer (docs/design/trainer.md, "MoE block").

One forward, for this rank's tokens x [B, T', H] (T' = T/tp under sequence parallelism, else T):

1. Router: fp32 logits = x W_g^T (W_g [E, H], replicated over TP and EP), then top_k experts per token:
   `topk_softmax` (Mixtral): softmax over the top_k logits (= softmax over all, top_k, renormalised);
   `softmax_topk` (OLMoE, Qwen-MoE): softmax over all experts, the top_k probabilities as they are.
2. Capacity (only with `capacity_factor`): each expert takes at most C = ceil(cf * T * top_k / E) of a
   sequence's assignments, first choices before second choices, earlier tokens first (GShard's priority);
   the others are dropped (the token keeps its residual and its other experts) and counted. Per sequence,
   so the same tokens are dropped in every layout (under SP the ranks of a TP group gather the choices).
3. Dispatch: the kept assignments sorted by expert (top_k copies of a token), their counts exchanged, then
   one all-to-all with uneven splits over the EP group (dropless: every assignment travels).
4. TP region: under SP the received tokens are all-gathered over the TP group (uneven sizes), so each TP
   rank runs every received token through its shard of each expert, and the partial outputs are
   reduce-scattered back (Megatron-Core's alltoall dispatcher: all-to-all over EP, then all-gather over
   TP). Without SP every TP rank already holds all tokens: identity in / all-reduce out, as the dense MLP.
5. Experts: this EP rank's num_experts/ep experts (dense MLPs of expert_ffn_hidden, split over TP, named
   by global expert index), each on its contiguous slice; fc2's bias is added after the TP reduction.
6. Combine: the reverse all-to-all, each output weighted by its routing weight and summed per token; the
   shared experts (one dense MLP, shared_experts x shared_ffn_hidden wide) are added.

Auxiliary losses, per sequence (each sequence is whole in every layout, so the loss does not depend on the
layout or the micro-batch size; the form of DeepSeek-V3's sequence-wise balance loss), then averaged over
sequences like the LM loss:
  balance = E * sum_i f_i * P_i   (Switch / GShard), f_i = assignments to expert i / (T * top_k) (before
            capacity), P_i = mean over the sequence's tokens of the softmax over all experts; 1 when even.
  z       = mean over the sequence's tokens of logsumexp(logits)^2 (ST-MoE, Zoph et al. 2022).
Their coefficients times the mean over the micro-batch's sequences enter backward through `_AttachLoss`,
scaled as the LM loss of a micro-batch is (loss scale / micro-batches), so the gradient is the global mean
over sequences after the data-parallel reduction, whatever the layout. Under SP each TP rank holds a
chunk of every sequence: the counts f are summed over the TP group first, P is the rank's partial sum,
and the partial losses add up over the group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from trainctl.model_shape import ModelShape, MoEShape
from trainctl.runtime.parallel.comm_wait import COMM, CommWait

# the all-gather/reduce-scatter aliases: torch's renames, one home
from trainctl.runtime.parallel.tensor_parallel import (
    ParamMeta,
    TPContext,
    _all_gather_single,
    _reduce_scatter_single,
    copy_to_tp_region,
    gather_from_sp_region,
    reduce_from_tp_region,
    sp_param,
)

if TYPE_CHECKING:  # parallel_context.py imports this module for MoEContext
    from trainctl.runtime.model.parallel_context import ParallelContext

A2A = CommWait()  # seconds in the EP all-to-alls (and their count exchanges): metrics `moe.a2a_s`


@dataclass
class A2ATraffic:
    """Bytes of token rows this rank hands to the EP all-to-alls (dispatch and combine, forward, backward and
    any recomputed forward; the pipeline's shape inference too): `off_rank` goes to the other EP ranks,
    `total` includes the rows that stay (those for its own experts). Metrics `moe.a2a_bytes`."""

    off_rank: int = 0
    total: int = 0

    def add(self, x: Tensor, in_splits: list[int], me: int) -> None:
        row = x.element_size() * math.prod(x.shape[1:])
        self.total += row * sum(in_splits)
        self.off_rank += row * (sum(in_splits) - in_splits[me])

    def take(self) -> tuple[int, int]:
        out = (self.off_rank, self.total)
        self.off_rank = self.total = 0
        return out


TRAFFIC = A2ATraffic()



def is_expert_param(name: str) -> bool:
    """A routed expert's parameter (`layers.<i>.mlp.experts.<e>...`): split over EP, its gradient reduced
    over the expert-data-parallel group."""
    return ".mlp.experts." in name


@dataclass(frozen=True)
class EPContext:
    """The expert-parallel group of this rank; `group` None or `size` 1: every expert is local."""

    group: Any  # torch.distributed.ProcessGroup | None
    size: int
    rank: int

    @staticmethod
    def single() -> EPContext:
        return EPContext(None, 1, 0)

    def experts_of(self, num_experts: int) -> range:
        """Global indices of this EP rank's experts: a contiguous block of num_experts/ep."""
        n = num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)


# Layout of one stats row: tokens per expert (E), then these (trainer.py reads them through `reduce`).
_DROPPED, _BALANCE, _Z, _SEQS = range(4)


class MoEStats:
    """What this rank's MoE layers saw in one optimizer step, reduced over every rank at its end.

    A layer records once per micro-batch forward; a recomputed forward (full recompute, in backward) does
    not record, and the pipeline's shape inference (one extra forward before the first step's micro-batches
    on garbage inputs) is dropped by keeping each layer's last `micro_batches` records."""

    def __init__(self, moe_layers: list[int], num_experts: int):
        self.row = {layer: i for i, layer in enumerate(moe_layers)}
        self.num_experts = num_experts
        self.records: dict[int, list[Tensor]] = {}

    def start_step(self) -> None:
        self.records = {}
        A2A.take()
        TRAFFIC.take()

    def record(self, layer: int, row: Tensor) -> None:
        if torch._C._current_graph_task_id() != -1:  # inside backward: a recomputed forward
            return
        self.records.setdefault(layer, []).append(row.detach())

    def reduce(self, micro_batches: int, group: Any, device: torch.device, world: int) -> dict[str, Any]:
        """The step's routing record (a collective over `group`, every rank of the layout)."""
        E = self.num_experts
        buf = torch.zeros(len(self.row), E + 4, dtype=torch.float64, device=device)
        for layer, rows in self.records.items():
            buf[self.row[layer]] += torch.stack(rows[-micro_batches:]).double().sum(0)
        a2a = torch.tensor([A2A.take(), *TRAFFIC.take()], dtype=torch.float64, device=device)
        flat = torch.cat([buf.reshape(-1), a2a])
        if world > 1:
            dist.all_reduce(flat, group=group)
        seconds, off_rank, total = flat[-3:].tolist()
        buf = flat[:-3].view(len(self.row), E + 4)
        counts, extra = buf[:, :E], buf[:, E:]
        seqs = extra[:, _SEQS].clamp(min=1)
        mean = counts.mean(1).clamp(min=1e-12)
        return {
            "aux_loss": float((extra[:, _BALANCE] / seqs).mean()),  # balance loss, mean over MoE layers
            "z_loss": float((extra[:, _Z] / seqs).mean()),
            "tokens_per_expert": {"min": float(counts.min()), "max": float(counts.max()),
                                  "mean": float(counts.mean())},
            "imbalance": float((counts.max(1).values / mean).max()),  # max/mean, worst layer
            "dropped": int(extra[:, _DROPPED].sum()),
            "a2a_s": seconds / world,  # per rank, mean over ranks
            "a2a_bytes": off_rank / world,  # token rows sent to other EP ranks, per rank, mean over ranks
            "a2a_off_rank": off_rank / total if total else 0.0,  # of the rows dispatched, the share that left
        }


@dataclass
class MoEContext:
    """The MoE layers' shared state on one rank: the routing spec, the EP group, the step's statistics and
    the gradient the auxiliary losses start backward with (set by the trainer every step)."""

    shape: MoEShape
    ep: EPContext
    stats: MoEStats
    aux_grad_scale: float = 1.0  # loss scale / micro-batches: the LM loss's own scaling per micro-batch
    moe_layers: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: ModelShape, ep: EPContext) -> MoEContext:
        assert cfg.moe is not None
        layers = [i for i in range(cfg.layers) if cfg.moe.is_moe_layer(i)]
        return cls(cfg.moe, ep, MoEStats(layers, cfg.moe.num_experts), moe_layers=layers)

    @classmethod
    def single(cls, cfg: ModelShape) -> MoEContext:
        return cls.build(cfg, EPContext.single())

    def is_moe_layer(self, i: int) -> bool:
        return self.shape.is_moe_layer(i)


# ---------------------------------------------------------------------------------------------------------
# Collectives with autograd: all-to-all with uneven splits (EP), gather / reduce-scatter of uneven row
# counts (TP under SP)
# ---------------------------------------------------------------------------------------------------------


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any, me: int) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    TRAFFIC.add(x, in_splits, me)
    with COMM, A2A:
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any, me: int) -> Tensor:
        ctx.splits, ctx.group, ctx.me = (out_splits, in_splits), group, me
        return _all_to_all(x, out_splits, in_splits, group, me)

    @staticmethod
    def backward(ctx, g: Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(g, in_splits, out_splits, ctx.group, ctx.me), None, None, None, None


def _gather_rows(x: Tensor, counts: list[int], tp: TPContext) -> Tensor:
    """Every TP rank's rows (counts[r] of them on rank r), concatenated in TP-rank order."""
    m = max(counts)
    if m == 0:
        return x
    pad = x.new_zeros((m, *x.shape[1:]))
    pad[:x.shape[0]] = x
    out = x.new_empty((tp.size * m, *x.shape[1:]))
    with COMM:
        _all_gather_single(out, pad, group=tp.group)
    return torch.cat([out[r * m:r * m + c] for r, c in enumerate(counts)])


def _reduce_scatter_rows(y: Tensor, counts: list[int], tp: TPContext) -> Tensor:
    """y holds a segment of counts[r] rows for each TP rank r; this rank's segment summed over the group."""
    m = max(counts)
    if m == 0:
        return y
    buf = y.new_zeros((tp.size * m, *y.shape[1:]))
    for r, seg in enumerate(y.split(counts)):
        buf[r * m:r * m + seg.shape[0]] = seg
    out = y.new_empty((m, *y.shape[1:]))
    with COMM:
        _reduce_scatter_single(out, buf, group=tp.group)
    return out[:counts[tp.rank]]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, counts: list[int], tp: TPContext) -> Tensor:
        ctx.counts, ctx.tp = counts, tp
        return _gather_rows(x, counts, tp)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _reduce_scatter_rows(g.contiguous(), ctx.counts, ctx.tp), None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, counts: list[int], tp: TPContext) -> Tensor:
        ctx.counts, ctx.tp = counts, tp
        return _reduce_scatter_rows(y.contiguous(), counts, tp)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _gather_rows(g.contiguous(), ctx.counts, ctx.tp), None, None


class _AttachLoss(torch.autograd.Function):
    """Identity on the block's output whose backward also starts the auxiliary loss's backward with the
    gradient `scale` (the LM loss's own per-micro-batch scaling; Megatron-Core's MoEAuxLossAutoScaler), so
    the loss needs no path to the pipeline's last stage."""

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.scale, ctx.like = scale, (loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g: Tensor):
        dtype, device = ctx.like
        return g, torch.full((), ctx.scale, dtype=dtype, device=device), None


def regroup(sizes: Tensor, order: Tensor) -> Tensor:
    """Row index that lays out contiguous chunks (row counts `sizes`, in their current order) in the chunk
    order `order`: out = rows.index_select(0, regroup(sizes, order))."""
    starts = torch.cumsum(sizes, 0) - sizes
    s = sizes[order]
    out_starts = torch.cumsum(s, 0) - s
    return torch.repeat_interleave(starts[order] - out_starts, s) + torch.arange(int(s.sum()), device=sizes.device)


# ---------------------------------------------------------------------------------------------------------
# The block
# ---------------------------------------------------------------------------------------------------------


class Router(nn.Module):
    """The gate W_g [E, H], replicated over TP and EP; fp32 logits (fp64 when the model is). Under SP each
    TP rank routes its own sequence chunk, so the weight's gradient is a partial sum over the TP group."""

    def __init__(self, cfg: ModelShape, tp: TPContext):
        super().__init__()
        assert cfg.moe is not None
        self.tp = tp
        e = cfg.moe.num_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden))
        self.param_meta = {"weight": ParamMeta((e, cfg.hidden), None, "normal", cfg.init_std,
                                               sequence_parallel=tp.sp)}

    def forward(self, tokens: Tensor) -> Tensor:
        w = sp_param(self.weight, self.tp)
        dt = torch.promote_types(tokens.dtype, torch.float32)
        with torch.autocast(tokens.device.type, enabled=False):
            return F.linear(tokens.to(dt), w.to(dt))


class RoutedExperts(nn.ModuleDict):
    """This EP rank's routed experts, by global index, and what runs between the two all-to-alls: into the
    TP region, each expert on its rows, out of the TP region, fc2's bias (module docstring, steps 4-5). One
    module, so that FSDP2 can shard the experts over the expert-DP mesh as one unit and gather them around
    this forward (the bias is added after the TP reduction, outside the experts' own forwards)."""

    def __init__(self, experts: dict[int, nn.Module], tp: TPContext, bias: bool):
        super().__init__({str(i): m for i, m in experts.items()})
        self.tp, self.bias = tp, bias

    def forward(self, x: Tensor, recv: Tensor) -> Tensor:
        """x: the received rows, chunks [source EP rank][local expert] of row counts recv [ep, local]."""
        tp, local = self.tp, len(self)
        chunks = recv.unsqueeze(0)  # [TP rank][source][expert]
        if tp.sp:
            with torch.no_grad():
                chunks = recv.new_empty((tp.size * recv.shape[0], recv.shape[1]))
                with COMM:
                    _all_gather_single(chunks, recv.contiguous(), group=tp.group)
                chunks = chunks.view(tp.size, *recv.shape)
            tp_rows = chunks.sum((1, 2)).tolist()
            x = _GatherRows.apply(x, tp_rows, tp)
        elif tp.enabled:
            x = copy_to_tp_region(x, tp)
        sizes = chunks.reshape(-1)
        perm = None
        if chunks.shape[0] * chunks.shape[1] > 1:  # bring each expert's rows together
            expert_major = torch.arange(sizes.numel(), device=sizes.device).view(-1, local).t().reshape(-1)
            perm = regroup(sizes, expert_major)
            x = x.index_select(0, perm)
        per_expert = chunks.sum((0, 1)).tolist()
        y = torch.cat([expert(part) for expert, part in zip(self.values(), x.split(per_expert), strict=True)])
        if perm is not None:
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.numel(), device=perm.device)
            y = y.index_select(0, inverse)
        if tp.sp:
            y = _ReduceScatterRows.apply(y, tp_rows, tp)
        elif tp.enabled:
            y = reduce_from_tp_region(y, tp)
        if self.bias:  # fc2's bias after the TP reduction, by the expert of each received chunk
            bias = torch.stack([sp_param(m.fc2.bias, tp) for m in self.values()])
            expert_of_row = torch.repeat_interleave(torch.arange(local, device=y.device).repeat(recv.shape[0]),
                                                    recv.reshape(-1))
            y = y + bias.index_select(0, expert_of_row).to(y.dtype)
        return y


class MoE(nn.Module):
    """An MoE layer's MLP (the module docstring): router, routed experts of this EP rank, shared experts."""

    def __init__(self, cfg: ModelShape, ctx: ParallelContext, *, experts: dict[int, nn.Module],
                 shared: nn.Module | None, layer: int):
        super().__init__()
        assert cfg.moe is not None and ctx.moe is not None
        self.spec = cfg.moe
        self.tp, self.moe, self.layer = ctx.tp, ctx.moe, layer
        self.router = Router(cfg, ctx.tp)
        self.experts = RoutedExperts(experts, ctx.tp, bias=cfg.bias)
        self.shared = shared

    # -- routing ---------------------------------------------------------------------------------
    def _top_k(self, logits: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
        """(routing weights [N, k], expert indices [N, k])."""
        k = self.spec.top_k
        if self.spec.router == "topk_softmax":
            top, idx = torch.topk(logits, k, dim=-1)
            return top.softmax(-1), idx
        return torch.topk(probs, k, dim=-1)

    @torch.no_grad()
    def _capacity_keep(self, idx: Tensor) -> Tensor:
        """Which assignments (idx [B, T', k]) an expert takes: per sequence, GShard's priority."""
        tp = self.tp
        full = gather_from_sp_region(idx, tp) if tp.sp else idx  # [B, T, k]: the whole sequence
        B, T, k = full.shape
        E = self.spec.num_experts
        cap = math.ceil(self.spec.capacity_factor * T * k / E)
        slot_major = full.transpose(1, 2).reshape(B, k * T)  # every first choice before any second choice
        onehot = F.one_hot(slot_major, E)
        rank_in_expert = (onehot.cumsum(1) * onehot).sum(-1) - 1
        keep = (rank_in_expert < cap).view(B, k, T).transpose(1, 2)
        if tp.sp:
            t = idx.shape[1]
            keep = keep[:, tp.rank * t:(tp.rank + 1) * t]
        return keep

    def _losses(self, logits: Tensor, probs: Tensor, idx: Tensor, B: int) -> tuple[Tensor, Tensor]:
        """Per-sequence balance and z losses [B] (partial sums over the TP group under SP)."""
        tp, E, k = self.tp, self.spec.num_experts, self.spec.top_k
        Tl = logits.shape[0] // B
        T = Tl * (tp.size if tp.sp else 1)
        with torch.no_grad():
            counts = torch.zeros(B, E, dtype=probs.dtype, device=probs.device)
            counts.scatter_add_(1, idx.view(B, Tl * k), torch.ones(B, Tl * k, dtype=probs.dtype, device=probs.device))
            if tp.sp:
                with COMM:
                    dist.all_reduce(counts, group=tp.group)
        # a loss without a coefficient is only reported: no graph, so autograd keeps none of its inputs
        with torch.set_grad_enabled(torch.is_grad_enabled() and bool(self.spec.aux_loss_coeff)):
            balance = E / (k * T * T) * (counts * probs.view(B, Tl, E).sum(1)).sum(1)
        with torch.set_grad_enabled(torch.is_grad_enabled() and bool(self.spec.z_loss_coeff)):
            z = torch.logsumexp(logits, -1).pow(2).view(B, Tl).sum(1) / T
        return balance, z

    # -- dispatch and combine ----------------------------------------------------------------------
    def _routed(self, tokens: Tensor, idx: Tensor, weights: Tensor, keep: Tensor | None) -> Tensor:
        ep = self.moe.ep
        N, k = idx.shape
        E = self.spec.num_experts
        with torch.no_grad():
            flat = idx.reshape(-1)  # assignment a = token * k + slot
            chosen = keep.reshape(-1).nonzero().squeeze(1) if keep is not None else torch.arange(N * k,
                                                                                                 device=idx.device)
            order = chosen[torch.argsort(flat[chosen], stable=True)]  # by expert, then token
            send = torch.bincount(flat[chosen], minlength=E).view(ep.size, E // ep.size)  # [EP rank, its expert]
            recv = send
            if ep.size > 1:
                recv = torch.empty_like(send)
                with COMM, A2A:
                    dist.all_to_all_single(recv, send, group=ep.group)
        token_of = order // k
        x = tokens.index_select(0, token_of)  # top_k copies, grouped by expert
        send_rows, recv_rows = send.sum(1).tolist(), recv.sum(1).tolist()
        if ep.size > 1:
            x = _AllToAll.apply(x, recv_rows, send_rows, ep.group, ep.rank)  # [source EP rank][expert] chunks
        y = self.experts(x, recv)
        if ep.size > 1:
            y = _AllToAll.apply(y, send_rows, recv_rows, ep.group, ep.rank)  # back in `order`
        w = weights.reshape(-1).index_select(0, order).to(y.dtype)
        # index_put keeps only the index for backward (index_add would keep the weighted outputs too)
        return y.new_zeros((N, y.shape[-1])).index_put((token_of,), y * w.unsqueeze(1), accumulate=True)

    def forward(self, x: Tensor) -> Tensor:
        B, Tl, H = x.shape
        spec = self.spec
        tokens = x.reshape(-1, H)
        logits = self.router(tokens)  # [B*T', E] fp32
        probs = logits.softmax(-1)
        weights, idx = self._top_k(logits, probs)
        keep = self._capacity_keep(idx.view(B, Tl, -1)).reshape(-1, spec.top_k) if spec.capacity_factor else None
        balance, z = self._losses(logits, probs, idx, B)
        dispatch = tokens
        if torch.is_autocast_enabled(x.device.type):  # the tokens travel in the compute dtype
            dispatch = tokens.to(torch.get_autocast_dtype(x.device.type))
        out = self._routed(dispatch, idx, weights, keep).view(B, Tl, H)
        if self.shared is not None:
            out = out + self.shared(x)
        self._record(idx, keep, balance, z, B)
        loss = _aux_loss(balance, z, self.spec)
        if loss is not None:
            out = _AttachLoss.apply(out, loss, self.moe.aux_grad_scale)
        return out

    def _record(self, idx: Tensor, keep: Tensor | None, balance: Tensor, z: Tensor, B: int) -> None:
        tp, E = self.tp, self.spec.num_experts
        tokens_here = 1.0 if tp.sp or tp.rank == 0 else 0.0  # without SP the TP ranks route the same tokens
        with torch.no_grad():
            row = torch.zeros(E + 4, dtype=torch.float64, device=idx.device)
            row[:E] = torch.bincount(idx.reshape(-1), minlength=E).double() * tokens_here
            if keep is not None:
                row[E + _DROPPED] = float((~keep).sum()) * tokens_here
            row[E + _BALANCE] = balance.detach().sum().double() * tokens_here
            row[E + _Z] = z.detach().sum().double() * tokens_here
            row[E + _SEQS] = B if tp.rank == 0 else 0
        self.moe.stats.record(self.layer, row)


def _aux_loss(balance: Tensor, z: Tensor, spec: MoEShape) -> Tensor | None:
    """aux_loss_coeff * balance + z_loss_coeff * z, mean over the micro-batch's sequences (None: both off)."""
    loss = None
    if spec.aux_loss_coeff:
        loss = spec.aux_loss_coeff * balance.mean()
    if spec.z_loss_coeff:
        zl = spec.z_loss_coeff * z.mean()
        loss = zl if loss is None else loss + zl
    return loss

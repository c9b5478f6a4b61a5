"""Context parallelism: exact causal attention over a sequence split across the ranks of a CP group
(docs/design/trainer.md, "Context parallelism").

Chunk layout (load-balanced causal work, as Megatron-Core and the Llama 3 paper lay it out): each sequence of
T tokens is cut into 2*cp chunks of c = T/(2*cp) tokens; CP rank i holds chunks i and 2*cp-1-i, in that order,
as one local sequence of T/cp tokens. Under a causal mask chunk j attends to j+1 chunks of keys, so every rank
does (i+1) + (2*cp-i) = 2*cp+1 chunk-pairs of attention work: the same on every rank.

K/V exchange: one all-gather of this rank's K and V per layer over the CP group (backward: a reduce-scatter
of their gradients), chosen by measurement (bench/bench_cp.py) over a ring of send/recv; with grouped-query
attention K and V are kv_heads/heads of the query's width, which is why the Llama 3 paper all-gathers them.
Each local query chunk j then attends to the key prefix [0, (j+1)*c) with a causal mask aligned to the
bottom right (query a sees keys b <= a + j*c): two attention calls per layer, no s x s tensor (on the CPU the
mask is a strided view of one short vector, `reversed_causal_mask`).

Everything else in the model is per token (norms, MLP, the LM head and the loss over this rank's tokens), so
only attention and the positions (RoPE's angles, learned position rows) need to know the layout. The loss on
a CP rank is the mean over its T/cp tokens; gradients are reduced over the data x context parallel group
with a division by dp*cp (data_parallel.GradSync, FSDP), which makes them those of the mean over all tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from trainctl.runtime.parallel.comm_wait import COMM  # time in CP collectives counts as communication wait
from trainctl.runtime.parallel.tensor_parallel import (  # torch's renames, one home
    _all_gather_single,
    _reduce_scatter_single,
)


@dataclass(frozen=True)
class CPContext:
    """The context-parallel group of this rank. `size` 1 means no context parallelism."""

    group: Any  # torch.distributed.ProcessGroup | None
    size: int
    rank: int

    @staticmethod
    def single() -> CPContext:
        return CPContext(None, 1, 0)

    @staticmethod
    def from_group(group: Any) -> CPContext:
        if group is None:
            return CPContext.single()
        return CPContext(group, dist.get_world_size(group), dist.get_rank(group))

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def chunks(self) -> tuple[int, int]:
        """The two chunks of every sequence this rank holds, in local order."""
        return self.rank, 2 * self.size - 1 - self.rank

    def positions(self, local_len: int, device: torch.device | str | None = None) -> Tensor:
        """Positions in the whole sequence of this rank's `local_len` = T/cp tokens."""
        c = local_len // 2
        return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in self.chunks()])


def split_sequence(x: Tensor, cp: CPContext, dim: int = -1) -> Tensor:
    """This rank's two chunks of full sequences along `dim` (the data loader's inputs and targets)."""
    if not cp.enabled:
        return x
    n = x.shape[dim]
    if n % (2 * cp.size):
        raise ValueError(f"sequence length {n} is not divisible by 2*cp = {2 * cp.size} (context parallel)")
    c = n // (2 * cp.size)
    return torch.cat([x.narrow(dim, j * c, c) for j in cp.chunks()], dim=dim).contiguous()


class _GatherSequence(torch.autograd.Function):
    """[*, T/cp, d] (this rank's chunks i and 2cp-1-i) -> [*, T, d] in sequence order on every CP rank;
    backward: the reduce-scatter of the gradient back to each rank's chunks."""

    @staticmethod
    def forward(ctx, x: Tensor, cp: CPContext) -> Tensor:
        ctx.cp = cp
        n, lead, d = cp.size, x.shape[:-2], x.shape[-1]
        c = x.shape[-2] // 2
        out = x.new_empty(n * x.numel())  # gloo wants flat buffers: rank r's tensor at [r*numel, (r+1)*numel)
        with COMM:
            _all_gather_single(out, x.contiguous().view(-1), group=cp.group)
        out = out.view(n, -1, 2, c, d)  # [rank, lead, half, c, d]
        # chunk j < cp is rank j's first half; chunk j >= cp is rank 2cp-1-j's second half
        ordered = torch.cat([out[:, :, 0], out[:, :, 1].flip(0)])  # [2cp, lead, c, d]
        return ordered.permute(1, 0, 2, 3).reshape(*lead, 2 * n * c, d)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:
        cp = ctx.cp
        n, lead, d = cp.size, g.shape[:-2], g.shape[-1]
        c = g.shape[-2] // (2 * n)
        by_chunk = g.reshape(-1, 2 * n, c, d).permute(1, 0, 2, 3)  # [2cp, lead, c, d]
        per_rank = torch.stack([by_chunk[:n], by_chunk[n:].flip(0)], dim=2).contiguous()  # [rank, lead, 2, c, d]
        out = g.new_empty(per_rank[0].numel())
        with COMM:
            _reduce_scatter_single(out, per_rank.view(-1), group=cp.group)
        return out.reshape(*lead, 2 * c, d), None


def gather_sequence(x: Tensor, cp: CPContext) -> Tensor:
    return _GatherSequence.apply(x, cp) if cp.enabled else x


_masks: dict[tuple[int, int, torch.dtype, str], Tensor] = {}


def reversed_causal_mask(c: int, j: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The additive mask of query chunk j (c tokens, in REVERSED order) against the key prefix [0, (j+1)*c).

    Query a (row c-1-a here) sees key b when b <= a + j*c, i.e. when row + b <= c-1 + j*c: the mask depends on
    row + b only, so it is one vector u of c + (j+1)*c - 1 values seen through strides (1, 1). A [c, (j+1)*c]
    mask would be saved for backward by every layer (the CPU kernel keeps the tensor it is given) and would
    cost more than the activations CP saves; this view's storage is a few KB, shared by every layer and
    micro-batch. Strides cannot be negative, hence the reversed queries."""
    key = (c, j, dtype, str(device))
    mask = _masks.get(key)
    if mask is None:
        keys = (j + 1) * c
        u = torch.zeros(c + keys - 1, dtype=dtype, device=device)
        u[c + j * c:] = -torch.inf  # row + b > c-1 + j*c: a later key
        mask = _masks[key] = u.as_strided((c, keys), (1, 1))
    return mask


def _chunk_attention(q: Tensor, k: Tensor, v: Tensor, j: int, gqa: bool) -> Tensor:
    """Query chunk j ([B, heads, c, d]) against the key prefix k, v ([B, kv_heads, (j+1)*c, d]), causal aligned
    to the bottom right (query a sees key b <= a + j*c)."""
    c = q.shape[2]
    if q.device.type == "cuda":  # the fused kernels take the alignment itself, no mask tensor
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(c, k.shape[2]), enable_gqa=gqa)
    mask = reversed_causal_mask(c, j, q.dtype, q.device)
    return F.scaled_dot_product_attention(q.flip(2), k, v, attn_mask=mask, enable_gqa=gqa).flip(2)


def attention(q: Tensor, k: Tensor, v: Tensor, cp: CPContext) -> Tensor:
    """Exact causal attention of this rank's query chunks against the whole sequence's keys.

    q [B, heads, T/cp, d], k and v [B, kv_heads, T/cp, d] (positions already applied). Returns
    [B, heads, T/cp, d] laid out in memory as [B, T/cp, heads, d], as the fused kernels return it, so the
    caller's transpose + reshape into the output projection is a view."""
    c = q.shape[2] // 2
    kv = gather_sequence(torch.stack([k, v]), cp)  # one all-gather per layer: [2, B, kv_heads, T, d]
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for half, j in enumerate(cp.chunks()):
        keys = (j + 1) * c
        y = _chunk_attention(q[:, :, half * c:(half + 1) * c], kv[0, :, :, :keys], kv[1, :, :, :keys], j, gqa)
        outs.append(y.transpose(1, 2))
    return torch.cat(outs, dim=1).transpose(1, 2)

"""Two ops written as autograd functions so that they keep for backward what Megatron keeps, not what torch's
composite ops would (docs/design/memory.md, "Memory model"):

- `swiglu`: silu(gate) * up keeping only the fused [gate; up] input; silu(gate) is recomputed in backward, as
  Megatron's fused bias-SwiGLU does. The plain ops would also keep silu(gate): f more values per token.
- `rms_norm_16bit`: RMSNorm of a 16-bit input, computed in fp32 and returned in the input's dtype, keeping the
  16-bit input and the fp32 rstd. On a GPU that is what `F.rms_norm` does (a fused kernel); on a CPU
  `F.rms_norm` is composite and would keep three fp32 copies of the input.

Both give the values autograd gives for the plain ops: swiglu bitwise (the same elementwise ops), the norm to
fp32 rounding of its reductions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        gate, up = h.chunk(2, dim=-1)
        ctx.save_for_backward(h)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        # autograd's own formulas for mul and silu, so the gradients are bitwise those of the plain ops
        grad_gate = torch.ops.aten.silu_backward(g * up, gate)
        return torch.cat([grad_gate, g * F.silu(gate)], dim=-1)


def swiglu(h: Tensor) -> Tensor:
    """silu(gate) * up of h = [gate; up] (the last dim), keeping only h for backward."""
    return _SwiGLU.apply(h)


class _RMSNorm16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, eps: float | None) -> Tensor:
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, rstd, weight = ctx.saved_tensors
        x_hat = x.float() * rstd
        g32 = g.float()
        g_hat = g32 * weight.float() if weight is not None else g32
        grad_x = rstd * (g_hat - x_hat * (g_hat * x_hat).mean(-1, keepdim=True))
        grad_w = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = (g32 * x_hat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return grad_x.to(x.dtype), grad_w, None


def rms_norm_16bit(x: Tensor, weight: Tensor | None, eps: float | None) -> Tensor:
    """RMSNorm over the last dim of a 16-bit x, in fp32 inside, returned in x's dtype; keeps x and rstd."""
    if x.is_cuda:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _RMSNorm16.apply(x, weight, eps)

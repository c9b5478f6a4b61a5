"""The memory-lean ops (runtime/model/lean_ops.py) against PyTorch's own ops: SwiGLU bitwise equal to
silu(gate) * up under autograd while keeping only its input; the 16-bit RMSNorm within bf16 rounding of
F.rms_norm in float64 while keeping only its bf16 input and fp32 rstd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainctl.runtime.model.lean_ops import rms_norm_16bit, swiglu


def saved_bytes(fn, *args) -> tuple[torch.Tensor, int]:
    """fn(*args) and the bytes autograd saved for its backward (each storage once, parameters' too)."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_bitwise_the_plain_ops_and_keeps_only_its_input(dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 5, 16, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(3, 5, 8, generator=g).to(dtype)

    def plain(t):
        gate, up = t.chunk(2, dim=-1)
        return F.silu(gate) * up

    ref, ref_saved = saved_bytes(plain, h)
    ref.backward(grad)
    ref_grad, h.grad = h.grad.clone(), None
    out, saved = saved_bytes(swiglu, h)
    out.backward(grad)
    assert torch.equal(out, ref) and torch.equal(h.grad, ref_grad)
    assert saved == h.numel() * h.element_size()  # [gate; up] only
    assert ref_saved == saved * 3 // 2  # the plain ops also keep silu(gate), half of h


def test_rms_norm_16bit_matches_float64_and_keeps_its_bf16_input():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, 32, generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(32, generator=g)).bfloat16().requires_grad_()
    grad = torch.randn(4, 7, 32, generator=g).bfloat16()
    out, saved = saved_bytes(rms_norm_16bit, x, w, 1e-5)
    out.backward(grad)
    assert out.dtype == torch.bfloat16
    assert saved == x.numel() * 2 + 4 * 7 * 4 + w.numel() * 2  # input, fp32 rstd per token, the weight
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.rms_norm(x64, (32,), w64, 1e-5)
    ref.backward(grad.double())
    unit = 2.0**-8  # bf16's rounding of the result, the input gradient and the weight gradient
    for got, want in ((out, ref), (x.grad, x64.grad), (w.grad, w64.grad)):
        assert (got.double() - want).abs().max() <= unit * want.abs().max()

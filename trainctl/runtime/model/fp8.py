"""FP8 GEMMs for the transformer's linear layers (`train.precision: fp8`), with dynamic scaling.

Each of a linear layer's three GEMMs (forward y = x W^T, input gradient g W, weight gradient g^T x) quantizes its
two operands along the contraction dimension, multiplies them in FP8 and accumulates in the base precision
(docs/design/trainer.md, "FP8 training"):

- tensorwise (the default): one scale per operand, scale = FP8 max / amax(|t|); inputs and weights in e4m3
  (more mantissa), output gradients in e5m2 (more range: gradients span more decades than one scale covers).
- rowwise: one scale per row of each operand (per token of the input, per output channel of the weight), every
  operand in e4m3 (the per-row scales give the range e5m2 would), as torchao's rowwise recipe does.

What a layer keeps for backward is what a bf16 layer keeps (its input in the compute dtype and the weight
parameter itself): backward quantizes them again along its own contraction dimension, which rowwise needs anyway
(the forward's rows are not the backward's). So FP8 adds no persistent memory, only one GEMM's FP8 copies at a
time, and the master weights stay fp32 (or the bf16 parameters of ZeRO-1/2) as in a bf16 run.

The GEMM runs on `torch._scaled_mm` where PyTorch has a kernel for the operands (CPUs: every case; CUDA: FP8
tensor cores, compute capability 8.9+, sizes multiples of 16, rowwise only with e4m3 operands and a bf16
output); elsewhere it is emulated: the same FP8 values, dequantized and multiplied in fp32. Both give the product
of the dequantized operands up to fp32 summation order (tests/unit/test_fp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise")
_TINY = 1e-12  # amax floor: an all-zero operand gets a finite scale (its FP8 values are zeros whatever it is)


@dataclass(frozen=True)
class Fp8Recipe:
    """How a linear layer's GEMMs are scaled: `rowwise` False is one scale per tensor."""
    rowwise: bool = False

    @staticmethod
    def named(name: str) -> Fp8Recipe:
        if name not in RECIPES:
            raise ValueError(f"unknown FP8 recipe {name!r}; expected one of {', '.join(RECIPES)}")
        return Fp8Recipe(rowwise=name == "rowwise")

    @property
    def grad_dtype(self) -> torch.dtype:
        """The FP8 format of output gradients: e5m2 under one scale per tensor, e4m3 under per-row scales."""
        return E4M3 if self.rowwise else E5M2


def quantize(t: Tensor, dtype: torch.dtype, rowwise: bool) -> tuple[Tensor, Tensor]:
    """(FP8 values, inverse scale) of a 2-D operand quantized along its last dimension: t ~= values * inverse.
    The inverse scale is a 0-d fp32 tensor (tensorwise) or one per row, shape [rows, 1] (rowwise)."""
    a = t.detach().abs()
    amax = (a.amax(dim=1, keepdim=True) if rowwise else a.amax()).float().clamp(min=_TINY)
    scale = torch.finfo(dtype).max / amax
    limit = torch.finfo(dtype).max
    values = (t.detach().float() * scale).clamp(-limit, limit).to(dtype)
    return values, scale.reciprocal()


def _has_kernel(a: Tensor, b: Tensor, rowwise: bool, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm takes these operands (a [M, K], b [N, K], both FP8) on their device."""
    if a.device.type == "cpu":
        return True
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device) < (8, 9):
        return False
    sizes_ok = all(n % 16 == 0 for n in (*a.shape, b.shape[0]))
    if rowwise:
        return sizes_ok and a.dtype == b.dtype == E4M3 and out_dtype == torch.bfloat16
    return sizes_ok and not (a.dtype == b.dtype == E5M2)


def fp8_gemm(a: Tensor, b: Tensor, *, a_dtype: torch.dtype, b_dtype: torch.dtype, rowwise: bool,
             out_dtype: torch.dtype) -> Tensor:
    """a @ b^T for a [M, K] and b [N, K], both quantized along K, in out_dtype."""
    if not a.numel() or not b.numel():  # an expert given no tokens: nothing to scale (amax of nothing)
        return a.new_zeros((a.shape[0], b.shape[0]), dtype=out_dtype)
    qa, ia = quantize(a, a_dtype, rowwise)
    qb, ib = quantize(b, b_dtype, rowwise)
    per_row = rowwise
    if not rowwise and qa.device.type == "cpu":
        # torch's CPU kernel takes one scale per tensor on e4m3 x e4m3 operands in a naive loop (35 s for a
        # 2048 x 1024 x 1024 product, 600x its per-row path): the same scale on every row takes the fast path and
        # gives the same product, the dequantized operands' in fp32. repeat, not expand: a one-row operand's
        # expanded scale keeps stride 0, which _scaled_mm refuses
        ia, ib = ia.reshape(1, 1).repeat(qa.shape[0], 1), ib.reshape(1, 1).repeat(qb.shape[0], 1)
        per_row = True
    ib_t = ib.t() if per_row else ib  # scale_b is [1, N] for per-row scales of b
    if _has_kernel(qa, qb, per_row, out_dtype):
        return torch._scaled_mm(qa, qb.t(), scale_a=ia, scale_b=ib_t, out_dtype=out_dtype)
    return ((qa.float() * ia) @ (qb.float() * ib).t()).to(out_dtype)


def forward_gemm(x2d: Tensor, weight: Tensor, recipe: Fp8Recipe, out_dtype: torch.dtype) -> Tensor:
    """y = x W^T: x [M, K] and W [N, K] in e4m3."""
    return fp8_gemm(x2d, weight, a_dtype=E4M3, b_dtype=E4M3, rowwise=recipe.rowwise, out_dtype=out_dtype)


def grad_input_gemm(g2d: Tensor, weight: Tensor, recipe: Fp8Recipe, out_dtype: torch.dtype) -> Tensor:
    """dx = g W: g [M, N] in the gradient format, W quantized along N (its columns' scales under rowwise)."""
    return fp8_gemm(g2d, weight.t().contiguous(), a_dtype=recipe.grad_dtype, b_dtype=E4M3,
                    rowwise=recipe.rowwise, out_dtype=out_dtype)


def grad_weight_gemm(g2d: Tensor, x2d: Tensor, recipe: Fp8Recipe, out_dtype: torch.dtype) -> Tensor:
    """dW = g^T x: both quantized along the tokens M."""
    return fp8_gemm(g2d.t().contiguous(), x2d.t().contiguous(), a_dtype=recipe.grad_dtype, b_dtype=E4M3,
                    rowwise=recipe.rowwise, out_dtype=out_dtype)

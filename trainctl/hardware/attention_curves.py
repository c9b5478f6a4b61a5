"""Measured flash-attention throughput by head dim and sequence length, for the operator model's attention core
(plan/operators.py `_attention_seconds`).

The figures are the FlashAttention repository's published benchmarks (Dao-AILab/flash-attention, assets/, shown
in its README), read off the bars' labels: causal, 16-bit, batch x sequence = 16K tokens, hidden 2048 (heads =
2048 / head dim), TFLOP/s counted as its benchmarks/benchmark_flash_attention.py counts them: 4 * batch * seq^2 *
heads * head_dim / 2 forward (the causal half), backward 2.5 times that. The trainer's attention is causal, so
only the causal panels are kept.

- H100 80GB SXM5, forward, FlashAttention-3 and FlashAttention-2: assets/flash3_fp16_fwd.png (July 2024, the
  FlashAttention-3 paper's forward figure; FP16, the same tensor-core peak as BF16), head dims 64, 128, 256.
- H100 80GB SXM5, FlashAttention-2 forward + backward: assets/flash2_h100_fwd_bwd_benchmark.png, head dims 64
  and 128. Its backward alone is what is left of the forward + backward time after the forward above.
- FlashAttention-3's backward: 1.5x FlashAttention-2's at the same shape, the lower end of the 1.5-1.75x that
  Shah et al. 2024 ("FlashAttention-3", sec. 4.1) measured.
- A100 80GB SXM4, FlashAttention-2 forward + backward: assets/flash2_a100_fwd_bwd_benchmark.png, head dims 64 and
  128, split into forward and backward in the ratio of the FlashAttention-2 paper's peaks (Dao 2023, sec. 4.1:
  forward up to 73% of peak, backward up to 63%; at that ratio the repository's best forward + backward figure,
  203 TFLOP/s, is 99% of those peaks).

Efficiency is the figure over the measured part's dense 16-bit peak. Other parts take their architecture's
figures as efficiencies (hardware/catalog.py says which); shapes between the measured ones are interpolated in
log2 of the head dim and the sequence, shapes beyond them take the nearest edge."""

from __future__ import annotations

from functools import lru_cache

from trainctl.hardware.catalog import ACCELERATORS
from trainctl.hardware.interpolation import log_weights

SEQ = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)

# TFLOP/s by head dim, one figure per SEQ, causal
H100_FORWARD = {
    "flash3": {64: (197, 265, 371, 420, 460, 473), 128: (292, 423, 521, 579, 602, 616),
               256: (286, 427, 537, 612, 628, 642)},
    "flash2": {64: (180, 229, 262, 284, 295, 299), 128: (191, 260, 298, 319, 333, 335),
               256: (208, 251, 278, 293, 297, 298)},
}
H100_FLASH2_FWD_BWD = {64: (141, 192, 232, 257, 273, 284), 128: (163, 221, 265, 294, 308, 328)}
A100_FLASH2_FWD_BWD = {64: (88, 119, 140, 156, 165, 171), 128: (99, 133, 155, 173, 182, 189)}

# the measured parts' dense 16-bit peaks, TFLOP/s
H100_PEAK = ACCELERATORS["h100-sxm"].peak_bf16_tflops
A100_PEAK = ACCELERATORS["a100-80gb"].peak_bf16_tflops
FLASH3_BACKWARD_OVER_FLASH2 = 1.5
A100_FLASH2_PEAKS = (0.73, 0.63)  # forward, backward
BACKWARD_FLOPS = 2.5  # a backward's FLOPs over its forward's, as the benchmarks count them


def _backward(fwd_bwd: float, forward: float) -> float:
    """The backward's rate from the forward + backward rate and the forward's (3.5 F / fwd_bwd = F / forward +
    2.5 F / backward)."""
    return BACKWARD_FLOPS / ((1 + BACKWARD_FLOPS) / fwd_bwd - 1 / forward)


def _h100(kernel: str, head_dim: int, i: int) -> tuple[float, float]:
    fb_dim = min(head_dim, max(H100_FLASH2_FWD_BWD))  # no forward + backward figure beyond head dim 128
    flash2_bwd = _backward(H100_FLASH2_FWD_BWD[fb_dim][i], H100_FORWARD["flash2"][fb_dim][i])
    backward = flash2_bwd * (FLASH3_BACKWARD_OVER_FLASH2 if kernel == "flash3" else 1.0)
    return H100_FORWARD[kernel][head_dim][i] / H100_PEAK, backward / H100_PEAK


def _a100(head_dim: int, i: int) -> tuple[float, float]:
    fwd_bwd = A100_FLASH2_FWD_BWD[min(head_dim, max(A100_FLASH2_FWD_BWD))][i] / A100_PEAK
    f, b = A100_FLASH2_PEAKS
    scale = fwd_bwd * (1 / f + BACKWARD_FLOPS / b) / (1 + BACKWARD_FLOPS)  # the peaks' ratio, this shape's total
    return f * scale, b * scale


def _grid(curves: str, kernel: str, head_dim: int, i: int) -> tuple[float, float]:
    return _h100(kernel, head_dim, i) if curves == "h100" else _a100(head_dim, i)


@lru_cache(maxsize=1024)
def efficiency(curves: str, kernel: str, *, head_dim: float, seq: float) -> tuple[float, float]:
    """(forward, backward) FLOP/s of a causal flash-attention kernel over the dense 16-bit peak, at this head dim
    and sequence length, from the curves `curves` ("h100" or "a100")."""
    fwd = bwd = 0.0
    for d, wd in log_weights(head_dim, HEAD_DIMS):
        for s, ws in log_weights(seq, SEQ):
            f, b = _grid(curves, kernel, d, SEQ.index(s))
            fwd, bwd = fwd + wd * ws * f, bwd + wd * ws * b
    return fwd, bwd

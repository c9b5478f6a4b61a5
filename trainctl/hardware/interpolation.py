"""Interpolation over the measured tables (hardware/gemm_shapes.py, hardware/attention_curves.py)."""

from __future__ import annotations

from math import log2


def log_weights(x: float, grid: tuple[int, ...]) -> tuple[tuple[int, float], ...]:
    """The two grid points around x (clamped to the grid) and their weights, linear in log2."""
    x = min(max(x, grid[0]), grid[-1])
    for lo, hi in zip(grid, grid[1:], strict=False):
        if x <= hi:
            w = (log2(x) - log2(lo)) / (log2(hi) - log2(lo))
            return (lo, 1 - w), (hi, w)
    return ((grid[-1], 1.0),)

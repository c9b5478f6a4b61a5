"""The timed micro-benchmarks of `trainctl calibrate`: GEMMs, collectives, one layer's forward + backward.

Every rank runs them at the same moment (the caller puts a barrier before each), so the ranks of a node
share cores, memory bandwidth and links as they do in training. Times are host wall-clock after a device
synchronize; a first call warms up (allocations, gloo connections, cuBLAS heuristics) and is not counted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainctl.model_shape import ModelShape, layer_flops_per_token
from trainctl.plan.calibration.shapes import Gemm
from trainctl.runtime.model import build_stage
from trainctl.runtime.tensor_parallel import TPContext, _all_gather_single, _reduce_scatter_single

# Compute is timed in windows of this long, on every rank at once: well above a scheduler slice, so ranks
# sharing a core overlap for the whole window and the rate includes the sharing.
WINDOW_S = 0.05


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds per call of `repeats` calls (collectives: every rank makes the same calls)."""
    fn()
    synchronize(device)
    calls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        calls.append(time.perf_counter() - t0)
    return statistics.median(calls)


def windowed(fn: Callable[[], object], device: torch.device, repeats: int, window_s: float = WINDOW_S) -> float:
    """Median seconds per call over `repeats` windows in which every rank calls `fn` until `window_s` has
    passed. The windows start together (a barrier) and end together, so the ranks sharing a core contend
    all the way through; loops of a fixed count would end at different times and leave the last ranks a
    core of their own. The warm-up call is not counted (a first layer call takes 100x the next)."""
    fn()
    synchronize(device)
    per_call = []
    for _ in range(repeats):
        dist.barrier()
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < window_s:
            fn()
            synchronize(device)
            n += 1
        per_call.append(elapsed / n)
    return statistics.median(per_call)


def time_gemm(g: Gemm, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    a = torch.randn(g.m, g.k, device=device, dtype=dtype)
    b = torch.randn(g.k, g.n, device=device, dtype=dtype)
    return windowed(lambda: torch.mm(a, b), device, repeats)


class Layer:
    """One real transformer layer on one rank (tp 1), built by the trainer's own builder, and an input."""

    def __init__(self, shape: ModelShape, micro_batch: int, recompute: str, autocast: torch.dtype | None,
                 device: torch.device, seed: int) -> None:
        self.module = build_stage(shape, range(0, 1), first=False, last=False, tp=TPContext.single(), seed=seed,
                                  recompute=recompute, device=device)
        self.x = torch.randn(micro_batch, shape.seq_len, shape.hidden, device=device, requires_grad=True)
        self.grad = torch.randn_like(self.x)
        self.autocast, self.device = autocast, device
        # hardware FLOPs of a forward + backward, by the planner's arithmetic (trainctl.model_shape)
        self.flops = layer_flops_per_token(shape, recompute) * micro_batch * shape.seq_len

    def _forward(self) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16, enabled=bool(self.autocast)):
            return self.module(self.x)

    def step(self) -> None:
        self._forward().backward(self.grad)

    def forward(self) -> None:
        with torch.no_grad():
            self._forward()


def fp32_numel(nbytes: int, n: int) -> int:
    """fp32 elements of a whole tensor of about `nbytes`, divisible by the group size."""
    return max(n, nbytes // 4 // n * n)


def collective_call(op: str, numel: int, group: dist.ProcessGroup, n: int,
                    device: torch.device) -> Callable[[], object]:
    """One call of `op` over a whole tensor of `numel` fp32 elements in `group` (n ranks)."""
    whole = torch.randn(numel, device=device)
    shard = torch.empty(numel // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(whole, group=group)
    if op == "all_gather":
        return lambda: _all_gather_single(whole, shard, group=group)  # the trainer's own calls
    if op == "reduce_scatter":
        return lambda: _reduce_scatter_single(shard, whole, group=group)
    if op == "all_to_all":
        out = torch.empty_like(whole)
        return lambda: dist.all_to_all_single(out, whole, group=group)
    raise ValueError(f"unknown collective {op!r}")


def ping_pong(numel: int, peer: int, first: bool, device: torch.device) -> Callable[[], object]:
    """Half a round trip between two ranks: the one-way time of a pipeline send, with both ends' clocks
    out of the measurement (the `first` rank's timing is the one recorded)."""
    buf = torch.randn(numel, device=device)

    def call() -> None:
        if first:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)

    return call



def loaded(compute: Callable[[], object], collective: Callable[[], object], device: torch.device,
           iterations: int) -> tuple[float, float]:
    """(seconds per iteration of `compute` alone, of `compute` then one `collective`), every rank at once.
    The difference is what a collective costs while the other ranks compute: on an oversubscribed CPU
    mostly waiting for a peer that is not on a core, which idle timings of collectives never see."""
    compute()
    collective()
    out = []
    for with_collective in (False, True):
        synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iterations):
            compute()
            if with_collective:
                collective()
        synchronize(device)
        out.append((time.perf_counter() - t0) / iterations)
    return out[0], out[1]

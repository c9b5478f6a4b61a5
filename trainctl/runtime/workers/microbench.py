"""The timed micro-benchmarks of `trainctl calibrate`: GEMMs, collectives, one layer's forward + backward.

Every rank runs them at the same moment (the caller puts a barrier before each), so the ranks of a node
share cores, memory bandwidth and links as they do in training. Times are host wall-clock after a device
synchronize; a first call warms up (allocations, gloo connections, cuBLAS heuristics) and is not counted.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainctl.model_shape import ModelShape, layer_flops_per_token
from trainctl.plan.calibration.shapes import Gemm
from trainctl.runtime.model.parallel_context import ParallelContext
from trainctl.runtime.model.transformer import build_stage, compile_blocks, residual_dtype
from trainctl.runtime.parallel.context_parallel import CPContext
from trainctl.runtime.parallel.tensor_parallel import TPContext, _all_gather_single, _reduce_scatter_single

# Compute is timed in windows of this long, on every rank at once: well above a scheduler slice, so ranks
# sharing a core overlap for the whole window and the rate includes the sharing.
WINDOW_S = 0.05


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int, *, mixed: bool = False) -> float:
    """Median seconds per call of `repeats` calls (collectives: every rank makes the same calls). `mixed`: the
    mean of the calls less the fastest and the slowest, for a time with two modes that a run pays in their mix:
    on a shared CPU a small gloo collective takes about 0.3 ms, or 3-8 ms when a peer waits out a scheduler
    tick (2 ranks on the 2-core VM, 4 KiB to 1 MiB: 8-10 slow calls in 20), and a median of three priced
    every call at one mode or the other, from one calibration to the next."""
    fn()
    synchronize(device)
    calls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        calls.append(time.perf_counter() - t0)
    if mixed and len(calls) > 2:
        return statistics.mean(sorted(calls)[1:-1])
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


def windowed_collective(fn: Callable[[], object], device: torch.device, repeats: int,
                        window_s: float = WINDOW_S) -> float:
    """`windowed` for a call with collectives inside (a TP layer, an FSDP2 unit): every rank must make the
    same number of calls, so the count per window is agreed first (the most any rank needs to fill
    `window_s`), then every window runs that many calls on every rank."""
    fn()
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    need = torch.tensor([max(1, math.ceil(window_s / max(time.perf_counter() - t0, 1e-6)))], device=device)
    dist.all_reduce(need, op=dist.ReduceOp.MAX)
    n = int(need.item())
    per_call = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        synchronize(device)
        per_call.append((time.perf_counter() - t0) / n)
    return statistics.median(per_call)


def stream_dtype(shape: ModelShape, autocast: torch.dtype | None) -> torch.dtype:
    """The dtype of the residual stream a layer and the head take in the trainer (bf16 under bf16 autocast):
    an fp32 input would run every norm, residual add and their gradients at twice the bytes."""
    return residual_dtype(shape, autocast or torch.float32)


def time_gemm(g: Gemm, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    a = torch.randn(g.m, g.k, device=device, dtype=dtype)
    b = torch.randn(g.k, g.n, device=device, dtype=dtype)
    return windowed(lambda: torch.mm(a, b), device, repeats)


class Layer:
    """One real transformer layer on one rank, built by the trainer's own builder (compiled as train.compile
    compiles it), and an input: tp 1, or this rank's shard in a TP group (`tp`, with or without sequence
    parallelism: its collectives run), or its chunks of the sequence in a CP group (`cp`: its K/V exchange
    runs). `depth` > 1 stacks that many layers (`flops` stays one layer's): the
    difference between two depths is a layer as the step runs it, without the costs each timed call has once."""

    def __init__(self, shape: ModelShape, micro_batch: int, recompute: str, autocast: torch.dtype | None,
                 device: torch.device, seed: int, tp: TPContext | None = None,
                 compile_with: str | None = None, seq_len: int | None = None, depth: int = 1,
                 cp: CPContext | None = None) -> None:
        tp, cp = tp or TPContext.single(), cp or CPContext.single()
        self.module = build_stage(shape, range(0, depth), first=False, last=False, seed=seed,
                                  ctx=ParallelContext(tp=tp, cp=cp), recompute=recompute, device=device)
        compile_blocks([self.module], compile_with)  # the run's kernels (the windows' warm-up call compiles)
        # shorter: the same kernels on little work (the dispatch floor); CP: this rank's two chunks of it, whose
        # attention exchanges K/V with the group
        seq = (seq_len or shape.seq_len) // cp.size
        tokens = seq // tp.size if tp.sequence_parallel else seq  # SP: this rank's shard
        self.x = torch.randn(micro_batch, tokens, shape.hidden, device=device, dtype=stream_dtype(shape, autocast),
                             requires_grad=True)
        self.grad = torch.randn_like(self.x)
        self.autocast, self.device = autocast, device
        # hardware FLOPs of this rank's forward + backward, by the planner's arithmetic (trainctl.model_shape)
        self.flops = layer_flops_per_token(shape, recompute) * micro_batch * seq

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
           iterations: int, repeats: int = 1) -> tuple[float, float]:
    """(seconds per iteration of `compute` alone, of `compute` then one `collective`), every rank at once.
    The difference is what a collective costs while the other ranks compute: on an oversubscribed CPU
    mostly waiting for a peer that is not on a core, which idle timings of collectives never see. Measured
    `repeats` times as back-to-back pairs (alone, then with the collective) and the median pair's difference
    kept: one pair caught in a burst of the machine's other work is not the rule."""
    compute()
    collective()
    alone, excess = [], []
    for _ in range(repeats):
        pair = []
        for with_collective in (False, True):
            synchronize(device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iterations):
                compute()
                if with_collective:
                    collective()
            synchronize(device)
            pair.append((time.perf_counter() - t0) / iterations)
        alone.append(pair[0])
        excess.append(pair[1] - pair[0])
    base = statistics.median(alone)
    return base, base + statistics.median(excess)


def overlapped(compute: Callable[[], object], start: Callable[[], dist.Work], device: torch.device,
               iterations: int, repeats: int) -> tuple[float, float, float]:
    """(seconds per iteration of `compute` alone, of the collective `start` posts (async_op) alone, of both: the
    collective posted, `compute` run, then waited for), every rank at once: how much of a gradient reduction
    can hide behind a backward, as the trainer posts its buckets. Run `repeats` times as back-to-back triples;
    the medians. On a GPU the collective runs on its own stream beside the kernels; on a CPU gloo's thread
    competes with the compute for the cores."""
    def run(with_compute: bool, with_collective: bool) -> float:
        synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iterations):
            work = start() if with_collective else None
            if with_compute:
                compute()
            if work is not None:
                work.wait()
        synchronize(device)
        return (time.perf_counter() - t0) / iterations

    run(True, True)
    triples = [(run(True, False), run(False, True), run(True, True)) for _ in range(repeats)]
    return tuple(statistics.median(t[i] for t in triples) for i in range(3))  # type: ignore[return-value]


def relayed(compute: Callable[[], object], numel: int, peer: int, first: bool, device: torch.device,
            iterations: int, repeats: int = 1) -> float | None:
    """Seconds of one pipeline hop between two ranks that take turns, as a pipeline's critical path pays it:
    the `first` rank computes and posts its send (isend, as torch.distributed.pipelining does) while its peer
    waits in a receive; the peer wakes, computes and sends back. A round is two computes and two hops; each
    rank's compute is also timed alone while its peer waits for it, and the hop is what a round takes beyond
    the two, halved: the transfer and a receiver woken from a wait for a busy peer, which a ping-pong between
    idle ranks (`ping_pong`) does not see. The median of `repeats`, on the first rank (None on its peer)."""
    out, inp = torch.randn(numel, device=device), torch.empty(numel, device=device)

    def alone() -> float:  # this rank's computes while its peer waits for them, then the peer's turn
        if not first:
            dist.recv(inp, peer)
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(iterations):
            compute()
        synchronize(device)
        mine = time.perf_counter() - t0
        sent = dist.isend(out, peer)
        if first:
            dist.recv(inp, peer)
        sent.wait()
        return mine

    def rounds() -> float:
        t0 = time.perf_counter()
        for _ in range(iterations):
            if first:
                compute()
                sent = dist.isend(out, peer)
                dist.recv(inp, peer)
                sent.wait()
            else:
                dist.recv(inp, peer)
                compute()
                dist.isend(out, peer).wait()
        synchronize(device)
        return time.perf_counter() - t0

    compute()
    rounds()
    hops = []
    for _ in range(repeats):
        theirs = torch.tensor([alone()], dtype=torch.float64, device=device)
        mine = theirs.item()
        if first:
            dist.recv(theirs, peer)
        else:
            dist.send(theirs, peer)
        total = rounds()
        hops.append((total - mine - theirs.item()) / (2 * iterations))
    return max(0.0, statistics.median(hops)) if first else None


class Ends:
    """The model's two ends on one rank (tp 1), built by the trainer's own builder: the embedding stage (token
    lookup) and the last stage's final norm + LM head + the trainer's loss, each forward + backward of one
    micro-batch. With tied embeddings the head stage holds its own copy of the table, as the trainer's last
    stage does when the first is elsewhere."""

    def __init__(self, shape: ModelShape, micro_batch: int, autocast: torch.dtype | None, device: torch.device,
                 seed: int) -> None:
        from trainctl.runtime.model.transformer import loss_fn

        self.first = build_stage(shape, range(0, 0), first=True, last=False, seed=seed, device=device)
        self.last = build_stage(shape, range(0, 0), first=False, last=True, seed=seed, device=device)
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, shape.vocab, (micro_batch, shape.seq_len), generator=g).to(device)
        self.targets = torch.randint(0, shape.vocab, (micro_batch, shape.seq_len), generator=g).to(device)
        self.x = torch.randn(micro_batch, shape.seq_len, shape.hidden, device=device,
                             dtype=stream_dtype(shape, autocast), requires_grad=True)
        self.shape, self.tp, self.loss_fn = shape, TPContext.single(), loss_fn
        self.autocast, self.device = autocast, device

    def _cast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16, enabled=bool(self.autocast))

    def embedding_step(self) -> None:
        with self._cast():
            out = self.first(self.tokens)
        out.backward(torch.ones_like(out))

    def head_step(self) -> None:
        with self._cast():
            loss = self.loss_fn(self.last(self.x), self.targets, self.shape, self.tp)
        loss.backward()


def tensors(module: torch.nn.Module) -> int:
    return sum(1 for _ in module.parameters())


class OptimizerStep:
    """What the trainer does per optimizer step on every tensor it owns, after the backward
    (trainer.train_step): the gradient norm (torch._foreach_norm, divergence.reduce_norm_and_loss), clipping
    (torch._foreach_mul_) and the AdamW step (runtime/train/optim.py `adamw`, the trainer's fused kernel),
    over `shapes`' tensors. Zeroing the gradients is left out: the trainer zeroes flat bucket buffers, one call
    each."""

    def __init__(self, shapes: list[tuple[int, ...]], device: torch.device) -> None:
        from types import SimpleNamespace

        from trainctl.runtime.train.optim import adamw

        self.params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
        for p in self.params:
            p.grad = torch.randn_like(p)
        train = SimpleNamespace(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        self.opt = adamw([(self.params, True)], train)  # type: ignore[arg-type]
        self.elements = sum(p.numel() for p in self.params)

    def step(self) -> None:
        grads = [p.grad for p in self.params]
        torch.stack(torch._foreach_norm(grads)).double().pow(2).sum().item()
        torch._foreach_mul_(grads, 0.999)
        self.opt.step()


def shard_layer(layer: Layer, group: dist.ProcessGroup, members: list[int], device: torch.device) -> None:
    """Make `layer` one FSDP2 unit over `group`, as data_parallel.apply_fsdp shards each block (ZeRO-3),
    gradient reduction off: a micro-batch other than a step's last (schedules.Accumulate), so a step of it
    is the unit's all-gather before forward and again before backward."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type, mesh=torch.tensor(members), mesh_dim_names=("dp",))
    for block in layer.module.layers.values():  # a block under a root: FSDP2 never reshards its root's
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(layer.module, mesh=mesh, reshard_after_forward=True)
    layer.module.set_requires_gradient_sync(False)

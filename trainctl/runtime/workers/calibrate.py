"""`python -m trainctl.runtime.workers.calibrate RUN_DIR`: what every rank runs for `trainctl calibrate`.

Five phases, each run on every rank of the spec's cluster at once (its ranks per node share the node as
in training): (1) GEMMs at the model's shapes for every TP size `plan --auto` may pick, in the precision the
trainer computes in; (2) all-reduce, all-gather, reduce-scatter, send/recv (ping-pong) and all-to-all over
message sizes, in groups inside each node (of 2, 4, ... ranks and of the whole node) and, with several nodes, in
groups of one rank per node; (3) one real layer's forward + backward on each rank, alone, as a TP rank in
TP groups of each size that fits in a node (sequence parallelism off and on) and as a CP rank in CP groups
of each size that fits in a node; (4) a small all-reduce
after each forward of that layer, against the forwards alone: what a collective costs while the other
ranks compute; a pipeline hop between ranks taking turns; and a gradient bucket's all-reduce posted before
the layer's forward + backward, against each alone: how much of the DP reduction hides behind compute;
(5) the work outside the layers (trainctl.plan.calibration.fixed): the embedding, the LM head + loss, the
optimizer step per tensor and per element, and one layer as an FSDP2 unit (ZeRO-3).
Rank 0 gathers every rank's figures, fits them (trainctl.plan.calibration.profile, torch-free) and writes
RUN/calibration.json atomically; `trainctl calibrate` copies it to its --out. Exit status: 0, 1 on a
failure (one line), 2 for a spec error.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from trainctl.model_shape import ModelShape, head_flops_per_token
from trainctl.plan.calibration import profile as prof
from trainctl.plan.calibration.shapes import INTER, INTRA, MESSAGE_BYTES, OPS, bus_bytes, gemms, tp_sizes
from trainctl.plan.memory import dp_bucket_numel
from trainctl.rundir.paths import RunPaths
from trainctl.runtime.parallel.context_parallel import CPContext
from trainctl.runtime.parallel.process_groups import RankEnv
from trainctl.runtime.parallel.tensor_parallel import TPContext
from trainctl.runtime.workers import microbench as mb
from trainctl.runtime.workers.worker_main import worker_main
from trainctl.spec.models import RunSpec

MODULE = "trainctl.runtime.workers.calibrate"
DISPATCH_TOKENS = 64  # the dispatch floor's layer input: every kernel of a layer, each on next to no work
STACK_DEPTH = 2  # on a GPU each layer figure is timed again on this many layers (Calibration._stack)
REPEATS = 3  # timed loops per figure: the median of three is robust to one preempted loop
# a layer figure (and its stack, and the dispatch floor's): five windows of 0.1 s, so a burst of other work on the
# machine in one or two of them does not set it (a host-bound call on a GPU takes 4-20 ms: 3 x 50 ms held few)
LAYER_REPEATS, LAYER_WINDOW_S = 5, 0.1
COLLECTIVE_REPEATS = 15  # timed calls per collective figure, their trimmed mean (microbench.timed, mixed)
LOAD_ITERATIONS = 20  # layer forward (+ all-reduce) iterations of phase 4, REPEATS pairs: ~0.05-0.1 s a mode
OVERLAP_ITERATIONS = 10  # layer forward + backward (+ a bucket's all-reduce) iterations, REPEATS triples
OVERLAP_KEYS = ("compute_s", "collective_s", "together_s")  # microbench.overlapped's figures, in its order

Group = tuple[str, int, Any, list[int]]  # (link class, group size, this rank's process group, its members)


def autocast_dtype(spec: RunSpec, device: torch.device) -> torch.dtype | None:
    """The compute dtype the trainer autocasts to (Trainer._precision): none for fp32, and none on a CPU
    unless train.low_precision_on_cpu."""
    prec = spec.train.precision
    if prec == "fp32" or (device.type != "cuda" and not spec.train.low_precision_on_cpu):
        return None
    return torch.float16 if prec == "fp16" else torch.bfloat16  # fp8: its GEMMs are priced from bf16's


class Calibration:
    def __init__(self, spec: RunSpec, env: RankEnv, device: torch.device) -> None:
        self.spec, self.env, self.device = spec, env, device
        self.shape = ModelShape.from_spec(spec.model)
        self.nodes, self.per_node = spec.cluster.nodes, spec.cluster.gpus_per_node
        self.autocast = autocast_dtype(spec, device)
        self.tokens = spec.parallel.micro_batch * self.shape.seq_len
        self.t0 = time.perf_counter()
        self.groups_made: list[Group] = []
        self.layer: mb.Layer | None = None

    def say(self, text: str) -> None:
        if self.env.rank == 0:
            print(f"calibrate: {text}", flush=True)

    def gather(self, mine: list[float | None]) -> list[list[float | None]]:
        every: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(every, mine)
        return every

    def run(self) -> dict[str, Any] | None:
        peak, source = self.peak()
        where = f"{self.device_name()}, {self.env.world_size} ranks ({self.per_node} per node), {self.precision()}"
        self.say(f"{where}; peak {peak / 1e12:.3g} TFLOP/s per rank ({source})" if peak else where)
        raw = {"matmul": self.phase("1/5", self.matmul), "collectives": self.phase("2/5", self.collectives),
               "layer": self.phase("3/5", self.time_layer), **self.phase("4/5", self.under_load),
               "fixed": self.phase("5/5", self.fixed_work)}
        if self.env.rank != 0:
            return None
        meta = {**prof.spec_meta(self.spec), "precision": self.precision(), "peak_flops_per_rank": peak,
                "peak_source": source, "device": {"type": self.device.type, "name": self.device_name(),
                                                  "threads_per_rank": torch.get_num_threads()},
                "repeats": REPEATS, "elapsed_s": round(time.perf_counter() - self.t0, 3)}
        return prof.build(meta, raw)

    def phase(self, n: str, body: Callable[[], tuple[Any, str]]) -> Any:
        t0 = time.perf_counter()
        out, what = body()
        self.say(f"[{n}] {what} in {time.perf_counter() - t0:.1f} s")
        return out

    def precision(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.autocast]

    def device_name(self) -> str:
        from trainctl.runtime.observe.peak import cpu_model, gpu_product_name

        if self.device.type == "cuda":
            return gpu_product_name(self.env.local_rank) or "cuda"
        return cpu_model()

    def peak(self) -> tuple[float | None, str | None]:
        """The peak the trainer's MFU divides by, measured on rank 0 while the others wait (uncontended, as
        trainctl/runtime/observe/peak.py caches it)."""
        from trainctl.runtime.observe.peak import peak_flops_per_rank

        out: list[Any] = [None, None]
        if self.env.rank == 0:
            try:
                out = list(peak_flops_per_rank(self.spec, self.device))
            except RuntimeError as e:  # a GPU without a catalog peak: the profile then has none
                out = [None, str(e)]
        dist.broadcast_object_list(out, src=0)
        return out[0], out[1]

    # --- (1) GEMMs ---------------------------------------------------------------------------------------
    def matmul(self) -> tuple[list[dict[str, Any]], str]:
        rows, dtype = [], self.autocast or torch.float32
        tps = tp_sizes(self.spec)
        for tp in tps:
            for g in gemms(self.shape, self.tokens, tp):
                dist.barrier()
                rows.append({"name": g.name, "tp": tp, "m": g.m, "k": g.k, "n": g.n, "flops": g.flops,
                             "seconds": mb.time_gemm(g, dtype, self.device, REPEATS)})
        self._spread(rows)
        return rows, f"matmul: {len(rows) // len(tps)} GEMM shapes x tp {'/'.join(map(str, tps))}"

    def _spread(self, rows: list[dict[str, Any]]) -> None:
        """Replace each row's own seconds by every rank's (None where a rank had no part)."""
        every = self.gather([r["seconds"] for r in rows])
        for i, r in enumerate(rows):
            r["seconds"] = [ranks[i] for ranks in every if ranks[i] is not None]

    # --- (2) collectives ---------------------------------------------------------------------------------
    def groups(self) -> list[Group]:
        """Groups of every power of 2 and of the whole node inside every node (several sizes: each kind's
        latency is fitted against its steps at n, plan/calibration/fit.py); one rank per node across nodes.
        Every rank creates every group (new_group is collective); all groups of a size then run at once."""
        out: list[Group] = []
        nodes, per = self.nodes, self.per_node
        for size in sorted({1 << k for k in range(1, per.bit_length())} | {per}):
            if size < 2 or per % size:
                continue
            lists = [[node * per + i for i in range(start, start + size)]
                     for node in range(nodes) for start in range(0, per, size)]
            out.append((INTRA, size, *self._subgroup(lists)))
        if nodes > 1:
            out.append((INTER, nodes, *self._subgroup([[n * per + i for n in range(nodes)] for i in range(per)])))
        return out

    def _subgroup(self, lists: list[list[int]]) -> tuple[Any, list[int]]:
        mine, _ = dist.new_subgroups_by_enumeration(lists)
        return mine, next(g for g in lists if self.env.rank in g)

    def collectives(self) -> tuple[list[dict[str, Any]], str]:
        rows: list[dict[str, Any]] = []
        groups = self.groups_made = self.groups()
        paired: set[str] = set()
        for link, n, group, members in groups:
            for op in OPS:
                if op == "send_recv" and link in paired:
                    continue  # a pair is a pair whatever group it was drawn from
                for nbytes in MESSAGE_BYTES:
                    numel = mb.fp32_numel(nbytes, n)
                    dist.barrier()
                    size = 2 if op == "send_recv" else n
                    rows.append({"op": op, "link": link, "group_size": size, "bytes": numel * 4,
                                 "bus_bytes": bus_bytes(op, numel * 4, size),
                                 "seconds": self._time_collective(op, numel, group, n, members)})
            paired.add(link)
        self._spread(rows)
        kinds = ", ".join(f"{link.replace('_', '-')} groups of {n}" for link, n, _, _ in groups)
        return rows, f"collectives: {len(OPS)} ops x {len(MESSAGE_BYTES)} sizes ({kinds or 'none: one rank'})"

    def under_load(self) -> tuple[dict[str, list[dict[str, Any]]], str]:
        """In the smallest group of each link class: the smallest all-reduce after each forward of the layer
        (about the work between two TP collectives) against the forwards alone; a pipeline hop: pairs of ranks
        taking turns to run the forward and send it on (microbench.relayed) ("load"); and a gradient bucket's
        all-reduce posted before the layer's forward + backward, against each alone: how much of the DP
        reduction hides behind the backward ("overlap", microbench.overlapped)."""
        assert self.layer is not None, "time_layer runs first"
        rows, overlap, seen = [], [], set()
        for link, n, group, members in self.groups_made:
            if link in seen:
                continue
            seen.add(link)
            numel = mb.fp32_numel(MESSAGE_BYTES[0], n)
            call = mb.collective_call("all_reduce", numel, group, n, self.device)
            alone, mixed = mb.loaded(self.layer.forward, call, self.device, LOAD_ITERATIONS, REPEATS)
            rows.append({"op": "all_reduce", "link": link, "group_size": n, "bytes": numel * 4,
                         "bus_bytes": bus_bytes("all_reduce", numel * 4, n), "mine": mixed - alone})
            i, pair_numel = members.index(self.env.rank), mb.fp32_numel(MESSAGE_BYTES[0], 2)
            dist.barrier()
            hop = (None if i // 2 * 2 + 1 >= len(members)  # the odd one out
                   else mb.relayed(self.layer.forward, pair_numel, members[i ^ 1], i % 2 == 0, self.device,
                                   LOAD_ITERATIONS, REPEATS))
            rows.append({"op": "send_recv", "link": link, "group_size": 2, "bytes": pair_numel * 4,
                         "bus_bytes": bus_bytes("send_recv", pair_numel * 4, 2), "mine": hop})
            overlap.append({"link": link, "group_size": n, **self._overlap(group, n)})
        every = self.gather([r.pop("mine") for r in rows] + [r.pop("mine") for r in overlap])
        for i, r in enumerate(rows):
            r["seconds"] = [ranks[i] for ranks in every if ranks[i] is not None]
        for i, r in enumerate(overlap, start=len(rows)):
            r.update({key: [ranks[i][k] for ranks in every] for k, key in enumerate(OVERLAP_KEYS)})
        return {"load": rows, "overlap": overlap}, (
            f"all-reduce after each layer forward, a pipeline hop between forwards and a gradient bucket's "
            f"all-reduce behind a forward + backward, {REPEATS} x {LOAD_ITERATIONS} iterations (" +
            ", ".join(f"{r['link'].replace('_', '-')} groups of {r['group_size']}" for r in rows
                      if r["op"] == "all_reduce") + ")")

    def _overlap(self, group: Any, n: int) -> dict[str, Any]:
        """A DP gradient bucket's all-reduce (the layer's gradients, at most one trainer bucket) posted before
        the layer's forward + backward, every rank at once: this rank's (compute, collective, both) seconds."""
        assert self.layer is not None
        grads = sum(p.numel() for p in self.layer.module.parameters())
        numel = mb.fp32_numel(4 * min(grads, dp_bucket_numel()), n)
        bucket = torch.randn(numel, device=self.device)
        dist.barrier()
        mine = mb.overlapped(self.layer.step, lambda: dist.all_reduce(bucket, group=group, async_op=True),
                             self.device, OVERLAP_ITERATIONS, REPEATS)
        return {"bytes": numel * 4, "mine": list(mine)}

    def _time_collective(self, op: str, numel: int, group: Any, n: int, members: list[int]) -> float | None:
        if op != "send_recv":
            return mb.timed(mb.collective_call(op, numel, group, n, self.device), self.device, COLLECTIVE_REPEATS,
                            mixed=True)
        i = members.index(self.env.rank)
        if i // 2 * 2 + 1 >= len(members):
            return None  # the odd one out
        peer = members[i ^ 1]
        call = mb.ping_pong(numel, peer, first=i % 2 == 0, device=self.device)
        seconds = mb.timed(call, self.device, COLLECTIVE_REPEATS, mixed=True) / 2
        return seconds if i % 2 == 0 else None

    # --- (3) one layer -----------------------------------------------------------------------------------
    def time_layer(self) -> tuple[dict[str, Any], str]:
        dist.barrier()
        recompute, micro_batch = self.spec.train.recompute, self.spec.parallel.micro_batch

        def layer(depth: int) -> mb.Layer:
            return mb.Layer(self.shape, micro_batch, recompute, self.autocast, self.device, self.spec.train.seed,
                            compile_with=self.spec.train.compile_with, depth=depth)

        self.layer = layer(1)
        seconds = mb.windowed(self.layer.step, self.device, LAYER_REPEATS, window_s=LAYER_WINDOW_S)
        stack = self._stack(layer)
        tp_rows, cp_rows = self._tp_layers(), self._cp_layers()
        modes, floors, floor_stacks = self._dispatch_floor()
        every = self.gather([seconds, stack, *[r["seconds"] for r in tp_rows + cp_rows], *floors, *floor_stacks])

        def column(i: int) -> list[float | None]:
            return [ranks[i] for ranks in every]

        for i, r in enumerate(tp_rows + cp_rows, start=2):
            r["seconds"] = column(i)
        mine = [x for x in column(0) if x is not None]
        first = 2 + len(tp_rows) + len(cp_rows)
        out: dict[str, Any] = {
            "recompute": recompute, "tokens": self.tokens, "flops": self.layer.flops, "seconds": mine, "tp": tp_rows,
            "cp": cp_rows, "dispatch_tokens": DISPATCH_TOKENS,
            "dispatch": {mode: column(first + i) for i, mode in enumerate(modes)}}
        if self.device.type == "cuda":
            out["stack"] = {"depth": STACK_DEPTH, "seconds": column(1),
                            "dispatch": {mode: column(first + len(modes) + i) for i, mode in enumerate(modes)}}
        sizes = sorted({r["tp"] for r in tp_rows})
        also = f"; tp {'/'.join(map(str, sizes))} with SP off and on in TP groups" if sizes else ""
        also += f"; cp {'/'.join(str(r['cp']) for r in cp_rows)} in CP groups" if cp_rows else ""
        return out, (f"layer forward+backward (tp 1, micro-batch {micro_batch}, recompute {recompute}): "
                     f"{statistics.median(mine) * 1e3:.2f} ms median over ranks{also}")

    def _stack(self, layer: Callable[[int], mb.Layer]) -> float | None:
        """On a GPU, seconds per call of STACK_DEPTH of the layers `layer(depth)` builds: its difference from
        one layer is a layer without what each timed call pays once (the backward's start, the wait at the
        synchronize for the last kernels), which the step pays once for all its layers. None on a CPU (those
        costs are a small part of a layer there, and a difference would double the noise) and where the stack
        does not fit in memory."""
        if self.device.type != "cuda":
            return None
        try:
            return mb.windowed(layer(STACK_DEPTH).step, self.device, LAYER_REPEATS, window_s=LAYER_WINDOW_S)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return None

    def _dispatch_floor(self) -> tuple[list[str], list[float], list[float | None]]:
        """The layer's forward + backward on a micro-batch of DISPATCH_TOKENS tokens, per recompute mode (alone
        and as a stack: `_stack`): its kernels on next to no work, so on a GPU the time the host takes to issue
        them. A layer cannot run faster than that however small its work (profile: fits.layer.dispatch_s).
        Compiled, only the spec's own mode (each mode would compile again). Not on a CPU: it runs what it
        issues, so the layer's measured rate holds its dispatch already and the plan charges no floor there."""
        if self.device.type != "cuda":
            return [], [], []
        modes = [self.spec.train.recompute] if self.spec.train.compile_with else ["none", "selective", "full"]
        seq = min(DISPATCH_TOKENS, self.shape.seq_len)
        one, stacks = [], []
        for mode in modes:
            def layer(depth: int, mode: str = mode) -> mb.Layer:
                return mb.Layer(self.shape, 1, mode, self.autocast, self.device, self.spec.train.seed,
                                compile_with=self.spec.train.compile_with, seq_len=seq, depth=depth)

            one.append(mb.windowed(layer(1).step, self.device, LAYER_REPEATS, window_s=LAYER_WINDOW_S))
            stacks.append(self._stack(layer))
        return modes, one, stacks

    def _tp_layers(self) -> list[dict[str, Any]]:
        """The same layer as this rank's shard at every TP size > 1 that fits in a node, in groups of
        consecutive ranks (the placement's TP groups), sequence parallelism off and on: the trainer's own TP
        collectives, with the other groups of the node running at once."""
        rows = []
        for tp in tp_sizes(self.spec):
            if tp == 1 or self.per_node % tp or self.shape.seq_len % tp:
                continue
            group = self._consecutive_group(tp)
            for sp in (False, True):
                rows.append({"tp": tp, "sequence_parallel": sp,
                             "seconds": self._layer_in_group(tp=TPContext.from_group(group, sp))})
        return rows

    def _cp_layers(self) -> list[dict[str, Any]]:
        """The same layer on this rank's two chunks of the sequence at every CP size inside a node that the spec
        rules allow for the model (a power of 2 splitting the sequence into 2 x cp chunks; no MoE, no dropout),
        in groups of consecutive ranks: its attention's K/V exchange, the chunked attention and their waits,
        with the other groups of the node running at once."""
        m = self.spec.model
        if m.moe is not None or m.dropout:
            return []
        rows = []
        for cp in (1 << k for k in range(1, self.per_node.bit_length())):
            if self.per_node % cp or self.shape.seq_len % (2 * cp):
                continue
            group = self._consecutive_group(cp)
            rows.append({"cp": cp, "seconds": self._layer_in_group(cp=CPContext.from_group(group))})
        return rows

    def _consecutive_group(self, size: int) -> Any:
        """This rank's group of `size` consecutive ranks (the placement's TP and CP groups); every rank calls it."""
        return self._subgroup([list(range(start, start + size)) for start in range(0, self.env.world_size, size)])[0]

    def _layer_in_group(self, **parallel: Any) -> float:
        """Seconds per forward + backward of the run's layer as a rank of the group in `parallel` (tp= or cp=, a
        TPContext or CPContext), every group of the node at once."""
        layer = mb.Layer(self.shape, self.spec.parallel.micro_batch, self.spec.train.recompute, self.autocast,
                         self.device, self.spec.train.seed, compile_with=self.spec.train.compile_with, **parallel)
        return mb.windowed_collective(layer.step, self.device, REPEATS, window_s=2 * mb.WINDOW_S)

    # --- (5) the work outside the layers -------------------------------------------------------------------
    def fixed_work(self) -> tuple[dict[str, Any], str]:
        assert self.layer is not None, "time_layer runs first"
        dist.barrier()
        micro_batch, seed = self.spec.parallel.micro_batch, self.spec.train.seed
        ends = mb.Ends(self.shape, micro_batch, self.autocast, self.device, seed)
        mine: list[float | None] = [mb.windowed(ends.embedding_step, self.device, REPEATS),
                                    mb.windowed(ends.head_step, self.device, REPEATS)]
        shapes = [tuple(p.shape) for p in self.layer.module.parameters()]
        n = sum(math.prod(s) for s in shapes)
        opts = [(len(shapes), n, shapes), (1, n, [(n,)]), (1, 4 * n, [(4 * n,)])]
        # the device's step as the trainer takes it (an offloaded host step is priced by estimate.host_adam_gbps)
        for _, _, tensor_shapes in opts:
            mine.append(mb.windowed(mb.OptimizerStep(tensor_shapes, self.device).step, self.device, REPEATS))
        fsdp = self._fsdp_unit(mine)
        every = self.gather(mine)
        col = [[ranks[i] for ranks in every if ranks[i] is not None] for i in range(len(mine))]
        raw: dict[str, Any] = {
            "micro_batch": micro_batch, "embedding_s": col[0], "head_s": col[1],
            "head_flops": head_flops_per_token(self.shape, self.shape.padded_vocab(1)) * self.tokens,
            "tensors": {"layer": len(shapes), "embedding": mb.tensors(ends.first), "head": mb.tensors(ends.last)},
            "optimizer": [{"tensors": k, "elements": e, "seconds": col[2 + i]} for i, (k, e, _) in enumerate(opts)],
        }
        if fsdp is not None:
            raw["fsdp"] = {**fsdp, "plain_s": col[5], "sharded_s": col[6]}
        where = f"; a layer as an FSDP2 unit over {fsdp['group_size']} ranks" if fsdp else ""
        return raw, f"embedding, LM head + loss, optimizer step per tensor and element{where}"

    def _fsdp_unit(self, mine: list[float | None]) -> dict[str, Any] | None:
        """One layer's forward + backward as an FSDP2 unit in the smallest group (every rank at once), and the
        plain layer again beside it (the same moment's load); appended to `mine`. None with one rank."""
        if not self.groups_made:
            return None
        link, n, group, members = self.groups_made[0]
        assert self.layer is not None
        unit = mb.Layer(self.shape, self.spec.parallel.micro_batch, self.spec.train.recompute, self.autocast,
                        self.device, self.spec.train.seed, compile_with=self.spec.train.compile_with)
        nbytes = sum(p.numel() * p.element_size() for p in unit.module.parameters())
        mb.shard_layer(unit, group, members, self.device)
        mine.append(mb.windowed(self.layer.step, self.device, REPEATS, window_s=2 * mb.WINDOW_S))
        mine.append(mb.windowed_collective(unit.step, self.device, REPEATS, window_s=2 * mb.WINDOW_S))
        return {"link": link, "group_size": n, "unit_bytes": nbytes}


def _calibrate(spec: RunSpec, env: RankEnv, device: torch.device, paths: RunPaths) -> None:
    result = Calibration(spec, env, device).run()
    if result is not None:
        prof.save(paths.calibration, result)
        print(f"calibrate: fits: {prof.summary(result)}", flush=True)


def main(argv: list[str] | None = None) -> NoReturn:
    worker_main(MODULE, "calibrate", _calibrate, argv)


if __name__ == "__main__":
    main()

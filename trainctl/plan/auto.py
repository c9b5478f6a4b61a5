"""`trainctl plan --auto`: search every valid layout for the spec's model and cluster.

Enumerated: tp (divides heads, kv_heads and the world; inside the NVLink domain unless the spec allows
otherwise), for long sequences (LONG_SEQUENCE tokens and more) cp (powers of two that divide world/tp and
split the sequence into 2*cp chunks, leaving each rank at least MIN_CP_TOKENS tokens; a dense model without
dropout), pp (divides world/(tp*cp), at most one stage per layer), dp = world/(tp*cp*pp) (global batch
divisible by micro_batch*dp), for an MoE model ep (divides dp and the number of experts), micro_batch,
schedule 1f1b, interleaved with every virtual_stages v >= 2 that leaves each model chunk a layer, or
zero-bubble with v = 1 or those v (both need micro-batches divisible by pp), zbv (v = 2, a layer per
stage), ZeRO 0-3 (1-3 also with the
optimizer offloaded to host memory, which fits where the GPU alone does not and costs the copies and the CPU
step; a layout whose offloaded state exceeds the node's host memory does not fit), recompute
none/selective/full: the rules of trainctl/spec/rules.py, applied to plain integers. Fixed: sequence
parallelism is on whenever tp > 1 and the sequence divides (it only saves memory, at the same TP
volume), GPipe is left out (1F1B has the same bubble with less memory), stages split by the default
balanced split. Each layout is evaluated with the same Evaluator as `trainctl plan`; the ones that do
not fit are dropped, the rest ranked by predicted MFU (ties: less memory per GPU). Only the winners
shown are turned into RunSpecs and validated by trainctl.spec.validate_spec, so a shown layout is
always one `trainctl plan` accepts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from trainctl.errors import SpecError
from trainctl.plan.checks import advise
from trainctl.plan.comm import tp_link
from trainctl.plan.comm_levers import Lever, Levers
from trainctl.plan.estimate import Candidate, Context, Estimate, Evaluator
from trainctl.plan.plan import context_from_spec, priced_with
from trainctl.plan.rates import describe
from trainctl.spec.loader import validate_spec
from trainctl.spec.models import RunSpec

RECOMPUTE = ("none", "selective", "full")
# (ZeRO stage, optimizer offloaded) in enumeration order; offload moves nothing without a sharded optimizer
ZERO_VARIANTS = ((0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True))
LONG_SEQUENCE = 32_768  # context parallelism is searched from here (long-context training: 32K-1M tokens)
MIN_CP_TOKENS = 4_096  # tokens per CP rank below which the K/V exchange outweighs what CP saves
NOMINAL_PEAK = 1e12  # FLOP/s used to rank layouts when the peak is unknown (CPU); times are then relative


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass
class Scored:
    est: Estimate
    mfu: float  # predicted MFU (relative, with the nominal peak, when the peak is unknown)

    @property
    def cand(self) -> Candidate:
        return self.est.cand


@dataclass
class AutoResult:
    name: str
    world: int
    evaluated: int
    fitting: int
    top: list[tuple[Scored, RunSpec, list[str]]]  # (estimate, validated spec, warning codes)
    rejected: list[tuple[Scored, str]]  # best-looking layouts that do not fit, and why
    skipped: dict[str, int]  # combinations left out by a rule, per rule
    invalid: list[tuple[Candidate, str]]  # enumerated but refused by validate_spec: a bug if non-empty
    peak_known: bool
    elapsed_s: float
    assumptions: dict[str, float] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)  # where the times come from (plan/rates.py)
    levers: dict[int, list[Lever]] = field(default_factory=dict)  # index in top -> bf16 / PowerSGD savings
    # the fastest layout with bf16 reduction or PowerSGD, when it beats the best layout without them
    pulled: tuple[Scored, Lever] | None = None

    def to_json(self) -> dict[str, Any]:
        def row(s: Scored) -> dict[str, Any]:
            c, e = s.cand, s.est
            return {
                "tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": c.dp, "ep": c.ep, "virtual_stages": c.virtual_stages,
                "zero": c.zero, "offload": "optimizer" if c.offload else "none",
                "offload_s": e.offload_copy_time + e.offload_step_time, "host_per_node": e.host_per_node,
                "micro_batch": c.micro_batch, "micro_batches": e.micro_batches, "schedule": c.schedule,
                "sequence_parallel": c.sequence_parallel, "recompute": c.recompute,
                "mfu": s.mfu if self.peak_known else None,
                "step_time_s": e.step_time if self.peak_known else None,
                "tokens_per_s": e.tokens_per_s if self.peak_known else None,
                "memory_total": e.memory_total, "capacity": e.capacity, "headroom_fraction": e.headroom_fraction,
                "bubble_fraction": e.bubble_fraction, "stage_layers": list(e.stage_layers),
            }

        return {
            "name": self.name, "world_size": self.world, "evaluated": self.evaluated, "fitting": self.fitting,
            "ranking": "predicted MFU, descending; ties: less memory per GPU",
            "peak_known": self.peak_known,
            "top": [{**row(s), "warnings": codes,
                     "comm_levers": [x.as_dict(s.est.step_time or 0.0) for x in self.levers.get(i, [])]}
                    for i, (s, _, codes) in enumerate(self.top)],
            "rejected": [{**row(s), "reason": why} for s, why in self.rejected],
            "skipped": self.skipped,
            "invalid": [{"layout": c.describe(), "error": err} for c, err in self.invalid],
            "assumptions": self.assumptions,
            "calibration": self.calibration,
            "elapsed_s": self.elapsed_s,
            "comm_lever_layout": None if self.pulled is None else {
                **row(self.pulled[0]), **self.pulled[1].as_dict(self.pulled[0].est.step_time or 0.0)},
        }


def enumerate_candidates(spec: RunSpec, skipped: dict[str, int]) -> list[Candidate]:
    """Every layout the spec rules accept for this model and cluster (see the module docstring)."""
    return [c for shape in enumerate_shapes(spec, skipped) for c in zero_variants(shape)]


def zero_stages(shape: Candidate) -> list[tuple[int, bool]]:
    """(ZeRO stage, offload) of one layout shape's candidates: offload only where the optimizer is sharded
    (dp x cp > 1)."""
    sharded = shape.dp * shape.cp > 1
    return [(zero, off) for zero, off in ZERO_VARIANTS if sharded or not off]


def zero_variants(shape: Candidate) -> list[Candidate]:
    """The candidates of one layout shape (a ZeRO-0 Candidate), in enumeration order. Built from the shape's
    fields: dataclasses.replace costs half as much again, and a sweep builds tens of thousands."""
    fields = vars(shape)
    return [Candidate(**{**fields, "zero": zero, "offload": off}) for zero, off in zero_stages(shape)]


def enumerate_shapes(spec: RunSpec, skipped: dict[str, int]) -> list[Candidate]:
    """enumerate_candidates' layouts without their ZeRO/offload variants (each as ZeRO-0), in the same order:
    every search floor ignores those two, so the pruned search builds a variant only when it scores it."""
    m, c = spec.model, spec.cluster
    world = c.world_size
    kv = m.kv_heads or m.heads
    from trainctl.plan.placement import Layout

    domain = Layout.from_spec(spec).nvlink_domain
    allow = spec.parallel.allow_tp_across_nodes

    def skip(reason: str, n: int = 1) -> None:
        skipped[reason] = skipped.get(reason, 0) + n

    out: list[Candidate] = []
    for tp in divisors(world):
        if m.heads % tp or kv % tp or (m.moe is not None and (m.moe.expert_ffn_hidden or 0) % tp):
            skip("tp does not divide heads, kv_heads (and the expert FFN)")
            continue
        if not allow and tp_link(tp, world, domain) != "nvlink":
            skip("tp larger than the NVLink domain (parallel.allow_tp_across_nodes is off)")
            continue
        for cp in context_parallel_sizes(spec, world // tp, skip):
            sp = tp > 1 and m.seq_len % (tp * cp) == 0
            out += _with_tp_cp(spec, world, tp, cp, sp, skip)
    return out


def max_world(spec: RunSpec) -> tuple[int, str]:
    """(The most GPUs any layout enumerate_shapes gives this spec's model and batch, why): tp divides heads and
    kv_heads (and the expert FFN), cp is at most the largest size context_parallel_sizes allows, and dp x pp is
    at most global_batch (dp divides it, and pp > 1 needs at least pp micro-batches of dp sequences). A bound,
    not a count: on more GPUs no layout exists, so a node sweep need not enumerate them."""
    m, gb = spec.model, spec.train.global_batch
    tp = math.gcd(m.heads, m.kv_heads or m.heads, (m.moe.expert_ffn_hidden or 0) if m.moe is not None else 0)
    # a power of two above the sequence: world/tp divisible by every cp the sequence allows
    cp = max(context_parallel_sizes(spec, 1 << m.seq_len.bit_length(), lambda _: None))
    why = (f"tp divides heads and kv_heads{' and the expert FFN' if m.moe is not None else ''} (at most {tp}), "
           f"{f'cp is at most {cp}, ' if cp > 1 else ''}and dp x pp is at most global_batch {gb}")
    return tp * cp * gb, why


def context_parallel_sizes(spec: RunSpec, ranks: int, skip: Callable[[str], None]) -> list[int]:
    """cp values to search with `ranks` = world/tp GPUs left: 1, and for a long sequence the powers of two
    that the rules accept and that leave each rank MIN_CP_TOKENS tokens or more."""
    m = spec.model
    if m.seq_len < LONG_SEQUENCE or m.moe is not None or m.dropout:
        return [1]
    out = [1]
    cp = 2
    while cp <= ranks and m.seq_len // cp >= MIN_CP_TOKENS:
        if ranks % cp == 0 and m.seq_len % (2 * cp) == 0:
            out.append(cp)
        else:
            skip("cp does not divide world/tp or split the sequence into 2*cp chunks")
        cp *= 2
    return out


def _with_tp_cp(spec: RunSpec, world: int, tp: int, cp: int, sp: bool, skip: Callable[[str], None]
                ) -> list[Candidate]:
    """Every (pp, dp, ep, micro-batch, schedule, recompute) for one tp and cp, as ZeRO-0 shapes."""
    m, gb = spec.model, spec.train.global_batch
    out: list[Candidate] = []
    for pp in divisors(world // (tp * cp)):
        if pp > m.layers:
            skip("pp above the number of layers")
            continue
        dp = world // (tp * cp * pp)
        if gb % dp:
            skip("global_batch not divisible by dp")
            continue
        eps = [1] if m.moe is None else [e for e in divisors(dp) if m.moe.num_experts % e == 0]
        for ep, mb in ((e, b) for e in eps for b in divisors(gb // dp)):
            n_micro = gb // (mb * dp)
            if pp > 1 and n_micro < pp:
                skip("fewer micro-batches than pp")
                continue
            schedules = [("1f1b", 1)]
            if pp > 1 and n_micro % pp == 0:
                chunks = range(2, m.layers // pp + 1)
                schedules += [("interleaved", v) for v in chunks]
                schedules += [("zero-bubble", v) for v in (1, *chunks)]
            elif pp > 1:
                skip("interleaved: micro-batches not divisible by pp")
            if pp > 1 and 2 * pp <= m.layers:  # ZBV: two stages per rank, any micro-batch count >= pp
                schedules.append(("zbv", 2))
            out += [Candidate(tp=tp, pp=pp, dp=dp, micro_batch=mb, recompute=rec, sequence_parallel=sp, schedule=sched,
                              virtual_stages=v, ep=ep, cp=cp) for sched, v in schedules for rec in RECOMPUTE]
    return out


def _spec_for(spec: RunSpec, c: Candidate, base: dict[str, Any]) -> RunSpec:
    data = dict(base)
    data["parallel"] = {
        **base["parallel"], "tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": c.dp, "ep": c.ep, "zero": c.zero,
        "offload": "optimizer" if c.offload else "none",
        "micro_batch": c.micro_batch,
        "sequence_parallel": c.sequence_parallel, "schedule": c.schedule, "virtual_stages": c.virtual_stages,
        "stage_layers": None,
    }
    if c.zero >= 2:  # PowerSGD replaces the ZeRO-0/1 all-reduce only (a spec rule)
        data["parallel"]["grad_compression"] = None
    data["train"] = {**base["train"], "recompute": c.recompute}
    return validate_spec(data, f"{spec.name} (--auto)")


def _oom_reason(e: Estimate) -> str:
    w = e.worst
    gb = 1e9
    if not e.host_fits:
        return (f"offloaded optimizer state needs {e.host_per_node / gb:.1f} GB of host memory per node > "
                f"{(e.host_capacity or 0) / gb:.1f} GB")
    return (f"needs {w.total / gb:.1f} GB > {(e.capacity or 0) / gb:.1f} GB on pipeline rank {w.pp_rank} "
            f"(weights {w.weights / gb:.1f}, grads {w.gradients / gb:.1f}, optimizer {w.optimizer / gb:.1f}, "
            f"activations {w.activations / gb:.1f}, transient {w.transient / gb:.1f})")


def _distinct(ranked: list[tuple[float, float, Candidate]], n: int) -> list[tuple[float, float, Candidate]]:
    """The best of each (tp, cp, pp, ep, micro_batch, recompute, schedule): near-duplicates that differ only in
    ZeRO stage or number of chunks would otherwise fill the list with one lesson."""
    seen, out = set(), []
    for s in ranked:
        c = s[2]
        key = (c.tp, c.cp, c.pp, c.ep, c.micro_batch, c.recompute, c.schedule)
        if key not in seen:
            seen.add(key)
            out.append(s)
            if len(out) >= n:
                break
    return out


def search_context(spec: RunSpec) -> tuple[Context, bool]:
    """The context the search ranks with, and whether the peak is known (if not, NOMINAL_PEAK stands in)."""
    ctx = context_from_spec(spec)
    if ctx.hw.peak_flops is not None:
        return ctx, True
    return replace(ctx, hw=replace(ctx.hw, peak_flops=NOMINAL_PEAK)), False


def _order(row: tuple[float, float, Candidate], tight: float) -> tuple[bool, float, float]:
    """The ranking of fitting layouts: under 10% headroom last, then MFU descending, then memory ascending
    (`row` = (-MFU rounded to 12 digits, bytes per GPU, layout)); a stable sort keeps enumeration order on ties."""
    return row[1] > tight, row[0], row[1]


def best_layout(spec: RunSpec, ev: Evaluator, shapes: list[Candidate] | None = None
                ) -> tuple[Scored | None, int]:
    """search(spec)'s first fitting layout without scoring every candidate: (its estimate, candidates scored).

    Works on layout shapes (enumerate_shapes), building a shape's ZeRO/offload variants only when it scores
    them. Shapes whose activations alone exceed the GPU (Evaluator.memory_floor) are not scored; the rest are
    scored in order of their step floor (Evaluator.step_floor; both floors ignore ZeRO and offload); once a
    comfortable (headroom >= 10%) layout has step S, every candidate whose floor is above S has a lower MFU and
    ranks below it, so the rest are skipped. The margin of 1e-9 keeps the rounded MFU of a skipped layout
    strictly below the best's. Ties are broken as search's stable sort does, by enumeration order: (shape,
    variant). A variant that does not fit is not priced (Evaluator.score_fitting). `ev` is
    search_context(spec)'s."""
    shapes = enumerate_shapes(spec, {}) if shapes is None else shapes
    ctx = ev.ctx
    capacity = ctx.hw.usable_bytes
    tight = 0.9 * capacity if capacity is not None else float("inf")
    model_flops = ev.model_flops_per_token * ev.tokens_per_step
    denom = ctx.world * (ctx.hw.peak_flops or NOMINAL_PEAK)
    best: tuple[tuple[tuple[bool, float, float], int, int], Candidate] | None = None  # (rank key, layout)
    comfortable_step = float("inf")  # the fastest comfortable layout's step so far
    scored = 0
    for floor, k in sorted((ev.step_floor(shape) or 0.0, k) for k, shape in enumerate(shapes)):
        if floor > comfortable_step * (1 + 1e-9):
            break
        if capacity is not None and ev.memory_floor(shapes[k]) > capacity:
            continue
        for j, c in enumerate(zero_variants(shapes[k])):
            if floor > comfortable_step * (1 + 1e-9):
                break
            scored += 1
            fitting = ev.score_fitting(c, capacity)
            if fitting is None:
                continue
            step, mem = fitting
            mfu = model_flops / (step * denom) if step else 0.0
            key = (_order((-round(mfu, 12), mem, c), tight), k, j)
            if best is None or key < best[0]:
                best = (key, c)
            if mem <= tight and step is not None:
                comfortable_step = min(comfortable_step, step)
    if best is None:
        return None, scored
    (order, _, _), c = best
    return Scored(ev.evaluate(c, detail=False), -order[1]), scored


def search(spec: RunSpec, top: int = 10, rejected: int = 5) -> AutoResult:
    t0 = time.perf_counter()
    ctx, peak_known = search_context(spec)
    ev = Evaluator(ctx)
    skipped: dict[str, int] = {}
    cands = enumerate_candidates(spec, skipped)

    fitting: list[Scored] = []
    oom: list[Scored] = []
    denom = ctx.world * (ctx.hw.peak_flops or NOMINAL_PEAK)
    capacity = ctx.hw.usable_bytes
    model_flops = ev.model_flops_per_token * ev.tokens_per_step
    dp_bound: list[tuple[Candidate, float]] = []  # fitting layouts a communication lever may speed up
    for c in cands:  # the hot loop: plain floats, no Estimate objects
        step, mem, exposed, host_fits = ev.score_dp(c)
        mfu = model_flops / (step * denom) if step else 0.0
        fits = (capacity is None or mem <= capacity) and host_fits
        (fitting if fits else oom).append((-round(mfu, 12), mem, c))
        if fits and Levers.bound(step, exposed):
            dp_bound.append((c, (step or 0.0) - exposed))
    # Layouts with under 10% headroom go after the comfortable ones: the CUDA context, NCCL buffers and
    # allocator fragmentation (not in the model) would eat what is left. Then by MFU, then by memory.
    tight = 0.9 * capacity if capacity is not None else float("inf")
    fitting.sort(key=lambda x: _order(x, tight))
    oom.sort(key=lambda x: x[:2])

    def scored(row: tuple[float, float, Candidate]) -> Scored:
        return Scored(ev.evaluate(row[2], detail=False), -row[0])

    base = spec.model_dump(mode="python", by_alias=True)
    winners: list[tuple[Scored, RunSpec, list[str]]] = []
    invalid: list[tuple[Candidate, str]] = []
    for row in fitting:
        if len(winners) >= top:
            break
        s = scored(row)
        try:
            run = _spec_for(spec, s.cand, base)
        except SpecError as err:  # the enumeration and the rules disagree: never show such a layout
            invalid.append((s.cand, err.message))
            continue
        codes = [w.code for w in advise(ev, s.est) if w.code not in ("PEAK_UNKNOWN",)]
        winners.append((s, run, codes))

    levers = Levers(ev)  # exposed DP communication: what bf16 reduction or PowerSGD would save
    found = {i: x for i, (s, _, _) in enumerate(winners) if (x := levers.for_layout(s.est))}
    best_step = winners[0][0].est.step_time if winners else None
    pulled = levers.best_pulled(dp_bound, capacity, best_step)
    if pulled is not None and best_step and pulled[1].step_time < best_step:
        c = pulled[0]
        pulled_row = Scored(ev.evaluate(c, detail=False), model_flops / (pulled[1].step_time * denom))
        comm = (pulled_row, pulled[1])
    else:
        comm = None
    return AutoResult(
        levers=found, pulled=comm,
        name=spec.name, world=ctx.world, evaluated=len(cands), fitting=len(fitting), top=winners,
        rejected=[(s, _oom_reason(s.est)) for s in map(scored, _distinct(oom, rejected))],
        skipped=skipped, invalid=invalid,
        peak_known=peak_known, elapsed_s=time.perf_counter() - t0,
        assumptions=priced_with(ctx),
        calibration=describe(ctx.rates),
    )

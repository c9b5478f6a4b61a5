"""The planner's core: evaluate one layout of a model on a cluster with plain arithmetic.

`build_plan` (one spec) and `--auto` (thousands of layouts) both call `Evaluator.evaluate`, so the
ranking `--auto` prints is the plan `trainctl plan` prints. Nothing here builds pydantic models.

The roofline (all times per optimizer step, on the slowest pipeline rank). Rates come from plan/rates.py:
peak * compute_efficiency and link GB/s * comm_efficiency without a profile; with a calibration profile the
measured FLOP/s and, per collective, latency * calls + bytes / measured bandwidth.
  compute   = hardware FLOPs of the rank's micro-batch / FLOP/s
  tp        = TP collective bytes / TP link rate * (1 - tp_overlap)
  p2p       = activation/gradient sends per micro-batch / PP link rate, on the
              critical path (not overlapped)
  passes    = the busiest rank's matmul weights x the bytes each micro-batch moves over them beyond the GEMMs
              (operators.weight_pass_bytes: the trainer's autocast casts and fp32 gradient add, by ZeRO stage;
              estimate.grad_accumulation for another stack's) / HBM bandwidth; operator model only
  slot      = max over pipeline ranks of (compute + tp) + p2p + passes [one micro-batch on one rank]
  pipeline  = slot * (m + (p-1)/v)                                  [m slots of work + the bubble; a third of
                                                                    (p-1)/v zero-bubble;
                                                                    zbv: plan/bubble.zbv_idle_passes/6]
  dp        = DP bytes / DP link rate; hidden = min(dp_overlap * dp, window) (dp_overlap: a calibration
              profile's measured share where the spec sets none),
              window = for the once-per-step traffic of ZeRO 0/1, as Megatron-Core overlaps it: the
              gradient reduction behind the backward still to run (the last micro-batch's; interleaved,
              chunk by chunk over the last p micro-batches of each: bubble.reduce_exposed), the weight
              all-gather behind the next step's first forward; all m slots for ZeRO 2/3's
              per-micro-batch traffic
  embedding = tied-embedding gradient all-reduce between the first and last stage (pp > 1), exposed
  step      = pipeline + (dp - hidden) + embedding
Mixture of experts: the slot adds the EP all-to-all of the rank's MoE layers (dispatch and combine,
forward and backward; on the critical path, not overlapped); the routed experts' FLOPs are charged times
the load-imbalance allowance (estimate.moe_imbalance, or the capacity factor when one is set); the expert weights
are split over ep and their gradients and optimizer state reduced/sharded over the expert-data-parallel
group (dp/ep), which adds the "expert_dp" traffic (time summed with dp's).
Context parallelism: each rank computes s/cp tokens of every sequence (compute, TP and PP bytes, activations
divided by cp); the slot adds the K/V exchange of the rank's layers (all-gather, reduce-scatter in backward,
again under recompute; on the critical path, not overlapped) on the link the CP group sits on; gradients are
reduced and ZeRO shards over dp*cp ranks.
Optimizer offload (`offload`, ZeRO 1-3 over dp > 1): the optimizer state leaves the GPU for host memory
(plan/memory.py `offloaded_state_bytes`), checked per node against the host's memory (every GPU of a node
counted as the worst pipeline rank). The step adds, after the backward and not overlapped: ZeRO-1/2 copy the
fp32 gradient slice device -> host and the updated parameter slice host -> device (the parameters' bytes) at
offload_pcie_gbps each way, in turn; ZeRO-3 (FSDP2's CPU offload) copies every weight shard to the GPU for
each of its two gathers (forward and backward; zero-bubble keeps the forward's, still charged twice) and every
gradient shard back, per micro-batch. The CPU's AdamW step moves OFFLOAD_STEP_BYTES per element of the rank's
slice at host_adam_gbps.
The GPU's optimizer step, without a profile: GPU_OPTIMIZER_BYTES per element of the rank's shard at HBM bandwidth
(plan/operators.py's device), after the backward. Not modelled: kernel launch and Python overheads, data loading,
hierarchical (NVLS) collectives, network congestion. MFU = model FLOPs / (step * GPUs * peak).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from math import ceil
from typing import NamedTuple

from trainctl import model_shape as model
from trainctl.model_shape import ModelShape
from trainctl.plan import bubble as schedule
from trainctl.plan import comm, memory, operators, powersgd
from trainctl.plan.comm import INTER_NODE, NVLINK
from trainctl.plan.pipeline import balanced_split, pp_rank_of_stage, stages_of_pp_rank
from trainctl.plan.rates import (
    CP_OPS,
    EMBEDDING_OPS,
    EP_OPS,
    PP_GATHER_OPS,
    PP_OPS,
    TP_OPS,
    AssumedRates,
    MeasuredRates,
    Ops,
)
from trainctl.spec.models import DEFAULT_MOE_IMBALANCE

# The flat share of peak for a GPU the catalog has no operator figures for (a custom accelerator): what the planner
# assumed before it priced operators.
DEFAULT_COMPUTE_EFFICIENCY = 0.6
DEFAULT_COMM_EFFICIENCY = 0.7  # the flat share of link bandwidth gloo's CPU ranks are priced at (no NCCL model)
# Bytes the GPU's optimizer step moves per parameter of the rank's shard (the fused AdamW reads the fp32 master,
# gradient and both moments and writes the master and moments: 28; the gradient norm and clipping read the gradient
# twice and write it once: 12; the 16-bit weight copy written: 2), at HBM bandwidth after the backward.
GPU_OPTIMIZER_BYTES = 28 + 12 + 2
# Bytes the fused CPU AdamW moves per fp32 element: reads the master, gradient and both moments, writes the
# master and both moments (7 x 4).
OFFLOAD_STEP_BYTES = 28


@dataclass(frozen=True)
class Hardware:
    gpu: str
    peak_flops: float | None  # dense FLOP/s per GPU at the run's precision; None = unknown (CPU)
    memory_bytes: float | None  # None = unknown (CPU): no fit check
    nvlink_domain: int  # GPUs per NVLink domain
    gpus_per_node: int
    nvlink_bw: float  # bytes/s per GPU, one direction, inside the domain
    inter_node_bw: float  # bytes/s per GPU, one direction, across nodes
    link: str = "nvlink"  # what carries intra-domain traffic (nvlink, pcie, xgmi)
    fabric: str = ""
    reserve_bytes: float = 0.0  # CUDA context, NCCL buffers, fragmentation (plan.memory.GPU_RESERVE_BYTES)
    host_memory_bytes: float | None = None  # per node (plan.memory.host_memory_bytes); None: no host check

    @property
    def usable_bytes(self) -> float | None:
        """What tensors can use: the device memory less the reserve; None = unknown (no fit check)."""
        return None if self.memory_bytes is None else self.memory_bytes - self.reserve_bytes


@dataclass(frozen=True)
class Assumptions:
    # None: the operator model (plan/operators.py) and NCCL's latency and bandwidth model (plan/rates.py), from the
    # catalog's cited figures; a number: the flat share of peak FLOP/s / link bandwidth a spec asks for
    compute_efficiency: float | None = None
    comm_efficiency: float | None = None
    # None: what the bundled trainer hides (Evaluator._trainer_hidden); a share: estimate.dp_overlap's, within the
    # windows the module docstring gives (another stack's overlap, or a CPU's 0)
    dp_overlap: float | None = None
    tp_overlap: float = 0.0
    # pipeline sends split over the TP group and gathered by the receiving stage (estimate.pp_scatter_gather)
    pp_scatter_gather: bool = False
    offload_pcie_gbps: float = 25.0  # optimizer offload: pinned host<->device copies per GPU, each direction
    host_adam_gbps: float = 40.0  # optimizer offload: host memory bandwidth of one GPU's CPU AdamW step
    # dropless routing: the busiest EP rank receives this many times the mean tokens and sets the pace of the
    # expert MLPs (and holds that much more of their activations); with a capacity factor the experts compute
    # capacity-padded buffers: the factor itself (estimate.moe_imbalance says where 1.1 comes from)
    moe_imbalance: float = DEFAULT_MOE_IMBALANCE
    # the passes each micro-batch makes over every matmul weight beyond its GEMMs (operators.weight_pass_bytes):
    # auto, the bundled trainer's; hook, cast or fused, another stack's (estimate.grad_accumulation)
    grad_accumulation: str = "auto"


@dataclass(frozen=True)
class Context:
    """What stays fixed while the layout varies: model, batch, precision, hardware, assumptions."""

    shape: ModelShape
    global_batch: int
    precision: str  # what the trainer computes in (bf16 on a CPU falls back to fp32 unless asked)
    world: int
    hw: Hardware
    assume: Assumptions
    grad_reduce_bf16: bool = False  # parallel.grad_reduce_dtype: bf16
    powersgd_rank: int | None = None  # parallel.grad_compression.powersgd.rank (ZeRO-0/1 only)
    rates: MeasuredRates | None = None  # a calibration profile's rates; None: assumed from hw and assume
    on_gpu: bool = False  # the ranks run on GPUs (which kernels save what for backward: plan/memory.py)
    # the operator model's device (plan/operators.py); None: the layers run at the rates' flat FLOP/s (a CPU, a
    # calibration profile, estimate.compute_efficiency set, or a part without the catalog's figures)
    device: operators.Device | None = None
    fp8: bool = False  # train.precision fp8: the linear layers' GEMMs in FP8 (runtime/model/fp8.py)
    gemm_speedup: float = 1.0  # those GEMMs run this many times the rate (catalog.gemm_speedup)


def assumed_rates(hw: Hardware, a: Assumptions, device: operators.Device | None = None) -> AssumedRates:
    """The uncalibrated rates: a flat share of the peak where the spec sets compute_efficiency (or the device has
    no catalog figures), else the catalog's GEMM rate; links per comm_efficiency, or NCCL's model where unset."""
    if a.compute_efficiency is not None or device is None:
        eff = a.compute_efficiency if a.compute_efficiency is not None else DEFAULT_COMPUTE_EFFICIENCY
    else:
        eff = device.gemm_efficiency
    # NCCL's model is a GPU's; CPU ranks (gloo over shared memory) keep the flat share of the link
    comm_eff = a.comm_efficiency if a.comm_efficiency is not None or hw.link != "shm" else DEFAULT_COMM_EFFICIENCY
    return AssumedRates(hw.peak_flops, {NVLINK: hw.nvlink_bw, INTER_NODE: hw.inter_node_bw}, eff, comm_eff,
                        link=hw.link, gpus_per_node=hw.gpus_per_node)


@dataclass(frozen=True)
class Candidate:
    """One layout: the light stand-in for RunSpec.parallel + train.recompute."""

    tp: int
    pp: int
    dp: int
    zero: int = 0
    micro_batch: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    stage_layers: tuple[int, ...] | None = None  # None = default balanced split
    ep: int = 1  # expert-parallel size, carved from dp
    cp: int = 1  # context-parallel size
    offload: bool = False  # optimizer state in host memory (parallel.offload: optimizer)

    def describe(self) -> str:
        sched = f"{self.schedule} v={self.virtual_stages}" if self.schedule == "interleaved" else self.schedule
        return (f"tp={self.tp}{f' cp={self.cp}' if self.cp > 1 else ''} pp={self.pp} dp={self.dp}"
                f"{f' ep={self.ep}' if self.ep > 1 else ''} zero={self.zero} "
                f"mb={self.micro_batch} "
                f"{'sp ' if self.sequence_parallel else ''}{sched} recompute={self.recompute}"
                f"{' offload=optimizer' if self.offload else ''}")


@dataclass(frozen=True)
class RankMemory:
    pp_rank: int
    params: float  # every parameter on one GPU of this pipeline rank (expert shards included)
    weights: float
    gradients: float
    optimizer: float
    activations: float
    transient: float
    expert_params: float = 0.0  # of `params`, the routed experts' (state sharded over the expert-DP group)

    @property
    def model_states(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.transient


@dataclass(frozen=True)
class Estimate:
    cand: Candidate
    micro_batches: int
    stage_layers: tuple[int, ...]
    # FLOPs per optimizer step (whole job)
    model_flops: float
    hardware_flops: float
    hardware_flops_per_gpu_max: float  # on the busiest pipeline rank
    stage_imbalance: float  # slowest pipeline rank's FLOPs / mean - 1
    rank_flops_per_token: tuple[float, ...]  # hardware FLOPs per token of a micro-batch, per pp rank
    # memory
    ranks: tuple[RankMemory, ...]
    worst: RankMemory
    capacity: float | None
    # communication bytes per step per GPU (busiest rank of each kind) and their link class
    comm_bytes: dict[str, float]
    comm_link: dict[str, str]
    comm_time: dict[str, float]
    # pipeline
    bubble_fraction: float
    bubble_over_ideal: float
    # times (None when the peak is unknown)
    compute_time: float | None
    tp_exposed_time: float
    p2p_time: float
    bubble_time: float | None
    dp_time: float
    dp_exposed_time: float | None
    embedding_sync_time: float
    step_time: float | None
    extra: dict[str, float] = field(default_factory=dict)
    # optimizer offload: host bytes of one GPU (its worst pipeline rank), of a node, the node's host memory,
    # and the step's copies and CPU AdamW (seconds, in step_time)
    host_per_gpu: float = 0.0
    host_per_node: float = 0.0
    host_capacity: float | None = None
    offload_copy_time: float = 0.0
    offload_step_time: float = 0.0
    optimizer_time: float = 0.0  # calibrated only: gradient norm, clipping, AdamW (after the backward, exposed)
    ends_time: float = 0.0  # calibrated only: the embedding's and LM head + loss's work beyond FLOPs (in compute)
    fsdp_time: float = 0.0  # calibrated ZeRO-3: what the FSDP2 units add to forward + backward (exposed)
    weight_pass_time: float = 0.0  # the micro-batches' passes over the matmul weights beyond the GEMMs

    @property
    def memory_total(self) -> float:
        return self.worst.total

    @property
    def host_fits(self) -> bool:
        return self.host_capacity is None or self.host_per_node <= self.host_capacity

    @property
    def fits(self) -> bool:
        return (self.capacity is None or self.worst.total <= self.capacity) and self.host_fits

    @property
    def headroom(self) -> float | None:
        return None if self.capacity is None else self.capacity - self.worst.total

    @property
    def headroom_fraction(self) -> float | None:
        return None if self.capacity is None else (self.capacity - self.worst.total) / self.capacity

    def per_link(self) -> dict[str, float]:
        out = {NVLINK: 0.0, INTER_NODE: 0.0}
        for kind, b in self.comm_bytes.items():
            out[self.comm_link[kind]] += b
        return out

    @property
    def tokens_per_s(self) -> float | None:
        return None if not self.step_time else self.extra["tokens_per_step"] / self.step_time

    def mfu(self, world: int, peak: float | None) -> float | None:
        if not self.step_time or not peak:
            return None
        return self.model_flops / (self.step_time * world * peak)


@dataclass(frozen=True)
class _Profile:
    """Where the layers and the model's ends sit, per pipeline rank (independent of tp and batch)."""

    stages: tuple[tuple[int, ...], ...]  # [rank][chunk] -> model stage (pipeline.stages_of_pp_rank)
    layers: tuple[tuple[int, ...], ...]  # [rank][chunk] -> transformer layers
    rank_layers: tuple[int, ...]  # [rank] -> transformer layers over all its chunks
    has_first: tuple[bool, ...]  # rank holds the embedding
    has_last: tuple[bool, ...]  # rank holds the LM head
    sends: tuple[int, ...]  # p2p sends per micro-batch (forward activations + backward gradients)
    # per rank, the chunk holding the embedding / the LM head (-1: none); V placement puts both on rank 0
    first_chunk: tuple[int, ...] = ()
    last_chunk: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Load:
    """Per-rank compute for one (tp, pp, v, split, recompute): what decides the pipeline's pace."""

    flops: tuple[float, ...]  # hardware FLOPs per token of a micro-batch, per pipeline rank
    seconds: tuple[float, ...]  # per pipeline rank, seconds of compute per token (0 when the rate is unknown)
    collectives: tuple[int, ...]  # TP all-reduce equivalents per micro-batch, per pipeline rank
    slow: int  # the rank with the longest slot (compute + exposed TP), the same for every micro_batch
    imbalance: float
    ends: tuple[float, ...] = ()  # per pipeline rank, seconds per token of the ends' work beyond FLOPs (profile)


@dataclass(frozen=True)
class _Base:
    """The part of an evaluation that does not depend on the ZeRO stage."""

    n_micro: int
    layers: tuple[int, ...]
    prof: _Profile
    params: tuple[float, ...]  # per pp rank, every parameter on one GPU
    experts: tuple[float, ...]  # per pp rank, of those the routed experts' (split over ep)
    largest: tuple[int, ...]  # per pp rank, the largest single parameter on one GPU
    max_params: float  # the most non-expert parameters of a pp rank (the DP traffic)
    max_experts: float  # the most expert parameters of a pp rank (the expert-DP traffic)
    load: _Load
    vp: int
    acts: tuple[float, ...]  # activation bytes per pipeline rank
    transient: tuple[float, ...]  # recompute working set per pipeline rank (ZeRO-3 buffers come on top)
    # the same with autocast's 16-bit weight copies (memory.autocast_copies: whether, by the ZeRO stage):
    # saved for backward per pipeline rank, and a full recompute's of the layer it re-runs
    acts_copied: tuple[float, ...]
    transient_copied: tuple[float, ...]
    links: dict[str, str]
    ops: dict[str, Ops]  # the collectives of each kind but DP (plan/rates.py)
    calls: dict[str, float]  # calls per step of each of them (the latency term of measured rates)
    groups: dict[str, int]  # the ranks of each kind's group (a measured latency grows with it)
    units: int  # FSDP units on the busiest pipeline rank (comm.fsdp_units): ZeRO-3 calls per micro-batch
    head_unit: tuple[float, ...]  # per pp rank, ZeRO-3's unit gathered once per micro-batch (comm.fsdp_head_unit)
    tp_bytes: float
    pp_bytes: float
    pp_gather_bytes: float  # scatter/gather: the receiving stage's gather of the pieces over the TP link
    emb_bytes: float
    ep_bytes: float
    cp_bytes: float
    tp_exposed: float
    p2p: float
    ep_mb_time: float  # the MoE all-to-all per micro-batch on the slot (not overlapped)
    cp_mb_time: float  # the CP K/V exchange per micro-batch on the slot (not overlapped)
    cp_layer_time: float  # one layer's K/V exchange per micro-batch
    attn_layer_time: float | None  # one layer's causal attention compute of this rank per micro-batch
    bubble_slots: float
    slot: float | None
    compute_mb: float | None
    ends_mb: float  # the slowest pipeline rank's ends beyond their FLOPs per micro-batch (in compute_mb)
    dispatch_mb: float  # the layers' wait for the host to issue their kernels per micro-batch (in compute_mb)
    emb_time: float
    layer_params_gpu: float  # one layer's parameters on one GPU, the largest kind (ZeRO-3 gathers two at a time)
    matmul_params: float  # the most matmul weights of a pipeline rank on one GPU (each micro-batch's weight passes)
    layer_matmul_params: float  # of those, the transformer layers' (not the LM head): the FP8 GEMMs' weights
    shape_key: tuple = ()  # (tp, pp, v, layers, ep, schedule): what PowerSGD's figures depend on (_psgd)
    load_recompute: str = "none"  # the layout's recompute (the backward's share of a slot)
    schedule: str = "1f1b"  # the layout's pipeline schedule
    spread: dict[str, int] = field(default_factory=dict)  # each kind's group ranks on one node (_spread)


class Evaluator:
    """Evaluates candidates for one Context; caches the parts shared between layouts.

    The caches are keyed by the few integers each part depends on, so `--auto` pays per candidate only
    for the per-rank memory sum; the figures are the same as an uncached evaluation's."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        m = ctx.shape
        self.model_flops_per_token = model.model_flops_per_token_of(m)
        self.tokens_per_step = ctx.global_batch * m.seq_len
        self.act_bytes = memory.activation_bytes(ctx.precision)
        self.stream_bytes = memory.residual_bytes(m, ctx.precision)  # what a pipeline stage sends
        self.grad_bytes = 4  # the trainer's gradients are fp32 (plan.memory.trainer_state_bytes)
        self.bucket_numel = memory.dp_bucket_numel()  # the trainer's gradient bucket (read once: an env lookup)
        self._default_split = lru_cache(maxsize=None)(self._split)
        self._profile = lru_cache(maxsize=None)(self._make_profile)
        self._rank_params = lru_cache(maxsize=None)(self._make_rank_params)
        self._stage_params = lru_cache(maxsize=None)(self._make_stage_params)
        self._units = lru_cache(maxsize=None)(self._make_units)
        self._load = lru_cache(maxsize=None)(self._make_load)
        self._rates = lru_cache(maxsize=None)(self._make_rates)
        self._tp_exposed = lru_cache(maxsize=None)(self._make_tp_exposed)
        self._compression = lru_cache(maxsize=None)(self._make_compression)
        self._layer_act = lru_cache(maxsize=None)(self._make_layer_act)
        self._step_floor = lru_cache(maxsize=None)(self._make_step_floor)
        self._memory_floor = lru_cache(maxsize=None)(self._make_memory_floor)
        self._base_cache: dict[tuple, _Base] = {}
        cf = m.moe.capacity_factor if m.moe is not None else None
        # what the GPUs compute (capacity-padded buffers with a capacity factor), and what paces the slot
        self.expert_factor = cf or 1.0
        self.expert_pace = cf or ctx.assume.moe_imbalance
        self._layer_flops = {r: model.layer_flops_per_token(m, r, self.expert_factor)
                             for r in ("none", "selective", "full")}
        self._layer_flops_paced = {r: model.layer_flops_per_token(m, r, self.expert_pace, ctx.gemm_speedup)
                                   for r in ("none", "selective", "full")}
        self.rates: AssumedRates | MeasuredRates = ctx.rates or assumed_rates(ctx.hw, ctx.assume)

    def reduction_variant(self, grad_reduce_bf16: bool, powersgd_rank: int | None) -> Evaluator:
        """An Evaluator of this context with another DP reduction, sharing the caches that do not depend on it
        (plan/comm_levers.py prices the levers of many layouts with it)."""
        ev = self.for_context(replace(self.ctx, grad_reduce_bf16=grad_reduce_bf16, powersgd_rank=powersgd_rank))
        ev._load = self._load
        ev._base_cache = self._base_cache  # _Base holds nothing of the DP reduction
        return ev

    def for_context(self, ctx: Context) -> Evaluator:
        """An Evaluator of `ctx` (same model, precision and device: another world size or DP reduction) sharing
        the caches that depend on those and the layout's integers only (the stage split, profiles, parameters per
        rank, activation units and bytes, PowerSGD figures): a sweep over node counts computes each once."""
        same = (ctx.shape, ctx.precision, ctx.on_gpu) == (self.ctx.shape, self.ctx.precision, self.ctx.on_gpu)
        assert same, "the shared caches are keyed by the layout, not by the model, precision or device"
        ev = Evaluator(ctx)
        ev._default_split, ev._profile, ev._rank_params = self._default_split, self._profile, self._rank_params
        ev._stage_params = self._stage_params
        ev._units, ev._compression, ev._layer_act = self._units, self._compression, self._layer_act
        return ev

    # --- shared pieces ------------------------------------------------------------------------------

    def _split(self, stages: int) -> tuple[int, ...]:
        # Same split as pipeline.stage_layers(spec), which the trainer uses.
        cost = model.embedding_cost(self.ctx.shape)
        return tuple(balanced_split(self.ctx.shape.layers, stages, cost, cost))

    def stage_layers(self, c: Candidate) -> tuple[int, ...]:
        if c.stage_layers is not None:
            return c.stage_layers
        return self._default_split(c.pp * c.virtual_stages)

    def _make_profile(self, pp: int, v: int, layers: tuple[int, ...], schedule_: str) -> _Profile:
        n_stages = pp * v
        held = [tuple(stages_of_pp_rank(r, pp, v, schedule_)) for r in range(pp)]

        def remote(g: int, rank: int) -> bool:  # a neighbour on another rank (same-rank ones hand over locally)
            return 0 <= g < n_stages and pp_rank_of_stage(g, pp, v, schedule_) != rank

        per_rank, sends = [], []
        for r, stages in enumerate(held):
            per_rank.append(tuple(layers[g] for g in stages))
            sends.append(sum(remote(g + 1, r) + remote(g - 1, r) for g in stages))
        return _Profile(stages=tuple(held), layers=tuple(per_rank), rank_layers=tuple(sum(x) for x in per_rank),
                        has_first=tuple(0 in st for st in held), has_last=tuple(n_stages - 1 in st for st in held),
                        sends=tuple(sends), first_chunk=tuple(st.index(0) if 0 in st else -1 for st in held),
                        last_chunk=tuple(st.index(n_stages - 1) if n_stages - 1 in st else -1 for st in held))

    def _make_rank_params(self, tp: int, pp: int, v: int, layers: tuple[int, ...], ep: int, schedule_: str
                          ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[int, ...], tuple[int, ...]]:
        """Per pipeline rank: (every parameter on one GPU, the routed experts' of them, MoE layers, the
        largest single parameter). A rank holding both ends with tied embeddings (V placement) keeps the
        table twice, as the trainer does (the LM head's copy, summed locally)."""
        prof = self._profile(pp, v, layers, schedule_)
        m = self.ctx.shape
        n_stages = pp * v
        starts = [sum(layers[:g]) for g in range(n_stages)]
        totals, experts, moe_layers, largest = [], [], [], []
        for r in range(pp):
            total = expert = 0.0
            n_moe = big = 0
            for g, n in zip(prof.stages[r], prof.layers[r], strict=True):
                k = m.moe_layers_in(starts[g], starts[g] + n)
                stage_total, stage_expert, stage_big = self._stage_params(tp, n, g == 0, g == n_stages - 1, k, ep)
                total += stage_total
                expert += stage_expert
                n_moe += k
                big = max(big, stage_big)
            totals.append(total)
            experts.append(expert)
            moe_layers.append(n_moe)
            largest.append(big)
        return tuple(totals), tuple(experts), tuple(moe_layers), tuple(largest)

    def _make_stage_params(self, tp: int, layers: int, first: bool, last: bool, moe_layers: int, ep: int
                           ) -> tuple[float, float, int]:
        """One stage's (every parameter on one GPU, the routed experts' of them, the largest single parameter):
        most stages of a layout hold the same few shapes, so a sweep computes each once."""
        m = self.ctx.shape
        return (model.stage_params_per_gpu(m, tp, layers, first, last, moe_layers, ep),
                model.layers_params_per_gpu(m, tp, layers=layers, moe_layers=moe_layers, ep=ep)[1],
                model.largest_param_per_gpu(m, tp, layers, first, last))

    def _make_compression(self, tp: int, pp: int, v: int, layers: tuple[int, ...], ep: int, schedule_: str,
                          rank: int) -> tuple[tuple[powersgd.Compression, powersgd.Compression], ...]:
        """Per pipeline rank: PowerSGD's (dense, routed-expert) figures at `rank`."""
        m = self.ctx.shape
        prof = self._profile(pp, v, layers, schedule_)
        n_stages = pp * v
        starts = [sum(layers[:g]) for g in range(n_stages)]
        out = []
        for r in range(pp):
            mats: list[powersgd.Matrix] = []
            for g, n in zip(prof.stages[r], prof.layers[r], strict=True):
                k = m.moe_layers_in(starts[g], starts[g] + n)
                mats += powersgd.stage_matrices(m, tp, n, g == 0, g == n_stages - 1, k, ep)
            out.append((powersgd.compression(mats, rank), powersgd.compression(mats, rank, experts=True)))
        return tuple(out)

    def _make_units(self, schedule_: str, pp: int, v: int, n_micro: int,
                    layers: tuple[int, ...]) -> tuple[tuple[int, ...], int, int]:
        """(layer-micro-batches of activations per rank, embedding's and LM head's micro-batches in flight)."""
        prof = self._profile(pp, v, layers, schedule_)
        units, first, last = [], 0, 0
        for r in range(pp):
            flight = schedule.in_flight(schedule_, pp, v, n_micro, r, prof.layers[r])
            units.append(sum(f * n for f, n in zip(flight, prof.layers[r], strict=True)))
            if prof.has_first[r]:
                first = flight[prof.first_chunk[r]]
            if prof.has_last[r]:
                last = flight[prof.last_chunk[r]]
        return tuple(units), first, last

    def _make_rates(self, tp: int, cp: int, mb: int, sp: bool, recompute: str) -> tuple[float, float] | None:
        """(layer, head) achieved FLOP/s on one rank: the operator model's (plan/operators.py) seconds of one layer
        and of the head for this shape, as a rate of their FLOPs; the rates' flat FLOP/s without a device; None
        when the rate is unknown (a CPU without a profile)."""
        flat = self.rates.compute(tp)
        dev = self.device
        if dev is None or not flat:
            return (flat, flat) if flat else None
        m = self.ctx.shape
        tokens = mb * m.seq_len / cp
        speedup = self.ctx.gemm_speedup  # FP8 GEMMs: the time and the FLOPs it is a rate of both at their pace
        layer_s = operators.layer_seconds(m, dev, micro_batch=mb, tp=tp, cp=cp, sp=sp, recompute=recompute,
                                          act=self.act_bytes, stream=self.stream_bytes, gemm_speedup=speedup,
                                          fp8=self.ctx.fp8)
        vp = self.padded_vocab(tp)
        head_s = operators.head_seconds(m, dev, micro_batch=mb, tp=tp, cp=cp, vocab=vp, act=self.act_bytes)
        # the layer's FLOPs as the operator model shaped them: a MoE layer as a dense one with top_k experts' MLP
        dense = m if m.moe is None else replace(m, moe=None, ffn_hidden=m.moe.expert_ffn_hidden * m.moe.top_k)
        layer_flops = model.layer_flops_per_token(dense, recompute, gemm_speedup=speedup) * tokens / tp
        return layer_flops / layer_s, model.head_flops_per_token(m, vp) * tokens / tp / head_s

    def _make_tp_exposed(self, tp: int, cp: int, mb: int, sp: bool, recompute: str) -> float:
        """The share of the TP collectives' time left on the step: estimate.tp_overlap's share overlapped as
        Transformer Engine overlaps them (operators.te_tp_exposed_seconds: its chunking and the SMs it takes
        still cost), the rest not at all. TE overlaps sequence parallelism's collectives only; without the operator
        model (flat or measured rates) the overlapped share is taken as free."""
        share = self.ctx.assume.tp_overlap
        dev = self.device
        if share == 0 or tp == 1 or not sp or dev is None:
            return 1 - share
        m = self.ctx.shape
        link = comm.tp_link(tp, self.ctx.world, self.ctx.hw.nvlink_domain)
        tokens = mb * m.seq_len / cp
        all_reduce = self.rates.comm(link, TP_OPS[False], comm.all_reduce_bytes(m.hidden * self.act_bytes * tokens, tp))
        exposed = operators.te_tp_exposed_seconds(m, dev, micro_batch=mb, tp=tp, cp=cp, act=self.act_bytes,
                                                  half_s=all_reduce / 2, recompute=recompute)
        per_layer = 6 if recompute == "full" else 4  # the all-reduce equivalents _make_load counts per layer
        return (1 - share) + share * exposed / (per_layer * all_reduce)

    def _make_load(self, tp: int, pp: int, v: int, layers: tuple[int, ...], recompute: str, schedule_: str,
                   mb: int = 1, cp: int = 1, sp: bool = False) -> _Load:
        prof = self._profile(pp, v, layers, schedule_)
        m, hw = self.ctx.shape, self.ctx.hw
        layer_flops = self._layer_flops_paced[recompute]  # routed experts at the busiest EP rank's pace
        head_flops = model.head_flops_per_token(m, self.padded_vocab(tp))
        flops = tuple((prof.rank_layers[r] * layer_flops + (head_flops if prof.has_last[r] else 0.0)) / tp
                      for r in range(pp))
        rates = self._rates(tp, cp, mb, sp, recompute)
        seconds = tuple(0.0 if rates is None else
                        (prof.rank_layers[r] * layer_flops / rates[0] + (head_flops / rates[1] if prof.has_last[r]
                                                                         else 0.0)) / tp for r in range(pp))
        per_layer = 6 if recompute == "full" else 4  # TP all-reduce equivalents per layer (fwd, bwd, recompute)
        counts = tuple(prof.rank_layers[r] * per_layer + prof.has_first[r] + prof.has_last[r] if tp > 1 else 0
                       for r in range(pp))
        # Both terms of a slot scale with the micro-batch, so the slowest rank does not depend on it.
        link = comm.tp_link(tp, self.ctx.world, hw.nvlink_domain)
        tp_cost = self.rates.comm(link, TP_OPS[False], comm.all_reduce_bytes(m.hidden * self.act_bytes, tp)) * (
            self._tp_exposed(tp, cp, mb, sp, recompute))
        # the ends' work beyond their FLOPs (a calibration profile's fixed work), per token of the micro-batch it
        # was measured at: it then scales with the micro-batch as the rest of the slot does
        fixed = self.rates.fixed
        ends = tuple(fixed.ends_seconds(prof.has_first[r], prof.has_last[r]) / (fixed.micro_batch * m.seq_len)
                     if fixed is not None else 0.0 for r in range(pp))
        pace = seconds if rates is not None else flops  # an unknown rate ranks the pipeline ranks by FLOPs
        slots = [pace[r] + counts[r] * tp_cost + ends[r] for r in range(pp)]
        mean = sum(flops) / pp
        return _Load(flops, seconds, counts, max(range(pp), key=slots.__getitem__),
                     max(flops) / mean - 1 if mean > 0 else 0.0, ends)

    def _make_layer_act(self, mb: int, tp: int, sp: bool, recompute: str, cp: int, ep: int) -> float:
        """Activation bytes one layer keeps per micro-batch in flight. An MoE layer keeps more than a dense one;
        charged on average over the model's layers. The busiest EP rank receives more rows than its share (with
        ep = 1 one rank takes every row, exactly)."""
        ctx, m = self.ctx, self.ctx.shape
        rows_factor = self.expert_pace if ep > 1 else 1.0
        return (memory.trainer_layer_activation_bytes(m, mb, tp, sp, recompute, ctx.precision, cp, ctx.on_gpu)
                + m.moe_layers / m.layers
                * memory.moe_layer_activation_delta(m, mb, tp, sp, recompute, ctx.precision, rows_factor, ep))

    def memory_floor(self, c: Candidate) -> float:
        """A floor under score(c)'s bytes per GPU from cached parts alone (no _Base): the layers' activations in
        flight on the rank holding the most; every other term (model states, the ends' activations, buffers)
        is >= 0, and ZeRO does not change these."""
        return self._memory_floor(c.tp, c.pp, c.dp, c.cp, c.ep, c.virtual_stages, c.schedule, c.micro_batch,
                                  c.recompute, c.sequence_parallel and c.tp > 1, c.stage_layers)

    def _make_memory_floor(self, tp: int, pp: int, dp: int, cp: int, ep: int, v: int, schedule_: str, mb: int,
                           recompute: str, sp: bool, stage_layers: tuple[int, ...] | None) -> float:
        layers = stage_layers if stage_layers is not None else self._default_split(pp * v)
        units, _, _ = self._units(schedule_, pp, v, self.ctx.global_batch // (mb * dp), layers)
        return max(units) * self._layer_act(mb, tp, sp, recompute, cp, ep)

    @property
    def device(self) -> operators.Device | None:
        """The operator model's device where it prices the layers: uncalibrated, with no flat
        estimate.compute_efficiency (either replaces it)."""
        if self.ctx.assume.compute_efficiency is not None or not isinstance(self.rates, AssumedRates):
            return None
        return self.ctx.device

    def padded_vocab(self, tp: int) -> int:
        return self.ctx.shape.padded_vocab(tp)

    # --- the evaluation -----------------------------------------------------------------------------
    # Split in two so `--auto` shares the first part between the ZeRO stages: _base holds everything that
    # does not depend on the ZeRO stage, _with_zero the rest. evaluate() and score() both use them.

    def _base(self, c: Candidate) -> _Base:
        key = (c.tp, c.pp, c.dp, c.virtual_stages, c.micro_batch, c.recompute, c.sequence_parallel and c.tp > 1,
               c.schedule, c.stage_layers, c.ep, c.cp)
        hit = self._base_cache.get(key)
        if hit is None:
            if len(self._base_cache) > 4096:
                self._base_cache.clear()
            hit = self._base_cache[key] = self._make_base(c)
        return hit

    def _make_base(self, c: Candidate) -> _Base:
        ctx, m, hw = self.ctx, self.ctx.shape, self.ctx.hw
        tp, pp, dp, v, mb, cp = c.tp, c.pp, c.dp, c.virtual_stages, c.micro_batch, c.cp
        sp = c.sequence_parallel and tp > 1
        n_micro = ctx.global_batch // (mb * dp)
        layers = self.stage_layers(c)
        prof = self._profile(pp, v, layers, c.schedule)
        params, experts, moe_layers, largest = self._rank_params(tp, pp, v, layers, c.ep, c.schedule)
        load = self._load(tp, pp, v, layers, c.recompute, c.schedule, mb, cp, sp)
        vp = self.padded_vocab(tp)
        world = ctx.world
        tokens_mb = mb * m.seq_len / cp  # this rank's tokens of a micro-batch

        # memory that does not depend on ZeRO: activations in flight + the recompute working set
        def layer_act(recompute: str) -> float:
            return self._layer_act(mb, tp, sp, recompute, cp, c.ep)

        per_layer = layer_act(c.recompute)
        emb_act = memory.embedding_activation_bytes(m, mb, tp, sp, cp)
        head_act = memory.trainer_head_activation_bytes(m, mb, tp, sp, vp, ctx.precision, cp, ctx.on_gpu)
        working = layer_act("none") if c.recompute == "full" else 0.0  # the layer being recomputed, all its tensors
        units, first_flight, last_flight = self._units(c.schedule, pp, v, n_micro, layers)
        acts = [u * per_layer for u in units]
        acts[prof.has_first.index(True)] += first_flight * emb_act
        acts[prof.has_last.index(True)] += last_flight * head_act
        transient = tuple(working if n else 0.0 for n in prof.rank_layers)
        # autocast's weight copies: a full recompute saves only the LM head's (the layers' live while one re-runs)
        # (an upper bound under SP: the column-parallel layers there cast their weight again in backward, no copy kept)
        # FP8 layers quantize the weight itself and keep no 16-bit copy (runtime/model/fp8.py): only the head's
        copy = memory.AUTOCAST_COPY_BYTES
        kept = c.recompute != "full" and not ctx.fp8
        cast_params = [model.stage_matmul_params_per_gpu(m, tp, layers=prof.rank_layers[r] if kept else 0,
                                                         last=prof.has_last[r], moe_layers=moe_layers[r] if kept else 0,
                                                         ep=c.ep) for r in range(pp)]
        cast_working = 0.0 if kept or ctx.fp8 else model.stage_matmul_params_per_gpu(
            m, tp, layers=1, last=False, moe_layers=int(m.moe is not None), ep=c.ep)
        acts_copied = tuple(x + copy * n for x, n in zip(acts, cast_params, strict=True))
        transient_copied = tuple(t + copy * cast_working if t else 0.0 for t in transient)

        # communication that does not depend on ZeRO
        domain = hw.nvlink_domain
        pp_link = comm.pp_link(pp, world, domain)
        links = {"tp": comm.tp_link(tp, world, domain), "pp": pp_link,
                 "dp": comm.dp_link(tp, dp * cp, world, domain), "embedding": pp_link,
                 "cp": comm.cp_link(tp, cp, world, domain),
                 "ep": comm.ep_link(tp, c.ep, world, domain),
                 "expert_dp": comm.expert_dp_link(tp, dp, c.ep, world, domain)}
        links["pp_gather"] = links["tp"]
        tp_msg = tokens_mb * m.hidden * self.act_bytes
        tp_ar = comm.all_reduce_bytes(tp_msg, tp)
        pp_msg = tokens_mb * m.hidden * self.stream_bytes / self._pp_split(tp, sp)
        p2p_mb_bytes = max(prof.sends) * pp_msg if pp > 1 else 0.0
        # tied embeddings: the first and last stage's grads are summed over the embedding group, unless one rank
        # holds both (V placement: a local sum)
        split_ends = prof.has_first.index(True) != prof.has_last.index(True)
        emb_bytes = vp * m.hidden / tp * self.grad_bytes if (m.tied_embeddings and split_ends) else 0.0
        # MoE token exchange: each TP rank dispatches its sequence shard under SP (Megatron-Core needs SP
        # with TP for MoE); on the rank with the most MoE layers
        ep_layer = (comm.all_to_all_bytes(tokens_mb / (tp if sp else 1), m.moe.top_k, m.hidden, self.act_bytes,
                                          c.ep, 6 if c.recompute == "full" else 4) if m.moe is not None else 0.0)
        ep_mb_bytes = max(moe_layers) * ep_layer
        ep_calls_mb = max(moe_layers) * (6 if c.recompute == "full" else 4) if ep_mb_bytes else 0
        cp_passes = 2 if c.recompute == "none" else 3  # recompute gathers K/V again in backward
        cp_layer = comm.cp_exchange_bytes(m.seq_len, mb, m.kv_width / tp, self.act_bytes, cp, cp_passes)

        # times of the roofline (module docstring) that do not depend on ZeRO
        rates, tp_calls, sends = self.rates, load.collectives[load.slow], max(prof.sends) if pp > 1 else 0
        tp_mb_slow = tp_calls * tp_ar
        groups = {"tp": tp, "pp": 2, "embedding": 2, "ep": c.ep, "cp": cp, "pp_gather": tp}  # pairs: send/recv
        spread = self._spread(tp, dp, cp, c.ep)
        tp_exposed = self._tp_exposed(tp, cp, mb, sp, c.recompute)
        tp_mb_time = rates.comm(links["tp"], TP_OPS[sp], tp_mb_slow, tp_calls, groups["tp"], spread["tp"]) * tp_exposed
        measured = rates.tp_layer(links["tp"], tp, sp, c.recompute) if tp > 1 and cp == 1 and m.moe is None else None
        rate = rates.compute(tp)
        if measured is not None and rate:
            # the layer as calibrate ran it in a TP group: what it took beyond its FLOPs at the compute rate is
            # its exposed TP time (collectives, waits, SP's extra work); the ends' collectives stay on the fits
            seconds, tokens = measured
            ends = prof.has_first[load.slow] + prof.has_last[load.slow]
            tp_mb_time = (prof.rank_layers[load.slow] * self._layer_excess(seconds, tokens, tokens_mb, c.recompute,
                                                                           tp, rate)
                          + rates.comm(links["tp"], TP_OPS[sp], ends * tp_ar, ends, groups["tp"], spread["tp"])
                          * tp_exposed)
        p2p = rates.comm(pp_link, PP_OPS, p2p_mb_bytes, sends, groups["pp"], spread["pp"])
        gathered = self.ctx.assume.pp_scatter_gather and tp > 1 and not sp  # the receiver gathers the pieces
        gather_mb_bytes = sends * comm.gather_bytes(pp_msg * tp, tp) if gathered else 0.0
        p2p += rates.comm(links["pp_gather"], PP_GATHER_OPS, gather_mb_bytes, sends if gathered else 0,
                          groups["pp_gather"], spread["pp_gather"])
        ep_mb_time = rates.comm(links["ep"], EP_OPS, ep_mb_bytes, ep_calls_mb, groups["ep"], spread["ep"])
        cp_ops = CP_OPS[cp_passes == 3]
        cp_layer_time = rates.comm(links["cp"], cp_ops, cp_layer, cp_passes if cp_layer else 0, groups["cp"],
                                   spread["cp"])
        measured_cp = rates.cp_layer(links["cp"], cp, c.recompute) if cp > 1 and tp == 1 and m.moe is None else None
        if measured_cp is not None and rate:
            # the layer as calibrate ran it on a CP rank's chunks (tokens / cp of the measured micro-batch's): what
            # it took beyond its FLOPs at the compute rate is its exposed CP time (the K/V exchange, the chunked
            # attention's extra work, their waits), as for a measured TP layer
            seconds, tokens = measured_cp
            cp_layer_time = self._layer_excess(seconds, tokens / cp, tokens_mb, c.recompute, 1, rate)
        cp_mb_time = prof.rank_layers[load.slow] * cp_layer_time
        bubble_slots = schedule.bubble_slots(pp, v, c.schedule, n_micro)
        slot = compute_mb = attn_layer_time = None
        dispatch_mb = 0.0  # what the host's issuing of the layers' kernels adds beyond running them
        ends_mb = load.ends[load.slow] * tokens_mb
        if rate:
            compute_mb = load.seconds[load.slow] * tokens_mb + ends_mb
            # a GPU runs a layer's kernels while the host issues the next ones: the layers take the longer of
            # the two (too little work per kernel and the GPU waits for the host: the dispatch floor)
            floor = rates.dispatch_floor(c.recompute)
            if floor:
                layers_mb = prof.rank_layers[load.slow] * self._layer_flops_paced[c.recompute] / tp / rate * tokens_mb
                dispatch_mb = max(0.0, prof.rank_layers[load.slow] * floor - layers_mb)
                compute_mb += dispatch_mb
            pairs = max(model.causal_pairs_per_rank(m.seq_len, cp))  # the same on every rank: balanced chunks
            attn_layer_time = mb * pairs * model.attention_flops_per_pair(m) / tp / rate
            slot = compute_mb + tp_mb_time + ep_mb_time + cp_mb_time + p2p
        return _Base(
            shape_key=(tp, pp, v, layers, c.ep, c.schedule), load_recompute=c.recompute, schedule=c.schedule,
            n_micro=n_micro, layers=layers, prof=prof, params=params, experts=experts, largest=largest,
            max_params=max(p - e for p, e in zip(params, experts, strict=True)), max_experts=max(experts),
            load=load, vp=vp, acts=tuple(acts), transient=transient, acts_copied=acts_copied,
            transient_copied=transient_copied, links=links,
            ops={"tp": TP_OPS[sp], "pp": PP_OPS, "embedding": EMBEDDING_OPS, "ep": EP_OPS, "cp": cp_ops,
                 "pp_gather": PP_GATHER_OPS},
            groups=groups,
            calls={"tp": n_micro * max(load.collectives), "pp": n_micro * sends, "embedding": float(emb_bytes > 0),
                   "ep": float(n_micro * ep_calls_mb),
                   "cp": float(n_micro * max(prof.rank_layers) * cp_passes if cp_layer else 0),
                   "pp_gather": float(n_micro * sends if gathered else 0)},
            units=max(comm.fsdp_units(n, first, last, m.tied_embeddings)
                      for n, first, last in zip(prof.rank_layers, prof.has_first, prof.has_last, strict=True)),
            head_unit=tuple(comm.fsdp_head_unit(m.norm_params, vp * m.hidden / tp, m.tied_embeddings) if last else 0.0
                            for last in prof.has_last),
            tp_bytes=n_micro * max(load.collectives) * tp_ar, pp_bytes=n_micro * p2p_mb_bytes,
            pp_gather_bytes=n_micro * gather_mb_bytes, emb_bytes=emb_bytes,
            ep_bytes=n_micro * ep_mb_bytes, cp_bytes=n_micro * max(prof.rank_layers) * cp_layer,
            tp_exposed=n_micro * tp_mb_time, p2p=p2p, ep_mb_time=ep_mb_time, cp_mb_time=cp_mb_time,
            cp_layer_time=cp_layer_time, attn_layer_time=attn_layer_time, bubble_slots=bubble_slots, slot=slot,
            compute_mb=compute_mb, ends_mb=ends_mb, dispatch_mb=dispatch_mb,
            emb_time=rates.comm(pp_link, EMBEDDING_OPS, emb_bytes, float(emb_bytes > 0), groups["embedding"],
                                spread["embedding"]),
            spread=spread,
            layer_params_gpu=max(model.layer_params_per_gpu(m, tp),
                                 sum(model.layers_params_per_gpu(m, tp, layers=1, moe_layers=1, ep=c.ep))
                                 if m.moe is not None else 0.0),
            matmul_params=max(model.stage_matmul_params_per_gpu(m, tp, layers=prof.rank_layers[r],
                                                                last=prof.has_last[r], moe_layers=moe_layers[r],
                                                                ep=c.ep) for r in range(pp)),
            layer_matmul_params=max(model.stage_matmul_params_per_gpu(m, tp, layers=prof.rank_layers[r], last=False,
                                                                      moe_layers=moe_layers[r], ep=c.ep)
                                    for r in range(pp)),
        )

    def _layer_excess(self, seconds: float, measured_tokens: float, tokens: float, recompute: str, tp: int,
                      rate: float) -> float:
        """What one layer measured in a group (`seconds` on `measured_tokens` of this rank's) takes on `tokens`
        beyond its FLOPs at `rate`: its exposed TP or CP time (calibration profile, fits.layer)."""
        return max(0.0, seconds * tokens / measured_tokens - self._layer_flops[recompute] / tp / rate * tokens)

    def _with_zero(self, b: _Base, zero: int, dp: int, ep: int = 1, offload: bool = False) -> _Zero:
        """The ZeRO-dependent part: bytes per parameter, the worst pipeline rank, DP traffic, offload and the
        step. `dp` is the gradient-reduction group's size: data x context parallel."""
        return self._zero_time(b, self._zero_bytes(b, zero, dp, ep, offload), zero, dp, ep)

    def _zero_bytes(self, b: _Base, zero: int, dp: int, ep: int, offload: bool) -> _ZeroBytes:
        """_with_zero's memory: what a search needs first, since most layouts of a large model do not fit."""
        ctx = self.ctx
        edp = dp // ep
        # expert weights replicate over the expert-data-parallel group only: ZeRO shards their state over dp/ep
        (dense, host_dense), (expert, host_expert) = (
            memory.offloaded_state_bytes(zero, n, ctx.precision, ctx.grad_reduce_bf16) if offload
            else (memory.trainer_state_bytes(zero, n, ctx.precision, ctx.grad_reduce_bf16), 0.0)
            for n in (dp, edp))
        per_dense, per_expert = sum(dense), sum(expert)
        sharded = zero >= 3 and dp > 1
        gather = 2 * b.layer_params_gpu * memory.fsdp_gather_bytes(ctx.precision) if sharded else 0.0  # prefetch
        # ZeRO-2's bucket buffers (gradients), and the one parameter's gradient autograd hands over at a time
        # when the trainer adds it into its fp32 buffer (transient)
        buffers = (tuple(self._zero2_buffers(p - e, big, dp)
                         for p, e, big in zip(b.params, b.experts, b.largest, strict=True))
                   if zero == 2 and dp > 1 else (0.0,) * len(b.params))
        copied_grad = memory.copied_grad_bytes(zero, dp, ctx.precision)
        handed = tuple(big * copied_grad for big in b.largest)
        copied = memory.autocast_copies(ctx.precision, zero, dp)
        acts, transient = (b.acts_copied, b.transient_copied) if copied else (b.acts, b.transient)
        totals = [(p - e) * per_dense + e * per_expert + buf + x + t + h
                  for p, e, x, t, buf, h in zip(b.params, b.experts, acts, transient, buffers, handed, strict=True)]
        # PowerSGD: the pipeline rank with the most dense (expert) parameters, whose reduction the figures take
        psgd, psgd_time = self._psgd(b) if zero <= 1 and dp > 1 else (None, 0.0)
        if psgd:  # its buffers (error feedback, the rest's copy, P and Q) are gradient memory
            held = [4 * (d.held_elements(p - e) + (x.held_elements(e) if edp > 1 else 0.0))
                    for (d, x), p, e in zip(psgd, b.params, b.experts, strict=True)]
            buffers = tuple(buf + h for buf, h in zip(buffers, held, strict=True))
            totals = [t + h for t, h in zip(totals, held, strict=True)]
        worst = max(range(len(totals)), key=totals.__getitem__)
        host = max((p - e) * host_dense + e * host_expert for p, e in zip(b.params, b.experts, strict=True))
        return _ZeroBytes(dense=dense, expert=expert, gather=gather, buffers=buffers, handed=handed, acts=acts,
                          transient=transient, worst=worst, total=totals[worst] + gather, host=host, psgd=psgd,
                          psgd_time=psgd_time)

    def _zero_time(self, b: _Base, z: _ZeroBytes, zero: int, dp: int, ep: int) -> _Zero:
        """_with_zero's DP traffic, offload, optimizer and step for the memory `z`."""
        a = self.ctx.assume
        edp = dp // ep
        sharded = zero >= 3 and dp > 1
        weight_bytes = memory.fsdp_gather_bytes(self.ctx.precision) if zero >= 3 else z.dense[0] if zero >= 1 else 4
        grad_bytes = 2 if self.ctx.grad_reduce_bf16 else 4
        psgd = z.psgd
        dense_r = max(range(len(b.params)), key=lambda r: b.params[r] - b.experts[r])
        expert_r = max(range(len(b.params)), key=lambda r: b.experts[r])
        d_psgd = (psgd[dense_r][0].compressed_params, psgd[dense_r][0].factor_elements) if psgd else None
        e_psgd = (psgd[expert_r][1].compressed_params, psgd[expert_r][1].factor_elements) if psgd else None
        dp_traffic = comm.dp_traffic(b.max_params, zero, dp, b.n_micro, grad_bytes, weight_bytes, b.units, d_psgd,
                                     kept=b.head_unit[dense_r])
        fsdp_s = 0.0
        if sharded:  # a profile's measured FSDP2 unit replaces the pricing of the layers' gathers (exposed)
            unit = self.rates.fsdp_unit(b.links["dp"], b.layer_params_gpu * weight_bytes, dp)
            if unit is not None:
                layers = max(b.prof.rank_layers)
                ends = max(0.0, b.max_params - layers * b.layer_params_gpu)
                fsdp_s = b.n_micro * layers * unit
                # the ends' units (embedding, final norm + head) stay priced by the all-gather fit: forward, and
                # backward but for the head's unit, kept gathered
                ends_units = b.units - layers
                dp_traffic = [dp_traffic[0],
                              ("all_gather", b.n_micro * comm.gather_bytes(ends * weight_bytes, dp),
                               float(b.n_micro * ends_units)),
                              ("all_gather", b.n_micro * comm.gather_bytes((ends - b.head_unit[dense_r]) * weight_bytes,
                                                                           dp),
                               float(b.n_micro * max(0, ends_units - (b.head_unit[dense_r] > 0))))]
        edp_traffic = comm.dp_traffic(b.max_experts, zero, edp, b.n_micro, grad_bytes, weight_bytes, b.units,
                                      e_psgd)
        dp_parts = self._dp_times(b.links["dp"], dp_traffic, dp, b.spread["dp"])
        edp_parts = self._dp_times(b.links["expert_dp"], edp_traffic, edp, b.spread["expert_dp"])
        t_dp, t_edp = sum(dp_parts), sum(edp_parts)
        copy_s, cpu_s = self._offload_seconds(b, zero, dp, edp) if z.host else (0.0, 0.0)
        opt_s = self._optimizer_seconds(b, zero, dp, offloaded=bool(z.host))
        passes = self._weight_pass_seconds(b, zero, dp)
        dp_exposed = step = None
        if b.slot is not None:
            slot = b.slot + passes
            overlap = self.rates.dp_overlap(b.links["dp"])  # measured by calibrate, else the assumption
            overlap = a.dp_overlap if overlap is None else overlap
            if overlap is None:  # what the bundled trainer hides, bucket by bucket
                dp_exposed = (t_dp + t_edp) - self._trainer_hidden(b, zero, [
                    (dp_traffic, dp_parts, b.max_params), (edp_traffic, edp_parts, b.max_experts)])
            else:
                window = self._stack_dp_window(b, slot, [*dp_traffic, *edp_traffic], [*dp_parts, *edp_parts]) \
                    if zero <= 1 else b.n_micro * slot
                dp_exposed = (t_dp + t_edp) - min(overlap * (t_dp + t_edp), window)
            step = slot * (b.n_micro + b.bubble_slots) + dp_exposed + b.emb_time + copy_s + cpu_s + opt_s + fsdp_s
            if psgd:
                step += z.psgd_time  # PowerSGD's matmuls and QRs run after the backward, between its collectives
        return _Zero(dense=z.dense, expert=z.expert, gather=z.gather, buffers=z.buffers, handed=z.handed,
                     acts=z.acts, transient=z.transient, worst=z.worst, total=z.total,
                     dp_bytes=sum(x for _, x, _ in dp_traffic), edp_bytes=sum(x for _, x, _ in edp_traffic),
                     dp_time=t_dp, edp_time=t_edp, dp_exposed=dp_exposed, step=step, host=z.host,
                     offload_copy=copy_s, offload_step=cpu_s, optimizer=opt_s, fsdp=fsdp_s, weight_pass=passes)

    def _backward_share(self, b: _Base) -> float:
        """The backward's part of a slot: 2/3 of the layer's FLOPs without recompute, more with it."""
        return 1 - self._layer_flops["none"] / 3 / self._layer_flops[b.load_recompute]

    def _stack_dp_window(self, b: _Base, slot: float, traffic: list[tuple[str, float, float]],
                         seconds: list[float]) -> float:
        """Seconds of ZeRO 0/1's once-per-step DP traffic that a stack overlapping it as Megatron-Core does can hide
        (estimate.dp_overlap, or a calibration's measured share, says how much it does): the gradient reduction
        behind the backward still to run (schedule.reduce_exposed: one micro-batch's backward, or the interleaved
        schedule's chunk by chunk), the weight all-gather behind the next step's first forward, bucket after bucket
        (Megatron-Core's distributed optimizer gathers the next bucket as the forward reaches the current one)."""
        backward = self._backward_share(b)
        reduce_s = sum(t for (op, _, _), t in zip(traffic, seconds, strict=True) if op != "all_gather")
        gather_s = sum(seconds) - reduce_s
        pp, v = b.shape_key[1], b.shape_key[2]
        exposed = schedule.reduce_exposed(reduce_s, pp, v, b.schedule, slot * backward)
        return reduce_s - exposed + min(gather_s, slot * (1 - backward))

    def _weight_pass_seconds(self, b: _Base, zero: int, dp: int) -> float:
        """Each micro-batch's passes over the busiest pipeline rank's matmul weights beyond the GEMMs and over its
        gradient buffer, at HBM bandwidth (operators.weight_pass_bytes, gradient_buffer_pass_bytes), on the
        slot. Priced by the operator model only: a flat rate has no bandwidth term, and a calibration profile's
        layers were timed without the gradient buffers. ZeRO-3: FSDP2 keeps the weights it gathered for
        zero-bubble schedules (one gather per micro-batch, not two)."""
        dev = self.device
        if dev is None or self.rates.calibrated:
            return 0.0
        ctx = self.ctx
        per = operators.weight_pass_bytes(
            ctx.assume.grad_accumulation, precision=ctx.precision, zero=zero, dp=dp, pp=len(b.params),
            micro_batches=b.n_micro, recompute=b.load_recompute, reduce_bf16=ctx.grad_reduce_bf16,
            gathers=1 if b.schedule in ("zero-bubble", "zbv") else 2)
        buffer = operators.gradient_buffer_pass_bytes(ctx.assume.grad_accumulation, zero=zero, dp=dp,
                                                      micro_batches=b.n_micro, reduce_bf16=ctx.grad_reduce_bf16)
        fp8 = 0.0
        if ctx.fp8 and ctx.assume.grad_accumulation == "auto":  # the layers' FP8 GEMMs quantize their weights
            fp32_weights = not (memory.bf16_params(ctx.precision, zero, dp) or (zero >= 3 and dp > 1))
            cast = operators.autocast_cast_bytes(precision=ctx.precision, fp32_weights=fp32_weights,
                                                 pp=len(b.params), micro_batches=b.n_micro, recompute=b.load_recompute)
            fp8 = operators.fp8_weight_pass_bytes(weight_bytes=4 if fp32_weights else 2,
                                                  eager=dev.elementwise == "eager", recompute=b.load_recompute,
                                                  autocast_cast_per_mb=cast)
        return (b.matmul_params * per + b.layer_matmul_params * fp8 + max(b.params) * buffer) / dev.hbm_bw

    def _psgd(self, b: _Base) -> tuple[tuple[tuple[powersgd.Compression, powersgd.Compression], ...] | None, float]:
        """PowerSGD at the context's rank (None without): per pipeline rank (dense, routed-expert) figures, and
        the seconds of the busiest rank's extra compute."""
        rank = self.ctx.powersgd_rank
        if not rank:
            return None, 0.0
        psgd = self._compression(*b.shape_key, rank)
        rate = self.rates.compute(b.shape_key[0])
        return psgd, max((d.flops + e.flops) / rate for d, e in psgd) if rate else 0.0

    def _optimizer_seconds(self, b: _Base, zero: int, dp: int, offloaded: bool = False) -> float:
        """The optimizer step (gradient norm, clipping, AdamW) on the slowest pipeline rank, by a profile's
        fixed work (0 without): ZeRO-1/2 step the rank's fragments of the master (about a dp-th of its tensors
        and elements), ZeRO-3 every local shard (a dp-th of the elements), ZeRO-0 every parameter."""
        fixed = self.rates.fixed
        shard = dp if zero >= 1 and dp > 1 else 1
        if fixed is None:  # the operator model: the step's bytes at HBM bandwidth, on the rank's shard
            dev = self.device
            if dev is None or offloaded:  # offload: the CPU steps
                return 0.0
            return max(b.params) / shard * GPU_OPTIMIZER_BYTES / dev.hbm_bw
        split = shard if zero in (1, 2) else 1
        p = b.prof
        return max(fixed.optimizer_seconds(max(1.0, fixed.stage_tensors(n, f, la) / split), params / shard)
                   for n, f, la, params in zip(p.rank_layers, p.has_first, p.has_last, b.params, strict=True))

    def _offload_seconds(self, b: _Base, zero: int, dp: int, edp: int) -> tuple[float, float]:
        """(host<->device copies, CPU AdamW) seconds per step under optimizer offload, on the pipeline rank with
        the most parameters (module docstring)."""
        ctx, a = self.ctx, self.ctx.assume
        # elements of the optimizer slice: dense parameters sharded over dp, experts over dp/ep (one replica of
        # the experts keeps its state on the GPU)
        n = max((p - e) / dp + (e / edp if edp > 1 else 0.0) for p, e in zip(b.params, b.experts, strict=True))
        if zero >= 3:  # FSDP2: each gather copies the shard up, each reduction the gradient shard down
            moved = b.n_micro * n * 4 * 3  # two gathers (forward, backward) and one reduction per micro-batch
        else:
            moved = n * (4 + (2 if memory.bf16_params(ctx.precision, zero, dp) else 4))
        return moved / (a.offload_pcie_gbps * 1e9), n * OFFLOAD_STEP_BYTES / (a.host_adam_gbps * 1e9)

    def host_fits(self, host_per_gpu: float) -> bool:
        """Whether a node's GPUs' offloaded optimizer state (`host_per_gpu` bytes each) fits its host memory."""
        cap = self.ctx.hw.host_memory_bytes
        return not host_per_gpu or cap is None or host_per_gpu * self._node_gpus() <= cap

    def _node_gpus(self) -> int:
        return min(self.ctx.world, self.ctx.hw.gpus_per_node)

    def _zero2_buffers(self, params: float, largest: int, dp: int) -> float:
        slot = memory.zero2_slot_numel(round(params), largest, dp, memory.dp_bucket_numel())
        return float(memory.zero2_buffer_bytes(slot, dp, self.ctx.grad_reduce_bf16))

    def _dp_times(self, link: str, traffic: list[tuple[str, float, float]], group: int, per_node: int
                  ) -> list[float]:
        """Seconds of each of the DP collectives `traffic` lists (op, bytes, calls)."""
        return [self.rates.comm(link, ((op, 1.0),), nbytes, calls, group, per_node) for op, nbytes, calls in traffic]

    def _trainer_hidden(self, b: _Base, zero: int,
                        groups: list[tuple[list[tuple[str, float, float]], list[float], float]]) -> float:
        """Seconds of DP traffic the bundled trainer hides behind compute (runtime/parallel/data_parallel.py): each
        gradient bucket's reduction starts when its parameters' gradients are complete and overlaps the backward
        still to run, so all but the last bucket's hide behind the backward of the last micro-batch (ZeRO-0/1, once a
        step) or of every micro-batch (ZeRO-2, each one's); ZeRO-1/2's weight all-gather follows the optimizer step,
        exposed. FSDP2 (ZeRO-3) prefetches each unit's gathers and reduces a unit's gradients while the next
        computes: all but one unit's traffic hides behind the micro-batches' forward and backward."""
        backward = self._backward_share(b)
        window = b.slot * (b.n_micro if zero >= 2 else 1) * (1 if zero >= 3 else backward)
        hidden = 0.0
        for traffic, seconds, params in groups:  # each collective's (op, bytes, calls) and its seconds
            if not traffic:
                continue
            pieces = b.units if zero >= 3 else max(1, ceil(params / self.bucket_numel))
            overlappable = sum(t for (op, _, _), t in zip(traffic, seconds, strict=True)
                               if zero >= 3 or op != "all_gather")
            hidden += overlappable * (1 - 1 / pieces)
        return min(hidden, window)

    def _spread(self, tp: int, dp: int, cp: int, ep: int) -> dict[str, int]:
        """Ranks of one group of each kind on one node (Megatron order tp-cp-ep-dp-pp: a group at stride s has
        gpus_per_node // s of its ranks on a node): across nodes NCCL drives that many NICs at once."""
        gpn = self.ctx.hw.gpus_per_node

        def on_node(size: int, stride: int) -> int:
            return max(1, min(size, gpn // stride)) if stride < gpn else 1

        return {"tp": on_node(tp, 1), "pp": 1, "embedding": 1, "ep": on_node(ep, tp), "cp": on_node(cp, tp),
                "pp_gather": on_node(tp, 1),
                "dp": on_node(dp * cp, tp), "expert_dp": on_node(max(1, dp * cp // ep), tp * ep)}

    def step_floor(self, c: Candidate) -> float | None:
        """A floor under score(c)'s step seconds from the cached per-rank load alone (no _Base): the slowest
        pipeline rank's compute through the pipeline, m + bubble slots. Every other term of the step (TP, PP, EP,
        CP and exposed DP communication, the ends' fixed work, offload, the optimizer) is >= 0, so a layout whose
        floor is above a known step cannot beat it. None when the compute rate is unknown."""
        return self._step_floor(c.tp, c.pp, c.dp, c.cp, c.virtual_stages, c.schedule, c.micro_batch, c.recompute,
                                c.sequence_parallel and c.tp > 1, c.stage_layers)

    def _make_step_floor(self, tp: int, pp: int, dp: int, cp: int, v: int, schedule_: str, mb: int,
                         recompute: str, sp: bool, stage_layers: tuple[int, ...] | None) -> float | None:
        rate = self.rates.compute(tp)
        if not rate:
            return None
        layers = stage_layers if stage_layers is not None else self._default_split(pp * v)
        load = self._load(tp, pp, v, layers, recompute, schedule_, mb, cp, sp)
        n_micro = self.ctx.global_batch // (mb * dp)
        tokens_mb = mb * self.ctx.shape.seq_len / cp
        per_token = load.seconds[load.slow]
        if isinstance(self.rates, AssumedRates):
            # assumed rates price bytes linearly (no latency, no measured layer): the slot's TP collectives and
            # p2p sends are then exactly these per-token costs, as _make_base prices them
            m, world, domain = self.ctx.shape, self.ctx.world, self.ctx.hw.nvlink_domain
            msg = m.hidden * self.act_bytes
            if tp > 1:
                tp_cost = self.rates.comm(comm.tp_link(tp, world, domain), TP_OPS[sp], comm.all_reduce_bytes(msg, tp),
                                          per_node=self._spread(tp, dp, cp, 1)["tp"])
                per_token += load.collectives[load.slow] * tp_cost * self._tp_exposed(tp, cp, mb, sp, recompute)
            if pp > 1:
                sends = max(self._profile(pp, v, layers, schedule_).sends)
                pp_msg = m.hidden * self.stream_bytes / self._pp_split(tp, sp)
                per_token += self.rates.comm(comm.pp_link(pp, world, domain), PP_OPS, sends * pp_msg)
        return per_token * tokens_mb * (n_micro + schedule.bubble_slots(pp, v, schedule_, n_micro))

    def _pp_split(self, tp: int, sp: bool) -> int:
        """Over how many TP ranks a pipeline send is split: tp under sequence parallelism (each sends its sequence
        shard) or the scatter/gather optimization (estimate.pp_scatter_gather), else 1 (the whole tensor)."""
        return tp if sp or self.ctx.assume.pp_scatter_gather else 1

    def score(self, c: Candidate) -> tuple[float | None, float]:
        """(predicted step seconds, worst pipeline rank's bytes per GPU): what `--auto` ranks by; the same
        numbers as evaluate(c).step_time and evaluate(c).memory_total."""
        step, total, _, _ = self.score_dp(c)
        return step, total

    def score_dp(self, c: Candidate) -> tuple[float | None, float, float, bool]:
        """score(c), the exposed DP seconds of that step (evaluate(c).dp_exposed_time, or 0) and whether its
        offloaded optimizer state fits the node's host memory (evaluate(c).host_fits)."""
        z = self._with_zero(self._base(c), c.zero, c.dp * c.cp, c.ep, c.offload)
        return z.step, z.total, z.dp_exposed or 0.0, self.host_fits(z.host)

    def score_fitting(self, c: Candidate, capacity: float | None) -> tuple[float | None, float] | None:
        """score(c) for a layout whose bytes per GPU fit `capacity` (None: any) and whose offloaded optimizer
        state fits its node's host memory; None for one that does not, without pricing its step: in a large
        search most layouts do not fit."""
        b = self._base(c)
        dp = c.dp * c.cp
        z = self._zero_bytes(b, c.zero, dp, c.ep, c.offload)
        if (capacity is not None and z.total > capacity) or not self.host_fits(z.host):
            return None
        return self._zero_time(b, z, c.zero, dp, c.ep).step, z.total

    def evaluate(self, c: Candidate, detail: bool = True) -> Estimate:
        """All figures of one layout. detail=False skips the per-rank memory table."""
        ctx, m = self.ctx, self.ctx.shape
        b = self._base(c)
        z = self._with_zero(b, c.zero, c.dp * c.cp, c.ep, c.offload)  # gradients reduce, ZeRO shards, over dp x cp

        def rank_memory(r: int) -> RankMemory:
            p, e = b.params[r], b.experts[r]
            (wd, gd, od), (we, ge, oe) = z.dense, z.expert
            return RankMemory(pp_rank=r, params=p, weights=(p - e) * wd + e * we,
                              gradients=(p - e) * gd + e * ge + z.buffers[r], optimizer=(p - e) * od + e * oe,
                              activations=z.acts[r], transient=z.transient[r] + z.handed[r] + z.gather, expert_params=e)

        ranks = tuple(rank_memory(r) for r in range(c.pp)) if detail else ()
        slot = None if b.slot is None else b.slot + z.weight_pass  # the ZeRO stage's weight passes on every slot
        comm_bytes = {"tp": b.tp_bytes, "pp": b.pp_bytes, "dp": z.dp_bytes, "embedding": b.emb_bytes}
        if m.moe is not None:
            comm_bytes.update(ep=b.ep_bytes, expert_dp=z.edp_bytes)
        if c.cp > 1:
            comm_bytes["cp"] = b.cp_bytes
        if b.pp_gather_bytes:
            comm_bytes["pp_gather"] = b.pp_gather_bytes
        comm_time = {k: self.rates.comm(b.links[k], b.ops[k], comm_bytes[k], b.calls[k], b.groups[k], b.spread[k])
                     for k in comm_bytes if k not in ("dp", "expert_dp")}
        comm_time["dp"] = z.dp_time
        if m.moe is not None:
            comm_time["expert_dp"] = z.edp_time
        return Estimate(
            cand=c, micro_batches=b.n_micro, stage_layers=b.layers,
            model_flops=self.model_flops_per_token * self.tokens_per_step,
            hardware_flops=(m.layers * self._layer_flops[c.recompute]
                            + model.head_flops_per_token(m, b.vp)) * self.tokens_per_step,
            hardware_flops_per_gpu_max=max(b.load.flops) * self.tokens_per_step / (c.dp * c.cp),
            stage_imbalance=b.load.imbalance, rank_flops_per_token=b.load.flops,
            ranks=ranks, worst=ranks[z.worst] if detail else rank_memory(z.worst), capacity=ctx.hw.usable_bytes,
            comm_bytes=comm_bytes, comm_link={k: b.links[k] for k in comm_bytes}, comm_time=comm_time,
            bubble_fraction=schedule.bubble_fraction(c.pp, b.n_micro, c.virtual_stages, c.schedule),
            bubble_over_ideal=schedule.bubble_over_ideal(c.pp, b.n_micro, c.virtual_stages, c.schedule),
            compute_time=None if b.compute_mb is None else b.n_micro * b.compute_mb,
            tp_exposed_time=b.tp_exposed, p2p_time=b.n_micro * b.p2p,
            bubble_time=None if slot is None else slot * b.bubble_slots,
            weight_pass_time=b.n_micro * z.weight_pass,
            dp_time=z.dp_time + z.edp_time, dp_exposed_time=z.dp_exposed,
            embedding_sync_time=b.emb_time, step_time=z.step,
            host_per_gpu=z.host, host_per_node=z.host * self._node_gpus(), host_capacity=ctx.hw.host_memory_bytes,
            offload_copy_time=z.offload_copy, offload_step_time=z.offload_step,
            optimizer_time=z.optimizer, fsdp_time=z.fsdp, ends_time=b.n_micro * b.ends_mb,
            extra={"tokens_per_step": float(self.tokens_per_step), "ep_time": b.n_micro * b.ep_mb_time,
                   "expert_pace": self.expert_pace, "cp_time": b.n_micro * b.cp_mb_time,
                   "cp_layer_time": b.cp_layer_time, "attn_layer_time": b.attn_layer_time or 0.0,
                   "dispatch_time": b.n_micro * b.dispatch_mb,
                   "pipeline_drain_time": 0.0 if slot is None else slot * b.bubble_slots * schedule.drain_share(
                       c.pp, c.virtual_stages, c.schedule, b.n_micro,
                       backward_share=1 - self._layer_flops["none"] / 3 / self._layer_flops[c.recompute]),
                   **self._powersgd_extra(b, c)},
        )

    def _powersgd_extra(self, b: _Base, c: Candidate) -> dict[str, float]:
        """PowerSGD's figures of the busiest pipeline rank (plan --json's grad_compression)."""
        psgd, psgd_time = self._psgd(b)
        if psgd is None or c.zero > 1 or c.dp * c.cp == 1:
            return {}
        d, x = max(psgd, key=lambda de: de[0].flops + de[1].flops)
        return {"powersgd_time": psgd_time, "powersgd_flops": d.flops + x.flops,
                "powersgd_compressed_params": d.compressed_params + x.compressed_params,
                "powersgd_factor_elements": d.factor_elements + x.factor_elements}


class _ZeroBytes(NamedTuple):
    """What `_zero_bytes` works out: the memory half of `_Zero`, and PowerSGD's figures its time half uses."""

    dense: tuple[float, float, float]
    expert: tuple[float, float, float]
    gather: float
    buffers: tuple[float, ...]
    handed: tuple[float, ...]
    acts: tuple[float, ...]
    transient: tuple[float, ...]
    worst: int
    total: float
    host: float
    psgd: tuple[tuple[powersgd.Compression, powersgd.Compression], ...] | None
    psgd_time: float


@dataclass(frozen=True)
class _Zero:
    """What `_with_zero` works out for one ZeRO stage."""

    dense: tuple[float, float, float]  # (weights, gradients, optimizer) bytes per non-expert parameter
    expert: tuple[float, float, float]  # the same per routed-expert parameter (sharded over dp/ep)
    gather: float  # ZeRO-3 gather buffers
    buffers: tuple[float, ...]  # per pipeline rank: ZeRO-2's bucket buffers (gradients)
    handed: tuple[float, ...]  # per pipeline rank: one parameter's gradient handed over by autograd (transient)
    acts: tuple[float, ...]  # per pipeline rank: activations, autocast's weight copies included where made
    transient: tuple[float, ...]  # per pipeline rank: the recompute working set, likewise
    worst: int  # the pipeline rank with the most bytes
    total: float  # its bytes per GPU
    dp_bytes: float
    edp_bytes: float
    dp_time: float
    edp_time: float
    dp_exposed: float | None
    step: float | None
    host: float = 0.0  # optimizer offload: host bytes of one GPU (its worst pipeline rank)
    offload_copy: float = 0.0  # seconds per step
    offload_step: float = 0.0
    optimizer: float = 0.0  # the optimizer step (a profile's fixed work)
    fsdp: float = 0.0  # ZeRO-3: the FSDP2 units' measured extra time (a profile's fixed work)
    weight_pass: float = 0.0  # per micro-batch: the passes over the matmul weights beyond the GEMMs (on the slot)

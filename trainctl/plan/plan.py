"""`build_plan(spec) -> Plan`: every figure `trainctl plan` prints, and its JSON form.

The JSON carries plain units only: counts, bytes, FLOPs, seconds, bytes/s, FLOP/s, fractions.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from trainctl import model_shape
from trainctl.checkpoint import storage
from trainctl.hardware.catalog import Accelerator, gemm_speedup, peak_tflops_for, resolve_accelerator, resolve_fabric
from trainctl.model_shape import ModelShape, ParamCounts
from trainctl.plan import operators, record
from trainctl.plan.bubble import BUBBLE_DEFINITION
from trainctl.plan.cadence import Cadence, configured_interval, job_mtbf
from trainctl.plan.checkpoint_size import checkpoint_bytes, save_seconds
from trainctl.plan.checks import PlanWarning, advise
from trainctl.plan.elastic import NodeCount, node_list, shrink_options
from trainctl.plan.elastic import summary as elastic_summary
from trainctl.plan.estimate import (
    GPU_OPTIMIZER_BYTES,
    Assumptions,
    Candidate,
    Context,
    Estimate,
    Evaluator,
    Hardware,
    assumed_rates,
)
from trainctl.plan.memory import compute_precision, host_memory_bytes, reserve_bytes
from trainctl.plan.placement import Groups, Layout, placement_table
from trainctl.plan.rates import describe, measured_rates
from trainctl.plan.whole_run import TimeLimit, WholeRun, whole_run_summary
from trainctl.spec import time_limit
from trainctl.spec.models import RunSpec
from trainctl.units import dur

ROOFLINE = (
    "step = slot*(m + (p-1)/v) + exposed DP + tied-embedding sync (+ offload copies and CPU AdamW); slot = max "
    "over pipeline ranks of (hardware FLOPs per micro-batch / FLOP/s + TP time * (1-tp_overlap)) + pipeline p2p, "
    "MoE all-to-all and CP K/V exchange per micro-batch (not overlapped; a pipeline send 1/tp of the tensor under "
    "sequence parallelism or estimate.pp_scatter_gather, whose receiver gathers the pieces over the TP link) + "
    "the weight passes (each micro-batch's casts and gradient adds over the rank's matmul weights and gradient "
    "buffer at HBM bandwidth, estimate.grad_accumulation); "
    "exposed DP = DP time - what hides: the bundled trainer's buckets (all but the last bucket's reduction behind "
    "the last micro-batch's backward, ZeRO-2 every micro-batch's; the ZeRO-1/2 weight all-gather exposed; ZeRO-3 "
    "all but one FSDP unit's traffic), or with estimate.dp_overlap min(dp_overlap*DP time, what Megatron-Core's "
    "overlap can hide for ZeRO 0/1: the gradient reduction behind the last micro-batch's backward, interleaved "
    "chunk by chunk behind the last p micro-batches of each, and the weight all-gather behind the first forward; "
    "all m slots for ZeRO 2/3); the layers' times from the operator model (plan/operators.py) and collectives "
    "from NCCL's cost model, or flat shares of peak and link (estimate.compute_efficiency, comm_efficiency), or a "
    "calibration profile's measured FLOP/s and latency*calls + bytes / measured bandwidth"
)
NOTES = (
    "model FLOPs per token = 6*N + 12*L*h*s (N: every matmul weight incl. the LM head, no embedding "
    "lookups; causal attention not halved; recompute not counted); hardware FLOPs add recompute and the "
    "padded vocabulary",
    "memory: what the trainer allocates: weights (fp32; bf16 under bf16 ZeRO-1/2), an fp32 gradient buffer, "
    "fp32 AdamW (ZeRO-1/2: fp32 master and moments of a 1/dp slice; ZeRO-2 keeps only its fp32 gradient "
    "slice plus two bucket buffers, reduce-scattering every micro-batch; ZeRO-3 shards all); "
    "activations as its autograd saves them (scaled_dot_product_attention: no s x s scores) times the "
    "micro-batches in flight on each pipeline rank; capacity is the catalog's GB (10^9 bytes) less a "
    "3 GiB reserve on GPUs (CUDA context, NCCL buffers, fragmentation)",
    "mixture of experts: N counts the active matmul weights (router, top_k experts, shared experts); expert "
    "weights split over ep (x tp), their gradients and optimizer state over the expert-data-parallel group "
    "(dp/ep); the all-to-all (dispatch + combine, forward + backward) sits on the slot unoverlapped; the routed "
    "experts' compute and activations are charged x the load-imbalance allowance (or the capacity factor)",
    "context parallelism: each GPU computes s/cp tokens of every sequence (2*cp chunks, rank i holds chunks i "
    "and 2cp-1-i: causal work balanced); K/V all-gathered per layer over the CP group (reduce-scatter in backward, "
    "gathered again under recompute), whole-sequence K/V kept for backward; gradients reduced and ZeRO sharded "
    "over dp*cp",
    "optimizer offload: the fp32 master and moments (ZeRO-3: every shard) in host memory, each node's total "
    "checked against cluster.host_memory_gb; the step adds the gradient copy down and the parameter copy up "
    "(ZeRO-3: per gather and micro-batch) at estimate.offload_pcie_gbps and the CPU AdamW step (28 bytes per "
    "element at estimate.host_adam_gbps), after the backward, not overlapped",
    "with a calibration profile: the optimizer step, the embedding and LM head + loss per micro-batch, a TP "
    "layer as measured in its TP group, (ZeRO-3) a layer as an FSDP2 unit and (GPU) the host's dispatch floor "
    "(a layer takes at least what the host takes to issue its kernels, timed on a few tokens), all measured by "
    "trainctl calibrate",
    f"the optimizer step on a GPU without a profile: its bytes ({GPU_OPTIMIZER_BYTES} per element of the rank's "
    "shard: AdamW, the gradient norm and clipping, the 16-bit copy) at HBM bandwidth",
    "not modelled: without a profile, kernel launch and host overheads (and on CPUs the optimizer step); data "
    "loading, hierarchical (NVLS) collectives, network congestion",
)

OUTSIDE_LAYERS_SOURCE = ("measured by trainctl calibrate (fits.fixed): the ends per micro-batch at the profile's "
                         "micro-batch, scaled by tokens; the optimizer step per tensor and element of the rank")


def cpu_cores() -> int:
    """Cores of a CPU rank's node: this machine's, as for `host_memory_bytes` (a CPU run's ranks run here)."""
    return os.cpu_count() or 1


def dp_overlap(configured: float | None, on_cpu: bool, ranks_per_node: int) -> float | None:
    """estimate.dp_overlap, or its default: None, what the bundled trainer hides bucket by bucket
    (Evaluator._trainer_hidden); on CPUs 0 when the ranks occupy every core of the node: gloo's reduction then
    competes with the backward for them (measured here, 2 ranks on 2 cores: the sync a DP step waits for was
    longer than the whole predicted all-reduce)."""
    if configured is not None:
        return configured
    return 0.0 if on_cpu and ranks_per_node >= cpu_cores() else Assumptions.dp_overlap


def context_from_spec(spec: RunSpec) -> Context:
    c = spec.cluster
    acc = resolve_accelerator(c)
    fabric = resolve_fabric(c)
    on_cpu = c.gpu == "cpu"
    precision = compute_precision(spec.train.precision, on_cpu, spec.train.low_precision_on_cpu)
    peak = peak_tflops_for(acc, spec.train.precision)
    layout = Layout.from_spec(spec)
    hw = Hardware(
        gpu=c.gpu, peak_flops=peak * 1e12 if peak else None,
        memory_bytes=acc.memory_gb * 1e9 if acc.memory_gb else None,
        # The NVLink domain as the spec rules and the placement see it (one source of truth for the layout).
        nvlink_domain=layout.nvlink_domain, gpus_per_node=c.gpus_per_node,
        nvlink_bw=acc.nvlink_gbps * 1e9, inter_node_bw=fabric.gbps_per_gpu * 1e9,
        link=getattr(acc, "link", "nvlink"), fabric=fabric.key, reserve_bytes=reserve_bytes(not on_cpu),
        host_memory_bytes=host_memory_bytes(c.host_memory_gb, on_cpu),
    )
    e = spec.estimate
    assume = Assumptions(compute_efficiency=e.compute_efficiency, comm_efficiency=e.comm_efficiency,
                         dp_overlap=dp_overlap(e.dp_overlap, on_cpu, c.gpus_per_node), tp_overlap=e.tp_overlap,
                         pp_scatter_gather=e.pp_scatter_gather,
                         offload_pcie_gbps=e.offload_pcie_gbps, host_adam_gbps=e.host_adam_gbps,
                         moe_imbalance=e.moe_imbalance, grad_accumulation=e.grad_accumulation)
    elementwise = e.elementwise if e.elementwise != "auto" else "fused" if spec.train.compile else "eager"
    device = (operator_device(acc, hw.peak_flops, e.attention_kernel, elementwise) if e.compute_efficiency is None
              else None)
    rates = measured_rates(spec, assumed_rates(hw, assume, device))  # cluster.calibration (plan/rates.py)
    if rates is not None and hw.peak_flops is None:  # a CPU: MFU against the peak measured where it runs
        hw = replace(hw, peak_flops=rates.profile.peak_flops)
    return Context(
        shape=ModelShape.from_spec(spec.model), global_batch=spec.train.global_batch,
        precision=precision, world=spec.world_size, hw=hw, assume=assume,
        grad_reduce_bf16=spec.parallel.grad_reduce_dtype == "bf16", rates=rates,
        powersgd_rank=spec.parallel.powersgd.rank if spec.parallel.powersgd else None, on_gpu=not on_cpu,
        device=device,
        fp8=spec.train.precision == "fp8", gemm_speedup=gemm_speedup(acc, spec.train.precision),
    )


# The attention kernel the bundled trainer runs on a GPU: torch's scaled_dot_product_attention picks its flash
# backend, FlashAttention-2 (estimate.attention_kernel names another stack's).
TRAINER_ATTENTION_KERNEL = "flash2"


def operator_device(acc: Accelerator, peak_flops: float | None, kernel: str,
                    elementwise: str = "eager") -> operators.Device | None:
    """The operator model's view of the accelerator (plan/operators.py); None where the catalog lacks its figures
    (the CPU, a custom part): the layers then run at a flat share of the peak."""
    name = TRAINER_ATTENTION_KERNEL if kernel == "auto" else kernel
    flash = acc.attention("flash2" if name == "unfused" else name)
    if not peak_flops or acc.gemm_efficiency is None or not acc.sm_count or not acc.hbm_gbps or flash is None:
        return None
    return operators.Device(peak_flops=peak_flops, gemm_efficiency=acc.gemm_efficiency, sm_count=acc.sm_count,
                            hbm_bw=acc.hbm_gbps * 1e9, attention_curves=acc.attention_curves,
                            kernel="unfused" if name == "unfused" else flash, elementwise=elementwise,
                            gemm_shapes=acc.gemm_shapes)


def priced_with(ctx: Context) -> dict[str, Any]:
    """The assumptions a plan (or plan --auto's search) priced with, as both print them (cli/plan_cmd.rates_text):
    the spec's estimate.* and the attention kernel and elementwise passes the operator model resolved them to."""
    dev = ctx.device
    return {**asdict(ctx.assume), "attention_kernel": dev.kernel if dev is not None else None,
            "elementwise": dev.elementwise if dev is not None else None}


def candidate_from_spec(spec: RunSpec) -> Candidate:
    p = spec.parallel
    return Candidate(
        tp=p.tp, pp=p.pp, dp=spec.dp, zero=p.zero, micro_batch=p.micro_batch, recompute=spec.train.recompute,
        sequence_parallel=p.sequence_parallel, schedule=p.schedule, virtual_stages=p.virtual_stages,
        stage_layers=tuple(p.stage_layers) if p.stage_layers is not None else None, ep=p.ep, cp=p.cp,
        offload=p.offload == "optimizer",
    )


@dataclass(frozen=True)
class Plan:
    name: str
    ctx: Context
    cand: Candidate
    est: Estimate
    params: ParamCounts
    warnings: tuple[PlanWarning, ...]
    layout: Layout
    checkpoint: dict[str, Any]  # bytes per save, its blocking and total seconds, the Young/Daly cadence
    elastic: tuple[NodeCount, ...] = ()  # cluster.min_nodes: the layout on each node count it may shrink to
    record: dict[str, Any] | None = None  # the published record's range on this GPU part (record_band)

    # --- headline figures -----------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.ctx.world

    @property
    def peak(self) -> float | None:
        return self.ctx.hw.peak_flops

    @property
    def mfu(self) -> float | None:
        return self.est.mfu(self.world, self.peak)

    @property
    def hfu(self) -> float | None:
        if not self.est.step_time or not self.peak:
            return None
        return self.est.hardware_flops / (self.est.step_time * self.world * self.peak)

    @property
    def model_flops_per_s_per_gpu(self) -> float | None:
        if not self.est.step_time:
            return None
        return self.est.model_flops / self.est.step_time / self.world

    @property
    def params_per_rank(self) -> list[int]:
        """Parameters one GPU of each pipeline rank holds (TP-sharded, padded vocabulary, before ZeRO-3
        sharding): the trainer records the same list in its start event."""
        return [round(r.params) for r in self.est.ranks]

    def dominant(self) -> dict[str, Any] | None:
        """The largest part of the predicted step and its share."""
        parts = self.breakdown()
        if not parts or not self.est.step_time:
            return None
        name = max(parts, key=parts.__getitem__)
        return {"part": name, "seconds": parts[name], "share": parts[name] / self.est.step_time}

    @property
    def errors(self) -> list[PlanWarning]:
        return [w for w in self.warnings if w.level == "error"]

    @property
    def fits(self) -> bool:
        return self.est.fits

    def calibration(self) -> dict[str, Any]:
        """Where the times come from (rates.describe), with the published record's range on this GPU part
        where the uncalibrated operator model priced the step (record_band)."""
        cal = describe(self.ctx.rates)
        return {**cal, "record": self.record} if self.record is not None else cal

    def breakdown(self) -> dict[str, float] | None:
        """Where the predicted step goes (seconds, summing to the step), or None when times are unknown."""
        return breakdown_of(self.est)

    def outside_layers(self) -> dict[str, Any] | None:
        """The step's work outside the transformer layers, as a profile's fixed work prices it (None without):
        the slowest pipeline rank's ends per micro-batch, and the optimizer step."""
        e = self.est
        if self.ctx.rates is None or self.ctx.rates.fixed is None or e.step_time is None:
            return None
        return {"per_micro_batch_s": e.ends_time / e.micro_batches, "micro_batches": e.micro_batches,
                "micro_batches_s": e.ends_time, "optimizer_step_s": e.optimizer_time,
                "total_s": e.ends_time + e.optimizer_time, "source": OUTSIDE_LAYERS_SOURCE}

    def _cp_json(self) -> dict[str, Any]:
        e, m, c = self.est, self.ctx.shape, self.cand
        per_rank = model_shape.causal_pairs_per_rank(m.seq_len, c.cp)
        contiguous = model_shape.causal_pairs_per_rank(m.seq_len, c.cp, balanced=False)
        flops_pair = model_shape.attention_flops_per_pair(m) / c.tp
        return {
            "cp": c.cp, "chunks": 2 * c.cp, "chunk_tokens": m.seq_len // (2 * c.cp),
            "tokens_per_rank": m.seq_len // c.cp, "dp_cp": c.dp * c.cp,
            "causal_attention_flops_per_rank_per_layer": max(per_rank) * c.micro_batch * flops_pair,
            "causal_balance": max(per_rank) / (sum(per_rank) / c.cp),
            "contiguous_split_balance": max(contiguous) / (sum(contiguous) / c.cp),
            "exchange": "all_gather", "link": e.comm_link["cp"],
            "bytes_per_layer_per_micro_batch": e.comm_bytes["cp"] / (e.micro_batches * max(_layers_per_rank(e))),
            "bytes_per_step": e.comm_bytes["cp"], "seconds_per_step": e.extra["cp_time"],
            "seconds_per_layer": e.extra["cp_layer_time"],
            "attention_seconds_per_layer": e.extra["attn_layer_time"] if e.step_time is not None else None,
        }

    def _moe_json(self) -> dict[str, Any]:
        e, m, c = self.est, self.ctx.shape, self.cand
        moe = m.moe
        assert moe is not None
        return {
            "num_experts": moe.num_experts, "top_k": moe.top_k, "expert_ffn_hidden": moe.expert_ffn_hidden,
            "shared_experts": moe.shared_experts, "shared_ffn_hidden": moe.shared_ffn_hidden,
            "moe_layers": m.moe_layers, "router": moe.router, "capacity_factor": moe.capacity_factor,
            "ep": c.ep, "expert_dp": c.dp // c.ep, "experts_per_rank": moe.num_experts // c.ep,
            "ep_fits_nvlink": e.comm_link["ep"] == "nvlink",
            "load_imbalance_allowance": e.extra["expert_pace"],
            "params_total": self.params.total, "params_active": self.params.active,
            "expert_params_per_gpu": e.worst.expert_params,
            "all_to_all_bytes_per_step": e.comm_bytes["ep"], "all_to_all_s": e.extra["ep_time"],
            "all_to_all_link": e.comm_link["ep"],
        }

    # --- JSON -------------------------------------------------------------------------------------------
    def to_json(self, ranks: bool = False) -> dict[str, Any]:
        e, c, hw, m = self.est, self.cand, self.ctx.hw, self.ctx.shape
        w = e.worst
        out: dict[str, Any] = {
            "name": self.name,
            "world_size": self.world,
            "layout": {
                "tp": c.tp, "pp": c.pp, "dp": c.dp, "virtual_stages": c.virtual_stages, "zero": c.zero,
                "sequence_parallel": c.sequence_parallel, "micro_batch": c.micro_batch,
                "micro_batches": e.micro_batches, "schedule": c.schedule, "recompute": c.recompute,
                "precision": self.ctx.precision, "global_batch": self.ctx.global_batch,
                "stage_layers": list(e.stage_layers), "nodes": self.layout.nodes,
                "gpus_per_node": hw.gpus_per_node, "nvlink_domain": hw.nvlink_domain,
                "padded_vocab": m.padded_vocab(c.tp),
                "tp_fits_nvlink": e.comm_link["tp"] == "nvlink",
                "ep": c.ep, "expert_dp": c.dp // c.ep, "cp": c.cp,
                "offload": "optimizer" if c.offload else "none",
            },
            "hardware": {
                "gpu": hw.gpu, "peak_flops": hw.peak_flops, "memory_bytes": hw.memory_bytes,
                "gemm_speedup": self.ctx.gemm_speedup,
                "reserve_bytes": hw.reserve_bytes,
                "intra_domain_link": hw.link, "nvlink_bytes_per_s": hw.nvlink_bw,
                "fabric": hw.fabric, "inter_node_bytes_per_s": hw.inter_node_bw,
            },
            "params": {**self.params.as_dict(), "per_rank": self.params_per_rank,
                       "tied_embeddings": m.tied_embeddings},
            "flops": {
                "model_per_token": e.model_flops / (self.ctx.global_batch * m.seq_len),
                "model_per_step": e.model_flops,
                "hardware_per_step": e.hardware_flops,
                "hardware_per_gpu_per_step_max": e.hardware_flops_per_gpu_max,
                "tokens_per_step": self.ctx.global_batch * m.seq_len,
            },
            "memory": {
                "worst_pp_rank": w.pp_rank,
                "params_per_gpu": w.params,
                "weights": w.weights, "gradients": w.gradients, "optimizer": w.optimizer,
                "model_states": w.model_states, "activations": w.activations, "transient": w.transient,
                "total": w.total, "capacity": e.capacity, "headroom": e.headroom,
                "headroom_fraction": e.headroom_fraction, "fits": e.fits,
                "host_per_gpu": e.host_per_gpu, "host_per_node": e.host_per_node,
                "host_capacity_per_node": e.host_capacity, "host_fits": e.host_fits,
                "per_pp_rank": [
                    {"pp_rank": r.pp_rank, "params": r.params, "weights": r.weights, "gradients": r.gradients,
                     "optimizer": r.optimizer, "activations": r.activations, "transient": r.transient,
                     "total": r.total} for r in e.ranks
                ],
            },
            "communication": {
                "per_kind": {k: {"bytes": e.comm_bytes[k], "link": e.comm_link[k], "seconds": e.comm_time[k]}
                             for k in e.comm_bytes},
                "per_link": e.per_link(),
                "note": "bytes sent per GPU per optimizer step, busiest GPU of each kind (ring algorithms)",
            },
            "pipeline": {
                "bubble_fraction": e.bubble_fraction, "bubble_over_ideal": e.bubble_over_ideal,
                "definition": BUBBLE_DEFINITION, "stage_layers": list(e.stage_layers),
                "stage_imbalance": e.stage_imbalance,
                "flops_per_token_per_pp_rank": list(e.rank_flops_per_token),
            },
            "prediction": {
                "step_time_s": e.step_time, "compute_s": e.compute_time, "tp_exposed_s": e.tp_exposed_time,
                "p2p_s": e.p2p_time, "bubble_s": e.bubble_time, "dp_s": e.dp_time,
                "dp_exposed_s": e.dp_exposed_time, "embedding_sync_s": e.embedding_sync_time,
                # of bubble_s: what the later pipeline ranks wait out after their last pass (bubble.drain_share)
                "pipeline_drain_s": e.extra["pipeline_drain_time"],
                "tokens_per_s": e.tokens_per_s, "model_flops_per_s_per_gpu": self.model_flops_per_s_per_gpu,
                "mfu": self.mfu, "hfu": self.hfu, "cp_s": e.extra["cp_time"],
                "dispatch_s": e.extra["dispatch_time"],  # of compute_s: the GPU waiting for the host (DISPATCH_BOUND)
                "offload_copy_s": e.offload_copy_time, "offload_step_s": e.offload_step_time,
                "breakdown_s": self.breakdown(), "dominant": self.dominant(),
                "outside_layers": self.outside_layers(),
            },
            "assumptions": {**priced_with(self.ctx), "roofline": ROOFLINE, "notes": list(NOTES)},
            "calibration": self.calibration(),
            "checkpoint": self.checkpoint,
            "warnings": [x.as_dict() for x in self.warnings],
        }
        if m.moe is not None:
            out["moe"] = self._moe_json()
        if "powersgd_time" in e.extra:
            out["grad_compression"] = {
                "method": "powersgd", "rank": self.ctx.powersgd_rank,
                "compressed_params_per_gpu": e.extra["powersgd_compressed_params"],
                "factor_elements_per_gpu": e.extra["powersgd_factor_elements"],
                "extra_flops_per_step": e.extra["powersgd_flops"], "extra_compute_s": e.extra["powersgd_time"],
                "dp_bytes_per_step": e.comm_bytes["dp"] + e.comm_bytes.get("expert_dp", 0.0)}
        if c.cp > 1:
            out["context_parallel"] = self._cp_json()
        if self.elastic:
            out["elastic"] = {"summary": elastic_summary(list(self.elastic)),
                              "node_counts": [o.as_dict() for o in self.elastic]}
        if ranks:
            out["placement"] = placement_table(self.layout)
            out["groups"] = Groups(self.layout).as_dict()
        return out


def breakdown_of(e: Estimate) -> dict[str, float] | None:
    """Where an estimate's step goes (seconds, summing to the step), or None when times are unknown."""
    if e.step_time is None or e.compute_time is None:
        return None
    parts = {"compute": e.compute_time, "TP exposed": e.tp_exposed_time, "CP K/V exchange": e.extra["cp_time"],
             "MoE all-to-all": e.extra["ep_time"], "PP point-to-point": e.p2p_time,
             "pipeline bubble": e.bubble_time or 0.0, "DP exposed": e.dp_exposed_time or 0.0,
             "tied-embedding sync": e.embedding_sync_time, "PowerSGD compute": e.extra.get("powersgd_time", 0.0),
             "offload copies": e.offload_copy_time, "offload CPU step": e.offload_step_time,
             "optimizer step": e.optimizer_time, "FSDP2 units": e.fsdp_time, "weight passes": e.weight_pass_time}
    return {k: v for k, v in parts.items() if v}


def _layers_per_rank(e: Estimate) -> list[int]:
    """Transformer layers on each pipeline rank."""
    n = e.cand.pp
    return [sum(e.stage_layers[r::n]) for r in range(n)]


def build_plan(spec: RunSpec) -> Plan:
    """Plan a validated spec (load it with trainctl.spec.load_spec: the rules have already passed)."""
    ctx = context_from_spec(spec)
    ev = Evaluator(ctx)
    cand = candidate_from_spec(spec)
    est = ev.evaluate(cand)
    stages = stage_prices(spec)
    band = record_band(spec)
    checkpoint, cadence_warning = checkpoint_plan(spec, est.step_time, stages, band)
    shrink = tuple(shrink_options(spec))
    return Plan(
        name=spec.name, ctx=ctx, cand=cand, est=est, params=model_shape.param_counts(ctx.shape),
        warnings=(tuple(advise(ev, est)) + calibration_warnings(ctx) + cadence_warning + elastic_warnings(shrink)
                  + grace_warnings(spec) + stage_warnings(stages)),
        layout=Layout.from_spec(spec), checkpoint=checkpoint, elastic=shrink, record=band,
    )


def record_band(spec: RunSpec) -> dict[str, Any] | None:
    """How far the published runs on the spec's GPU part were from this model's uncalibrated step
    (plan/record.py); None where a profile or flat rates price the step, or no published run used the part."""
    if spec.cluster.calibration or spec.estimate.compute_efficiency is not None:
        return None
    return record.band(spec.cluster.gpu)


def record_range(band: dict[str, Any], run_at: Callable[[float], dict[str, Any]]) -> dict[str, Any]:
    """A whole run at the two ends of the record's `band` (record_band): `run_at(ratio)` is the whole-run block
    with the step times `ratio`; its expected days, GPU-hours and cost at each end."""
    ends = [run_at(band[k]) for k in ("step_ratio_min", "step_ratio_max")]
    return {"step_ratio": [band["step_ratio_min"], band["step_ratio_max"]], "gpu": band["gpu"], "runs": band["runs"],
            **{key: [end[key] if key != "wall_days" else end[key]["mean"] for end in ends]
               for key in ("wall_days", "gpu_hours", "cost")}}


def grace_warnings(spec: RunSpec) -> tuple[PlanWarning, ...]:
    """Slurm's stop warning (launcher.grace_s) taking a large share of every attempt's cluster.time."""
    line = time_limit.grace_warning(spec.cluster.time, spec.launcher.grace_s)
    return (PlanWarning("GRACE_OF_TIME_LIMIT", "warning", line),) if line else ()


def elastic_warnings(options: tuple[NodeCount, ...]) -> tuple[PlanWarning, ...]:
    """Node counts of the elastic range the layout cannot run on (the trainer would stop there): one warning,
    with the reason of the largest, the first a shrinking run meets."""
    bad = [o for o in options if o.why_not is not None]
    if not bad:
        return ()
    return (PlanWarning("ELASTIC_CANNOT_SHRINK", "warning",
                        f"the run stops if it shrinks to {node_list(bad)} node(s); on {bad[-1].nodes}: "
                        f"{bad[-1].why_not}"),)


def stage_prices(spec: RunSpec) -> list[dict[str, Any]] | None:
    """train.stages, each priced at its own shape (batch, sequence length, cp): its steps, predicted step time,
    compute and memory; None for an unstaged spec (docs/design/whole-run.md, "Staged training")."""
    if not spec.train.stages:
        return None
    out = []
    for st in spec.train.stages:
        shaped = spec.stage_spec(st)
        ctx = context_from_spec(shaped)
        est = Evaluator(ctx).evaluate(candidate_from_spec(shaped))
        steps = shaped.train.steps
        assert steps is not None  # stage_spec sets them
        out.append({"name": st.name, "tokens": steps * shaped.batch_tokens, "steps": steps,
                    "global_batch": shaped.train.global_batch, "seq_len": shaped.model.seq_len,
                    "cp": shaped.parallel.cp, "dp": shaped.dp, "micro_batch": shaped.parallel.micro_batch,
                    "nodes": shaped.cluster.nodes,
                    "gpus": shaped.cluster.world_size, "model_flops_per_step": est.model_flops,
                    "step_time_s": est.step_time,
                    "compute_s": est.step_time * steps if est.step_time else None,
                    "mfu": est.mfu(ctx.world, ctx.hw.peak_flops), "memory_bytes": est.worst.total,
                    "fits": est.fits, "own_shape": shaped.train.recompute == spec.train.recompute and all(
                        getattr(st, k) in (None, base) for k, base in _stage_bases(spec))})
    return out


def _stage_bases(spec: RunSpec) -> tuple[tuple[str, Any], ...]:
    """A stage's shape fields and the spec's own values of them."""
    return (("global_batch", spec.train.global_batch), ("seq_len", spec.model.seq_len), ("cp", spec.parallel.cp),
            ("dp", spec.parallel.dp), ("micro_batch", spec.parallel.micro_batch), ("nodes", spec.cluster.nodes))


def stage_warnings(stages: list[dict[str, Any]] | None) -> tuple[PlanWarning, ...]:
    """A stage whose shape does not fit in memory (the layout is the spec's; the batch and length are its own);
    a stage at the spec's own shape is the OOM error's already."""
    return tuple(PlanWarning("STAGE_OUT_OF_MEMORY", "error", (
        f"train.stages {s['name']!r} needs {s['memory_bytes'] / 1e9:.1f} GB per GPU at seq_len {s['seq_len']:,} and "
        f"global_batch {s['global_batch']:,}: over the GPU's memory; give the stage a layout that fits (cp, dp, "
        "micro_batch) or more recompute")) for s in stages or () if not s["fits"] and not s["own_shape"])


def checkpoint_plan(spec: RunSpec, step_time: float | None, stages: list[dict[str, Any]] | None = None,
                    band: dict[str, Any] | None = None) -> tuple[dict[str, Any], tuple[PlanWarning, ...]]:
    """One save's bytes and seconds, and the Young/Daly interval against the configured one (plan/cadence.py);
    with the record's `band` (record_band), the whole run again at its two ends."""
    blocking, total = save_seconds(spec)
    ck = spec.checkpoint
    gpus = staged_gpus(stages, spec)
    mtbf, source = spec_mtbf(spec, gpus=gpus)
    step_time = staged_mean_step(stages, spec) if stages is not None else step_time
    cadence = Cadence(cost_s=blocking, mtbf_s=mtbf, mtbf_source=source, restart_s=sum(restart_parts(spec).values()),
                      configured_s=configured_interval(ck.every_steps, ck.every_minutes, step_time),
                      step_time_s=step_time, run_s=step_time * spec.train.steps if step_time else None)
    e = spec.estimate
    out = {"bytes": checkpoint_bytes(spec), "async": ck.async_save, "blocking_s": blocking, "save_s": total,
           "write_gbps_per_node": e.checkpoint_write_gbps, "stage_gbps_per_gpu": e.checkpoint_stage_gbps,
           "every_steps": ck.every_steps, "every_minutes": ck.every_minutes, "cadence": cadence.as_dict(),
           "whole_run": whole_run_plan(spec, step_time=step_time, blocking_s=blocking, save_s=total, mtbf_s=mtbf,
                                       mtbf_source=source, stages=stages)}
    if out["whole_run"] is not None and band is not None:
        out["whole_run"]["record_range"] = record_range(band, lambda ratio: whole_run_plan(
            spec, step_time=step_time * ratio, blocking_s=blocking, save_s=total, mtbf_s=mtbf, stages=stages))
    warnings = [PlanWarning("CHECKPOINT_INTERVAL", "warning", line)] if (line := cadence.warning()) else []
    if ck.async_save and cadence.configured_s is not None and cadence.configured_s < total:
        warnings.append(PlanWarning("CHECKPOINT_BACKLOG", "warning", (
            f"a save takes ~{dur(total)} to write but checkpoints are due every {dur(cadence.configured_s)}: "
            "each save waits for the previous one and blocks training; save less often or raise "
            "estimate.checkpoint_write_gbps if the filesystem is faster")))
    if ck.dir is not None and (shared := storage.storage_problem(spec, Path.cwd())):  # else known only at launch
        warnings.append(PlanWarning(storage.WARNING_CODE, "warning", shared))
    return out, tuple(warnings)


def spec_mtbf(spec: RunSpec, *, gpus: float | None = None) -> tuple[float, str]:
    """The job's MTBF in seconds and where it comes from (plan/cadence.py job_mtbf), on `gpus` (default the
    cluster's; a staged run's: staged_gpus)."""
    c, ck = spec.cluster, spec.checkpoint
    mtbf, source = job_mtbf(gpus=gpus or c.world_size, gpu=c.gpu, mtbf_hours=ck.mtbf_hours, fleet=ck.failure_fleet)
    if gpus and gpus != c.world_size and ck.mtbf_hours is None:
        source += " (GPUs: the stages' own, weighted by their compute)"
    return mtbf, source


def restart_parts(spec: RunSpec) -> dict[str, float]:
    """A restart's seconds by part: the scheduler's requeue, the start-up, the checkpoint load of one node."""
    e = spec.estimate
    load = checkpoint_bytes(spec) / spec.cluster.nodes / (e.checkpoint_read_gbps * 1e9)
    return {"requeue": e.requeue_s, "startup": e.startup_s, "checkpoint_load": load}


def run_time_limit(spec: RunSpec, *, save_s: float, interval_s: float) -> TimeLimit | None:
    """Slurm's cluster.time as the whole run meets it (plan/whole_run.py); None for a local run or no limit. A
    stop saves (its whole write) before the job requeues itself, unless the grace is too short for the write:
    then the work since the last save is lost, half an interval on average."""
    limit = time_limit.limit_s(spec.cluster.time)
    if spec.backend != "slurm" or limit is None or limit >= time_limit.UNLIMITED_S:
        return None
    parts = restart_parts(spec)
    grace = spec.launcher.grace_s
    lost = interval_s / 2.0 if grace < save_s else 0.0
    return TimeLimit(limit_s=float(limit), train_s=limit - grace - parts["startup"] - parts["checkpoint_load"],
                     stop_s=save_s + sum(parts.values()) + lost)


def staged_gpus(stages: list[dict[str, Any]] | None, spec: RunSpec) -> float:
    """The GPUs a run holds: the cluster's, or for a staged run whose stages run on their own nodes
    (train.stages[].nodes) the stages' GPUs weighted by their compute. A failure rate per GPU-hour and the
    GPU-hours then both count each stage on its own GPUs (the nodes a stage leaves are not the run's)."""
    if not stages or any(s["compute_s"] is None for s in stages) or all(
            s["gpus"] == spec.cluster.world_size for s in stages):
        return float(spec.cluster.world_size)
    total = sum(s["compute_s"] for s in stages)
    return sum(s["compute_s"] * s["gpus"] for s in stages) / total if total > 0 else float(spec.cluster.world_size)


def staged_mean_step(stages: list[dict[str, Any]], spec: RunSpec) -> float | None:
    """A staged run's compute per optimizer step, averaged over its stages (None if a stage has no step time)."""
    if any(s["compute_s"] is None for s in stages):
        return None
    return sum(s["compute_s"] for s in stages) / spec.train.steps


def whole_run_plan(spec: RunSpec, *, step_time: float | None, blocking_s: float, save_s: float,
                   mtbf_s: float, mtbf_source: str = "",
                   stages: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The whole run's expected wall clock, interruptions, time-limit stops and GPU-hours (plan/whole_run.py);
    None without a step time. Without scheduled saves the run is one interval: a failure redoes it from the
    start. A staged run's `step_time` is its mean over the stages (staged_mean_step): the compute is the
    stages' sum, and checkpoint.every_steps is that many mean steps apart."""
    if not step_time:
        return None
    ck = spec.checkpoint
    compute = step_time * spec.train.steps
    configured = configured_interval(ck.every_steps, ck.every_minutes, step_time)
    interval = min(configured or compute, compute)
    parts = restart_parts(spec)
    run = WholeRun(compute_s=compute, interval_s=interval, save_block_s=blocking_s,
                   last_write_s=save_s - blocking_s if ck.async_save else 0.0, restart_s=sum(parts.values()),
                   mtbf_s=mtbf_s, time_limit=run_time_limit(spec, save_s=save_s, interval_s=interval),
                   maintenance_share=spec.cluster.maintenance_hours_per_week / 168.0)
    summary = whole_run_summary(run=run, gpus=staged_gpus(stages, spec), gpu_hour_price=spec.cluster.gpu_hour_price,
                                board_power_w=resolve_accelerator(spec.cluster).board_power_w, restart_parts=parts,
                                saves_scheduled=configured is not None, mtbf_source=mtbf_source)
    if stages is not None:
        return {"steps": spec.train.steps, "tokens": sum(s["tokens"] for s in stages), "given": "train.stages",
                "stages": stages, **summary}
    given = "train.tokens" if spec.train.tokens is not None else "train.steps"
    return {"steps": spec.train.steps, "tokens": spec.train.steps * spec.batch_tokens, "given": given,
            "stages": None, **summary}


def calibration_warnings(ctx: Context) -> tuple[PlanWarning, ...]:
    """A profile that is usable but differs from the run (versions, date, precision, model) says so."""
    return tuple(PlanWarning("CALIBRATION_DIFFERS", "warning", w) for w in (ctx.rates.warnings if ctx.rates else ()))

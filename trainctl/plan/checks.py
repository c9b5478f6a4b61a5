"""Warnings a senior engineer would give about a layout: short strings with a code and a level.

Levels: "info" (worth knowing), "warning" (probably costs throughput), "severe" (costs a lot), "error"
(the job cannot run as planned: it does not fit in memory, or the estimate is broken).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainctl.hardware.topology import aligned_domain_size
from trainctl.plan import memory
from trainctl.plan.comm import INTER_NODE
from trainctl.plan.comm_levers import Levers
from trainctl.plan.estimate import Candidate, Estimate, Evaluator, RankMemory
from trainctl.units import dur

LEVELS = ("info", "warning", "severe", "error")
GB = 1e9


@dataclass(frozen=True)
class PlanWarning:
    code: str
    level: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"code": self.code, "level": self.level, "message": self.message}


# NVLINK_DOMAIN_SPLIT: a domain-aligned allocation is proposed when it shortens the step by more than this
DOMAIN_SPLIT_SAVING = 0.02


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def _dense_layer_bytes(ev: Evaluator, c: Candidate) -> float | None:
    """Activation bytes a dense layer keeps per micro-batch in flight (plan/memory.py); None for a mixture of
    experts, whose layers differ."""
    ctx = ev.ctx
    if ctx.shape.moe is not None:
        return None
    return memory.trainer_layer_activation_bytes(ctx.shape, c.micro_batch, c.tp, c.sequence_parallel, c.recompute,
                                                 ctx.precision, c.cp, ctx.on_gpu)


def _memory_parts(rank: RankMemory, per_layer: float | None) -> str:
    """Where one GPU's bytes go, itemised as the trainer holds them."""
    layers = (f" ({per_layer / 1e6:,.0f} MB per layer per micro-batch in flight, {rank.activations / per_layer:,.0f} "
              "layer-micro-batches' worth)" if per_layer else "")
    return (f"weights {_gb(rank.weights)}, gradients {_gb(rank.gradients)}, optimizer {_gb(rank.optimizer)}, "
            f"activations {_gb(rank.activations)}{layers}, transient {_gb(rank.transient)}")


def advise(ev: Evaluator, est: Estimate) -> list[PlanWarning]:  # noqa: C901 - a flat list of independent checks
    c, ctx, out = est.cand, ev.ctx, []
    add = lambda code, level, msg: out.append(PlanWarning(code, level, msg))  # noqa: E731
    pp, m, step = c.pp, est.micro_batches, est.step_time

    # memory
    gpu_fits = est.capacity is None or est.worst.total <= est.capacity
    if not gpu_fits:
        add("OOM", "error",
            f"does not fit: pipeline rank {est.worst.pp_rank} needs {_gb(est.worst.total)} > {_gb(est.capacity or 0)} "
            f"per GPU ({_gb(ctx.hw.memory_bytes or 0)} less a {_gb(ctx.hw.reserve_bytes)} reserve): "
            f"{_memory_parts(est.worst, _dense_layer_bytes(ev, c))}; raise parallel.zero, use train.recompute "
            "selective/full, a smaller micro_batch, more tp/pp, or parallel.offload: optimizer")
    if not est.host_fits:
        add("HOST_OOM", "error",
            f"optimizer offload does not fit host memory: {_gb(est.host_per_node)} per node "
            f"({_gb(est.host_per_gpu)} per GPU) > {_gb(est.host_capacity or 0)}; set cluster.host_memory_gb if the "
            "nodes have more, raise dp, or turn parallel.offload off")
    elif c.offload and not est.host_per_gpu:
        add("OFFLOAD_NO_EFFECT", "info", "parallel.offload has no effect with one data-parallel replica (dp*cp = 1): "
            "the optimizer is not sharded and steps the weights on the GPU")
    if gpu_fits and est.headroom_fraction is not None and est.headroom_fraction < 0.10:
        add("LOW_HEADROOM", "warning",
            f"only {est.headroom_fraction:.0%} memory headroom ({_gb(est.headroom or 0)}); the CUDA context, NCCL "
            "buffers and fragmentation typically take a few GB")

    dispatch = est.extra.get("dispatch_time", 0.0)
    if step and est.compute_time and dispatch > 0.05 * step:
        add("DISPATCH_BOUND", "warning",
            f"the GPU waits for the host to issue the layers' kernels at micro_batch {c.micro_batch}: +{dur(dispatch)} "
            f"per step ({dispatch / step:.0%} of it; the profile's dispatch floor); a larger parallel.micro_batch or "
            "train.compile: true gives each kernel more work")

    dev = ctx.device
    if ctx.fp8 and dev is not None and dev.elementwise == "eager" and step and ctx.rates is None:
        compiled = Evaluator(replace(ctx, device=replace(dev, elementwise="fused"))).evaluate(c).step_time
        bf16 = Evaluator(replace(ctx, fp8=False, gemm_speedup=1.0)).evaluate(c).step_time
        add("FP8_EAGER", "warning",
            f"train.precision fp8 without train.compile: eager ops quantize the FP8 GEMMs' operands (33 bytes a "
            f"value, each layer input, output gradient and weight twice per micro-batch): predicted step "
            f"{dur(step)}, against {dur(bf16)} in bf16; train.compile: true fuses the quantization (and the other "
            f"elementwise work): {dur(compiled)}")

    # tensor parallelism
    if c.tp > 1 and est.comm_link["tp"] == INTER_NODE:
        add("TP_ACROSS_NVLINK", "severe",
            f"TP groups of {c.tp} leave the NVLink domain of {ctx.hw.nvlink_domain} GPUs: every layer's "
            "all-reduces cross the inter-node fabric; keep tp within the domain and add pp instead")
    if c.sequence_parallel and c.tp == 1:
        add("SP_NO_EFFECT", "info", "sequence_parallel has no effect with tp=1")
    if c.tp > 1 and not c.sequence_parallel:
        sends = 0.0 if ctx.assume.pp_scatter_gather else est.comm_bytes.get("pp", 0.0)  # already split if set
        split = f" and each pipeline send ({_gb(sends)} per GPU per step)" if sends else ""
        add("SP_OFF", "info",
            f"sequence_parallel would divide the norm/dropout activations{split} by tp={c.tp} at the same TP "
            "communication volume")

    # context parallelism
    if c.cp > 1 and est.comm_link.get("cp") == INTER_NODE:
        add("CP_ACROSS_NVLINK", "warning",
            f"CP groups of {c.cp} (x tp {c.tp} = {c.cp * c.tp} GPUs) leave the NVLink domain of "
            f"{ctx.hw.nvlink_domain} GPUs: every layer's K/V all-gather ({_gb(est.comm_bytes.get('cp', 0.0))} per "
            "GPU per step) crosses the inter-node fabric; keep tp*cp within the domain if memory allows")
    exchange, attention = est.extra.get("cp_layer_time", 0.0), est.extra.get("attn_layer_time", 0.0)
    if c.cp > 1 and attention and exchange > attention:
        s = ctx.shape.seq_len
        add("CP_CHUNK_SHORT", "warning",
            f"a layer's K/V exchange ({exchange * 1e3:.3g} ms) outlasts this rank's attention on its {s // c.cp:,} "
            f"tokens ({attention * 1e3:.3g} ms): chunks of {s // (2 * c.cp):,} tokens are too short to hide the "
            "exchange behind attention; lower parallel.cp (or use it only for longer sequences)")

    # expert parallelism
    if c.ep > 1 and est.comm_link.get("ep") == INTER_NODE:
        add("EP_ACROSS_NVLINK", "warning",
            f"EP groups of {c.ep} (x tp {c.tp} = {c.ep * c.tp} GPUs) leave the NVLink domain of "
            f"{ctx.hw.nvlink_domain} GPUs: every MoE layer's all-to-all ({_gb(est.comm_bytes.get('ep', 0.0))} per GPU "
            "per step) crosses the inter-node fabric; keep tp*ep within the domain if the experts fit")
    moe = ctx.shape.moe
    if moe is not None and c.ep == 1 and c.dp > 1 and moe.num_experts > 1:
        add("EP_OFF", "info",
            f"every GPU holds all {moe.num_experts} experts; parallel.ep splits them over the data-parallel group")

    # pipeline
    if pp > 1:
        if est.bubble_fraction > 0.20:
            add("BUBBLE", "severe", f"pipeline bubble is {est.bubble_fraction:.1%} of the pipelined time "
                "(raise global_batch, lower micro_batch, or use the interleaved schedule)")
        elif est.bubble_fraction > 0.10:
            add("BUBBLE", "warning", f"pipeline bubble is {est.bubble_fraction:.1%} of the pipelined time")
        if m < 4 * pp:
            add("FEW_MICROBATCHES", "warning",
                f"{m} micro-batches per replica for pp={pp}; below 4*pp the bubble and the warm-up dominate")
        if est.stage_imbalance > 0.10:
            add("UNBALANCED_STAGES", "warning",
                f"the busiest pipeline rank does {est.stage_imbalance:.0%} more FLOPs than the mean (embedding "
                f"and LM head included; layers per stage {list(est.stage_layers)}); the pipeline runs at its pace")
        if c.schedule == "gpipe":
            add("GPIPE_MEMORY", "info",
                f"gpipe keeps all {m} micro-batches' activations; 1f1b has the same bubble with at most pp in flight")
        if c.schedule == "interleaved" and m == pp:
            add("INTERLEAVED_ALL_WARMUP", "info",
                "with micro-batches = pp the interleaved schedule runs every forward before the first backward "
                "(Megatron's all-warm-up case): every rank holds all m micro-batches of all its chunks")

    # data parallelism / ZeRO
    levers = Levers(ev)
    if step and levers.exposed(est):
        assert est.dp_exposed_time is not None
        found = levers.for_layout(est)
        add("DP_EXPOSED", "warning",
            f"data-parallel communication not hidden by compute is {est.dp_exposed_time / step:.0%} of the step"
            + (f"; predicted with {'; '.join(x.text(step) for x in found)}" if found else ""))
    aligned = aligned_domain_size(ctx.world, ctx.hw.nvlink_domain, ctx.hw.gpus_per_node)
    if step and aligned:
        split = Evaluator(replace(ctx, hw=replace(ctx.hw, nvlink_domain=aligned))).evaluate(c).step_time
        if split and split < (1 - DOMAIN_SPLIT_SAVING) * step:
            add("NVLINK_DOMAIN_SPLIT", "warning",
                f"{ctx.world} GPUs fill NVLink domains of {ctx.hw.nvlink_domain} in rank order, the last one in part: "
                "the groups that straddle a boundary cross the inter-node fabric and the step waits for them; as "
                f"{ctx.world // aligned} domains of {aligned} (an allocation of whole groups of "
                f"{aligned // ctx.hw.gpus_per_node} nodes, as Slurm's --segment gives; cluster.nvlink_domain: "
                f"{aligned}) the predicted step is {dur(split)} (-{1 - split / step:.0%})")
    if c.zero >= 3 and pp > 1:
        add("ZERO3_WITH_PP", "warning",
            f"ZeRO-3 with pp={pp} gathers the weights for each of the {m} micro-batches: "
            f"{_gb(est.comm_bytes['dp'])} of DP traffic per GPU per step; prefer ZeRO-1 with pipelining")
    elif c.zero == 2 and m > 1 and c.dp > 1:
        add("ZERO2_ACCUMULATION", "info",
            f"ZeRO-2 keeps only a gradient shard, so it reduce-scatters every one of the {m} micro-batches; "
            "ZeRO-1 communicates once per step")
    if c.zero == 0 and c.dp > 1:
        zero1 = ev.evaluate(replace(c, zero=1))
        saved = est.worst.model_states - zero1.worst.model_states
        add("ZERO0", "info",
            f"ZeRO-1 would save {_gb(saved)} of model states per GPU (optimizer state sharded over dp"
            f"{', bf16 weights' if ctx.precision == 'bf16' else ''}), reduce-scattering the gradients and "
            f"all-gathering the weights in place of the all-reduce: {_gb(zero1.comm_bytes['dp'])} of DP traffic "
            f"per GPU per step instead of {_gb(est.comm_bytes['dp'])}"
            + (f"; predicted step {dur(zero1.step_time)} instead of {dur(step)} (with bf16 weights each "
               "micro-batch skips autocast's casts)" if step and zero1.step_time and ctx.precision == "bf16"
               and zero1.weight_pass_time < est.weight_pass_time else ""))

    # recompute
    if c.recompute != "none" and est.fits:
        lighter = ["none"] if c.recompute == "selective" else ["none", "selective"]
        for option in lighter:
            alt = ev.evaluate(replace(c, recompute=option))
            if alt.headroom_fraction is not None and alt.headroom_fraction >= 0.10:
                add("RECOMPUTE_UNNEEDED", "info",
                    f"recompute={option} also fits ({_gb(alt.memory_total)} per GPU) and recomputes less")
                break

    # the estimate itself
    if ctx.hw.peak_flops is None:
        add("PEAK_UNKNOWN", "info",
            f"{ctx.hw.gpu}: the peak FLOP/s is measured at run time, so step time and MFU are unknown here "
            "(set cluster.peak_tflops to estimate them)")
    mfu = est.mfu(ctx.world, ctx.hw.peak_flops)
    if mfu is not None and mfu > 1:
        add("MFU_OVER_100", "error", f"predicted MFU {mfu:.0%} > 100%: this is a bug in the planner")
    return out

"""Per-GPU memory: the bytes the bundled trainer allocates (model states, activations, reserve), and the
published formulas they are derived from (kept as tests of the per-term arithmetic).

The planner uses the `trainer_*` functions; docs/design/memory.md ("Memory model") has the byte table. The
paper formulas below them (`model_state_bytes`, `layer_activation_bytes`) describe the idealised run:

Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1 and Figure 1): mixed-precision Adam keeps
2 bytes of 16-bit weights, 2 of 16-bit gradients and K = 12 of optimizer state (fp32 master weights,
momentum, variance) per parameter = 16 bytes. ZeRO stage 1 (P_os) shards the 12 over the Nd data-
parallel ranks, stage 2 (P_os+g) also the gradients, stage 3 (P_os+g+p) also the weights. Pure fp32
training keeps 4 + 4 and an optimizer state of 8 (momentum, variance; the weights are the master).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Sec. 4 and Table 2), bytes per layer for s = sequence, b = micro-batch, h = hidden, a = heads,
t = TP size, with 16-bit activations and 1-byte dropout masks:
    no parallelism          s*b*h*(34 + 5*a*s/h)
    TP                      s*b*h*(10 + 24/t + 5*a*s/(h*t))
    TP + SP                 s*b*h/t*(34 + 5*a*s/h)
    TP + selective          s*b*h*(10 + 24/t)
    TP + SP + selective     34*s*b*h/t
    full recompute          2*s*b*h per layer (its input), /t with SP
We keep the paper's term-by-term accounting and generalise it to GQA (K and V are kv_heads/heads of h
wide), other MLP sizes and SwiGLU (gate and up outputs, 2*f wide, plus the down projection's input), and
to models without dropout (no masks, no dropout output); for the paper's GPT shape (GELU, 4h MLP,
dropout) it is exactly Table 2. "selective" drops the s^2 attention-core term (softmax, its dropout,
A*V's input), which is also what FlashAttention-style kernels store; recompute "none" assumes the
attention core's s x s tensors are materialised, as in the paper.
"""

from __future__ import annotations

import os

from trainctl.model_shape import ModelShape

# (weights, gradients, optimizer state) bytes per parameter in the ZeRO paper.
STATE_BYTES = {"bf16": (2, 2, 12), "fp16": (2, 2, 12), "fp32": (4, 4, 8)}

GIB = 2**30
# Device memory the trainer cannot use for tensors: the CUDA context and kernels (~0.5-1 GiB on H100),
# NCCL's communicator buffers (~0.3-1 GiB for a few communicators) and allocator fragmentation.
GPU_RESERVE_BYTES = 3 * GIB


# The trainer's data-parallel gradient buckets (runtime/parallel/data_parallel.py): 16 MB of fp32 gradients per
# collective (DDP's default is 25 MB). TRAINCTL_BUCKET_NUMEL overrides it, for the trainer and the plan alike (tests use
# small buckets so that a tiny model has several).
DP_BUCKET_NUMEL = 4_000_000
# ZeRO-2 reduces each micro-batch's gradients through this many bucket-sized buffers: one filling while the
# previous one's reduce-scatter runs (DeepSpeed stage 2's double buffer).
ZERO2_SLOTS = 2


def dp_bucket_numel() -> int:
    return int(os.environ.get("TRAINCTL_BUCKET_NUMEL", DP_BUCKET_NUMEL))


def bf16_params(precision: str, zero: int, dp: int) -> bool:
    """Whether the trainer keeps its parameters in bf16: bf16 compute with a sharded optimizer (ZeRO-1/2 and
    dp > 1), whose fp32 master slice is the truth. Otherwise parameters are fp32 (and themselves the master:
    4 + 4 + 8 bytes at ZeRO-0 is less than Megatron's 18 with a separate master); FSDP2 (ZeRO-3) keeps fp32
    shards and gathers them in bf16 for the compute (`fsdp_gather_bytes`)."""
    return precision == "bf16" and zero in (1, 2) and dp > 1


def trainer_state_bytes(zero: int, dp: int, precision: str = "fp32", reduce_bf16: bool = False
                        ) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter as the trainer allocates them.

    `precision` is the one the trainer computes in (`compute_precision`). One DP replica runs plain (ZeRO
    off): fp32 weights, one fp32 gradient buffer, AdamW's two fp32 moments. ZeRO-1: each DP rank keeps the
    fp32 master and moments of its 1/dp slice of every bucket, and the full fp32 gradient buffer that every
    micro-batch accumulates into (Megatron's main_grad); the weights are bf16 under bf16 compute (the
    all-gather after the step moves bf16), else fp32. ZeRO-2: the same, but each micro-batch's gradients are
    reduce-scattered as their buckets complete and accumulated into this rank's fp32 shard, so only the shard
    stays, plus ZERO2_SLOTS transient bucket buffers per rank (`zero2_buffer_bytes`, not per parameter).
    ZeRO-3 (FSDP2) shards fp32 weights, gradients and moments, the optimizer updating the shards in place. A
    bf16 gradient reduction (ZeRO 0-1) adds a 2-byte copy of the buffer it sends; ZeRO-2's is in its buffers."""
    if dp == 1:
        zero = 0
    w = 2.0 if bf16_params(precision, zero, dp) else 4.0
    comm = 2.0 if reduce_bf16 and dp > 1 and zero < 2 else 0.0
    if zero == 0:
        return 4.0, 4.0 + comm, 8.0
    if zero == 1:
        return w, 4.0 + comm, 12.0 / dp
    if zero == 2:
        return w, 4.0 / dp, 12.0 / dp
    return 4.0 / dp, 4.0 / dp, 8.0 / dp


def offloads(zero: int, dp: int, offload: bool) -> bool:
    """Whether optimizer offload moves anything: only a sharded optimizer (ZeRO 1-3 over dp > 1 ranks) keeps
    optimizer state apart from the weights (one replica runs plain, `trainer_state_bytes`)."""
    return offload and zero >= 1 and dp > 1


def offloaded_state_bytes(zero: int, dp: int, precision: str = "fp32", reduce_bf16: bool = False
                          ) -> tuple[tuple[float, float, float], float]:
    """Under optimizer offload: ((weights, gradients, optimizer) bytes per parameter left on the GPU, bytes per
    parameter in host memory). ZeRO-1/2 (runtime/parallel/data_parallel.py): the fp32 master slice and moments (12/dp)
    move to the host, plus the host copy of the fp32 gradient slice AdamW reads (4/dp) and with 16-bit
    parameters the slice rounded on the host before it is sent (2/dp). ZeRO-3: FSDP2's CPUOffloadPolicy keeps
    the fp32 weight, gradient and moment shards on the host (16/dp); the GPU holds what it gathers."""
    w, g, o = trainer_state_bytes(zero, dp, precision, reduce_bf16)
    if not offloads(zero, dp, True):
        return (w, g, o), 0.0
    if zero >= 3:
        return (0.0, 0.0, 0.0), w + g + o
    staged = 2.0 / dp if bf16_params(precision, zero, dp) else 0.0
    return (w, g, 0.0), o + 4.0 / dp + staged


def zero2_slot_numel(params: int, largest_param: int, dp: int, bucket_numel: int) -> int:
    """Elements of one ZeRO-2 bucket buffer on a rank holding `params` parameters, the largest `largest_param`:
    the largest bucket there can be (buckets close before `bucket_numel` unless one parameter alone is larger,
    and never hold more than the rank's parameters), padded to a multiple of dp like every bucket."""
    n = min(max(bucket_numel, largest_param), params)
    return -(-n // dp) * dp


def zero2_buffer_bytes(slot_numel: int, dp: int, reduce_bf16: bool = False) -> int:
    """Bytes of ZeRO-2's transient buffers on one rank: ZERO2_SLOTS slots, each an fp32 bucket the micro-batch's
    gradients are added into and the 1/dp slice its reduce-scatter returns (fp32), or with a bf16 reduction
    a bf16 copy of the bucket for the wire and a bf16 slice."""
    recv = slot_numel // dp
    per_slot = 4 * slot_numel + (2 * slot_numel + 2 * recv if reduce_bf16 else 4 * recv)
    return ZERO2_SLOTS * per_slot


def copied_grad_bytes(zero: int, dp: int, precision: str) -> float:
    """Bytes per element of the gradient autograd hands over for one parameter at a time when the trainer adds
    it into its fp32 buffer and drops it (bf16 parameters; ZeRO-2), else 0 (it accumulates in place)."""
    if dp == 1 or zero not in (1, 2):
        return 0.0
    if bf16_params(precision, zero, dp):
        return 2.0
    return 4.0 if zero == 2 else 0.0


def fsdp_gather_bytes(precision: str) -> int:
    """Bytes per element of the weights FSDP2 gathers for the compute: bf16 under bf16 compute
    (MixedPrecisionPolicy param_dtype), else fp32."""
    return 2 if precision == "bf16" else 4


AUTOCAST_COPY_BYTES = 2  # per matmul weight: autocast's 16-bit copy


def autocast_copies(precision: str, zero: int, dp: int) -> bool:
    """Whether autocast makes 16-bit copies of the matmul weights and saves them for backward (a matmul's input
    gradient needs its weight): under bf16/fp16 compute with fp32 parameters, AUTOCAST_COPY_BYTES per weight.
    One copy however many micro-batches are in flight (autocast caches a leaf's cast for the whole region: a
    pipeline schedule runs inside one; pp=1 runs one micro-batch's forward and backward at a time). None where
    the weights are 16-bit already: bf16 parameters under ZeRO-1/2 (`bf16_params`) and FSDP2's bf16 gathers
    under ZeRO-3 (`fsdp_gather_bytes`)."""
    fsdp_16bit = zero >= 3 and dp > 1 and fsdp_gather_bytes(precision) == 2
    return precision in ("bf16", "fp16") and not (bf16_params(precision, zero, dp) or fsdp_16bit)


def compute_precision(precision: str, on_cpu: bool, low_precision_on_cpu: bool) -> str:
    """The precision the trainer really computes in outside FP8 GEMMs: on a CPU bf16/fp16 fall back to fp32
    unless asked. fp8 computes everything but its linear layers' GEMMs in bf16 (docs/design/trainer.md,
    "FP8 training"), so it is bf16 here, with bf16's fallback."""
    base = "bf16" if precision == "fp8" else precision
    return "fp32" if on_cpu and not low_precision_on_cpu else base


def trainer_layer_activation_bytes(m: ModelShape, micro_batch: int, tp: int, sp: bool, recompute: str,
                                   precision: str, cp: int = 1, on_gpu: bool = False) -> float:
    """Bytes one transformer layer keeps for backward per micro-batch, as the trainer's autograd saves them.

    Differences from Korthikanti et al. 2022 (`layer_activation_bytes`), each measured with saved-tensor
    hooks: the attention is torch's scaled_dot_product_attention, which keeps its output and a
    log-sum-exp per row (a*s*b fp32), never the s x s scores, except on a CPU with dropout, where torch falls back
    to the math kernel, which stores them as the paper counts (on CUDA the flash and memory-efficient kernels take
    dropout themselves, regenerating its mask from the RNG state in backward: no scores); the output projection
    gets its own copy of the
    attention output (the head transpose); each norm keeps per-token statistics besides its input
    (`_norm_saved_bytes`); the SwiGLU keeps only its [gate; up] input (runtime/model/lean_ops.py recomputes
    silu(gate) in backward, as Megatron's fused kernel does). The residual stream is in the compute dtype, so
    every value is 2 bytes under bf16/fp16 autocast, 4 in fp32 (the stream's 4 with model.fp32_residual).
    On a GPU (an H200 and an H100, torch 2.11: bench/saved_tensors.py) the flash attention kernel and the
    fused RMSNorm save the same tensors as the CPU's. The 16-bit
    weight copies autocast saves are `autocast_copies`, per stage, not per layer-micro-batch.

    Context parallelism (runtime/parallel/context_parallel.py): every per-token tensor holds this rank's s/cp tokens.
    Without recompute the attention keeps, instead of the fused QKV output and RoPE's rotated Q and K: the
    gathered K and V of the whole sequence (2*s*b*kv_width values, split over TP), the two chunk calls'
    queries (sbh/cp: the CPU path reverses them, a copy; on a GPU the rotated Q or the QKV output of the
    same size) and, besides the calls' outputs, their joined output (sbh/cp, the projection's input).
    Selective recompute re-runs the exchange in backward and keeps none of it, so recompute keeps exactly
    1/cp of the one-rank bytes. Not counted: RoPE's angle rows of the rank's positions (2*s/cp*head_dim fp32
    per micro-batch, shared by the layers of a stage) and the CPU's causal mask vectors (about 2*s values per
    rank, shared by every layer)."""
    act, stream = activation_bytes(precision), residual_bytes(m, precision)
    s, b, h = m.seq_len // cp, micro_batch, m.hidden  # this rank's tokens of each sequence
    sb = s * b
    sbh = sb * h
    if recompute == "full":
        return stream * sbh / (tp if sp else 1)  # the block's input
    # replicated over TP unless SP: both norms (input, statistics) and the residual dropout masks
    replicated = 2 * _norm_saved_bytes(m, sb, on_gpu, stream) + (2 * sbh if m.dropout else 0)
    # the QKV and MLP inputs in the compute dtype: replicated over TP, or under SP the sequence shard, which
    # the column-parallel layers keep and all-gather again in backward (as Megatron does)
    inputs = 2 * sbh * act
    # GELU: fc1's output and fc2's input; SwiGLU: fc1's [gate; up] output and fc2's input
    mlp = (3 if m.swiglu else 2) * sb * m.ffn_hidden
    qkv = sbh + 2 * sb * m.kv_width
    # the fused QKV output, the attention output (the projection's input is a view of it), the MLP
    split = (qkv + sbh + mlp) * act
    if recompute != "selective":  # what the attention core keeps (selective recomputes it)
        split += m.heads * sb * 4  # the log-sum-exp, fp32
        if cp > 1:  # the chunk calls' queries, the gathered K and V and the joined output; no QKV output
            split += (sbh + 2 * m.seq_len * b * m.kv_width + sbh - qkv) * act
        elif m.position == "rope":
            split += (sbh + sb * m.kv_width) * act  # the rotated Q and K
        if m.dropout and not on_gpu:  # the CPU's math kernel keeps the scores, their mask and dropped copy
            scores = m.heads * s * s * b
            split += scores * act + scores * (1 + act)
    if sp:
        return (inputs + replicated + split) / tp
    return inputs + replicated + split / tp


def moe_layer_activation_delta(m: ModelShape, micro_batch: int, tp: int, sp: bool, recompute: str, precision: str,
                               expert_factor: float = 1.0, ep: int = 1) -> float:
    """Bytes an MoE layer keeps beyond a dense layer of the same shape, per micro-batch: its MLP part as the
    trainer's MoE block saves it (runtime/model/moe.py; checked with saved-tensor hooks) less the dense MLP's. 0 under
    full recompute, where a block keeps only its input.

    N = s*b/tp tokens are routed on a rank under SP (else s*b); the experts of a rank see k*s*b rows (under SP
    all TP ranks' rows, gathered), times `expert_factor` (the busiest EP rank receives more than its share).
      router     the fp32 input (N x h; the shared experts' input when it is the same tensor), top-k indices
                 (int64), with topk_softmax the softmax over the top-k logits, the softmax over all experts
                 when the balance loss or softmax_topk needs it, the logits and log-sum-exp with the z-loss
      dispatch   the assignment order and token indices (int64, k*N each); the permutation that groups each
                 expert's rows and its inverse (int64, per expert row) with EP or SP; with biases each received
                 row's expert (int64)
      experts    each row's input and the MLP's inner tensors (GELU 2, SwiGLU 3 x f_e/tp)
      combine    the expert outputs and routing weights the weighted sum keeps (k*N rows)
      shared     as a dense MLP of shared_experts x shared_ffn_hidden
    Exact at ep = 1 (fp32); autocast's 16-bit weight copies are counted per stage (`autocast_copies`)."""
    e = m.moe
    if e is None or recompute == "full":
        return 0.0
    act = activation_bytes(precision)
    inner = 3 if m.swiglu else 2
    h, k, E = m.hidden, e.top_k, e.num_experts
    rows = m.seq_len * micro_batch  # the sequence, gathered
    n = rows / (tp if sp else 1)  # tokens routed here
    # the router's fp32 input is the shared experts' input itself when nothing casts it (under SP the shared
    # experts' column-parallel layer keeps the sequence shard, the router's input, not the gathered sequence)
    shared_is_router_input = e.shared_experts > 0 and act == 4
    mlp_input = n * h * act  # what a dense MLP's (or the shared experts') first layer keeps
    router = 4 * n * h * (0 if shared_is_router_input else 1) + 8 * n * k
    if e.router == "topk_softmax":
        router += 4 * n * k
    if e.aux_loss_coeff or e.router == "softmax_topk":
        router += 4 * n * E + (4 * micro_batch * E if e.aux_loss_coeff else 0)
    if e.z_loss_coeff:
        router += 4 * n * E + 4 * n
    expert_rows = expert_factor * k * rows
    dispatch = 16 * k * n + (16 * expert_rows if ep > 1 or sp else 0) + (8 * expert_factor * k * n if m.bias else 0)
    experts = expert_rows * (h + inner * e.expert_ffn_hidden / tp) * act
    combine = k * n * (h + 1) * act
    shared = 0.0
    if e.shared_experts:
        shared = mlp_input + rows * inner * e.shared_experts * (e.shared_ffn_hidden or 0) / tp * act
    dense = mlp_input + rows * inner * m.ffn_hidden / tp * act  # the dense MLP's input and inner tensors
    return router + dispatch + experts + combine + shared - dense


def _norm_saved_bytes(m: ModelShape, tokens: int, on_gpu: bool, value_bytes: int) -> float:
    """One norm's saved tensors: its input (`value_bytes` a value, the residual stream's) and per-token
    statistics (LayerNorm: mean and rstd; RMSNorm: rstd). In fp32 on a CPU RMSNorm also keeps the normalised
    input its weight gradient needs (`F.rms_norm` is composite there; CUDA's fused kernel recomputes it in
    backward). A 16-bit input is normalised in fp32 inside the kernel: the statistics are fp32, except
    LayerNorm's on a CPU, which keeps them in the input's dtype (runtime/model/transformer.Norm)."""
    h = m.hidden
    if value_bytes == 4:
        if m.norm == "layernorm":
            return tokens * (h + 2) * 4
        return tokens * ((h if on_gpu else 2 * h) + 1) * 4
    if m.norm == "layernorm":
        return tokens * (h * value_bytes + 2 * (4 if on_gpu else value_bytes))
    return tokens * (h * value_bytes + 4)


def trainer_head_activation_bytes(m: ModelShape, micro_batch: int, tp: int, sp: bool, padded_vocab: int,
                                  precision: str, cp: int = 1, on_gpu: bool = False) -> float:
    """Last stage, per micro-batch in flight: the final norm's input and stats and the LM head's input
    (both sequence-sharded under SP: the head all-gathers its input again in backward) and the fp32
    vocab-parallel logits the cross entropy keeps (Korthikanti Sec. 4.3); of this CP rank's s/cp tokens."""
    act = activation_bytes(precision)
    sb = m.seq_len // cp * micro_batch
    norm = _norm_saved_bytes(m, sb, on_gpu, residual_bytes(m, precision))
    sharded = (norm + sb * m.hidden * act) / (tp if sp else 1)
    return sharded + 4 * sb * padded_vocab / tp


def reserve_bytes(on_gpu: bool) -> float:
    return GPU_RESERVE_BYTES if on_gpu else 0.0


# Host memory of a GPU node when the spec does not say: an 8-GPU DGX H100, H200 or B200 node ships 2 TB
# (NVIDIA's DGX datasheets); HGX boards from other vendors are commonly configured with 1-2 TB.
GPU_NODE_HOST_BYTES = 2000e9


def host_memory_bytes(host_memory_gb: float | None, on_cpu: bool) -> float:
    """Host memory per node: the spec's figure, else this machine's RAM when the ranks are CPU processes
    here, else a GPU node's typical 2 TB (GPU_NODE_HOST_BYTES)."""
    if host_memory_gb is not None:
        return host_memory_gb * 1e9
    if on_cpu:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return GPU_NODE_HOST_BYTES


def activation_bytes(precision: str) -> int:
    """Bytes per stored activation value: 16-bit under mixed precision, 4 in pure fp32."""
    return 4 if precision == "fp32" else 2


def residual_bytes(m: ModelShape, precision: str) -> int:
    """Bytes per value of the residual stream (the norms' inputs, a recomputed block's input, a pipeline
    message): the compute dtype's, or 4 with model.fp32_residual."""
    return 4 if m.fp32_residual else activation_bytes(precision)


def model_state_bytes(params: float, zero: int, dp: int, precision: str = "bf16") -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per GPU for `params` parameters on that GPU.

    ZeRO paper, Sec. 5: stage 1 divides the optimizer state by Nd, stage 2 also the gradients, stage 3
    also the weights."""
    w, g, o = STATE_BYTES[precision]
    return (
        params * w / (dp if zero >= 3 else 1),
        params * g / (dp if zero >= 2 else 1),
        params * o / (dp if zero >= 1 else 1),
    )


def layer_activation_bytes(m: ModelShape, micro_batch: int, tp: int, sp: bool, recompute: str,
                           act_bytes: int = 2) -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch (Korthikanti et al. 2022 Table 2).

    Term by term (paper Sec. 4.1, values of act_bytes each unless noted):
      replicated over TP unless SP: the two norms' inputs (2*sbh), the QKV input (sbh), the MLP input
      (sbh), and with dropout the two residual dropout masks (sbh bytes each);
      split over TP: Q (sbh), K and V (sb*kv_width each), the attention output projection's input
      (sbh), the MLP's inner activations (GELU: its input and the down projection's input, 2*sbf;
      SwiGLU: gate and up outputs and the down projection's input, 3*sbf);
      the attention core, split over TP: the softmax output (a*s^2*b), and with dropout its mask
      (a*s^2*b bytes) and output (a*s^2*b).
    """
    s, b, h = m.seq_len, micro_batch, m.hidden
    sbh = s * b * h
    if recompute == "full":
        return act_bytes * sbh / (tp if sp else 1)
    replicated = 4 * sbh * act_bytes + (2 * sbh if m.dropout else 0)
    split_values = 2 * sbh + 2 * s * b * m.kv_width + (3 if m.swiglu else 2) * s * b * m.ffn_hidden
    split = split_values * act_bytes
    if recompute != "selective":
        core = m.heads * s * s * b
        split += core * act_bytes + (core * (1 + act_bytes) if m.dropout else 0)
    if sp:
        return (replicated + split) / tp
    return replicated + split / tp


def embedding_activation_bytes(m: ModelShape, micro_batch: int, tp: int, sp: bool, cp: int = 1) -> float:
    """First stage, per micro-batch in flight: the embedding dropout mask (Korthikanti Sec. 4.3)."""
    return m.seq_len // cp * micro_batch * m.hidden / (tp if sp else 1) if m.dropout else 0.0


def head_activation_bytes(m: ModelShape, micro_batch: int, tp: int, sp: bool, padded_vocab: int,
                          act_bytes: int = 2) -> float:
    """Last stage, per micro-batch in flight: final norm and LM-head inputs (2*sbh values) and the
    fp32 logits of the vocab-parallel cross entropy (4*s*b*V/t bytes): Korthikanti Sec. 4.3's
    4*s*b*h/t*(1 + V/h) with SP."""
    sbh = m.seq_len * micro_batch * m.hidden
    return 2 * sbh * act_bytes / (tp if sp else 1) + 4 * m.seq_len * micro_batch * padded_vocab / tp

"""Per-GPU memory against the ZeRO paper and Korthikanti et al. 2022.

Sources:
- Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  Figure 1 / Sec. 3-5: Psi = 7.5B parameters, Nd = 64 data-parallel ranks, K = 12: baseline 120 GB,
  P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB per device.
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2
  (activation bytes per layer) and Sec. 4.2.3 (first pipeline stage holds p micro-batches; interleaving
  scales that by 1 + (p-1)/(p*m)); model shapes from its Table 3. Each formula is written out again
  here rather than calling the planner's helper.
- Megatron Core developer guide, "Distributed Optimizer" (Megatron-LM docs/source/api-guide/
  distrib_optimizer.md): theoretical bytes per parameter, d = data-parallel size, for "float16 param, fp32
  grads" 18 without and 6 + 12/d with the distributed optimizer; "fp32 param, fp32 grads" 16 and 8 + 8/d.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainctl.model_shape import ModelShape
from trainctl.plan import comm
from trainctl.plan.estimate import Candidate, Evaluator
from trainctl.plan.memory import (
    layer_activation_bytes,
    model_state_bytes,
    trainer_layer_activation_bytes,
    trainer_state_bytes,
    zero2_buffer_bytes,
    zero2_slot_numel,
)
from trainctl.plan.plan import context_from_spec
from trainctl.spec import load_spec_text


@pytest.mark.parametrize("zero,expected_gb,printed", [(0, 120.0, 120.0), (1, 31.40625, 31.4),
                                                      (2, 16.640625, 16.6), (3, 1.875, 1.9)])
def test_zero_paper_figure_1(zero, expected_gb, printed):
    psi, nd = 7.5e9, 64
    w, g, o = model_state_bytes(psi, zero, nd, "bf16")
    # Independently: (2 + 2 + K) * Psi with K = 12, dividing the sharded parts by Nd.
    k = 12
    by_hand = {0: (2 + 2 + k) * psi, 1: 2 * psi + 2 * psi + k * psi / nd, 2: 2 * psi + (2 + k) * psi / nd,
               3: (2 + 2 + k) * psi / nd}[zero]
    assert w + g + o == pytest.approx(by_hand, rel=1e-15)
    assert (w + g + o) / 1e9 == pytest.approx(expected_gb, rel=1e-12)
    assert round((w + g + o) / 1e9, 1) == printed


def test_fp32_training_is_4_4_8():
    assert model_state_bytes(1.0, 0, 8, "fp32") == (4, 4, 8)


@pytest.mark.parametrize("d", [2, 4, 8, 64])
def test_bf16_sharded_optimizer_is_megatrons_distributed_optimizer_or_better(d):
    """bf16 compute: ZeRO-1 keeps bf16 weights, the fp32 gradient buffer (main_grad) and the fp32 master +
    moments of 1/d: Megatron's 6 + 12/d exactly. ZeRO-2 also shards the gradient: 2 + 16/d, never more.
    Below d = 2 there is nothing to shard; ZeRO-0 keeps fp32 weights that are their own master: 16 < 18."""
    assert sum(trainer_state_bytes(1, d, "bf16")) == pytest.approx(6 + 12 / d, rel=1e-15)
    assert sum(trainer_state_bytes(2, d, "bf16")) == pytest.approx(2 + 16 / d, rel=1e-15)
    assert sum(trainer_state_bytes(2, d, "bf16")) <= 6 + 12 / d
    assert sum(trainer_state_bytes(0, d, "bf16")) == 16 < 18
    # fp32 runs keep fp32 weights beside the fp32 master slice (Megatron's fp32 param needs no master:
    # 8 + 8/d); the redundant 4/d is the fp32 ZeRO-1 layout's, kept from before (docs/design/memory.md, "Memory model")
    assert sum(trainer_state_bytes(1, d, "fp32")) == pytest.approx(8 + 8 / d + 4 / d, rel=1e-15)


@pytest.mark.parametrize("zero,paper_gb,extra_bytes_per_param", [
    (0, 120.0, 0.0),  # the baseline: 2 + 2 + 12 (ours: fp32 weights = master, fp32 grads, moments)
    (1, 31.40625, 2.0),  # P_os: ours adds the fp32 (not 16-bit) gradient buffer, 2 bytes more per parameter
    (2, 16.640625, 2.0 / 64),  # P_os+g: ours shards an fp32 (not 16-bit) gradient: 2/Nd more
    (3, 1.875, 0.0),  # P_os+g+p
])
def test_bf16_trainer_against_zero_paper_figure_1(zero, paper_gb, extra_bytes_per_param):
    """The trainer's bf16 model states for the ZeRO paper's Figure 1 model (Psi = 7.5B, Nd = 64): the paper's
    figures plus exactly what accumulating gradients in fp32 costs (ZeRO-2's bucket buffers come on top,
    a fixed size per GPU: test below)."""
    psi, nd = 7.5e9, 64
    ours = sum(trainer_state_bytes(zero, nd, "bf16")) * psi
    assert ours == pytest.approx((paper_gb + extra_bytes_per_param * psi / 1e9) * 1e9, rel=1e-12)


def test_zero2_buffers_are_two_buckets():
    """Two bucket-sized fp32 buffers and the 1/dp slices their reduce-scatter returns: the largest bucket
    is the bucket size unless one parameter is larger, and never more than the rank's parameters."""
    assert zero2_slot_numel(10**9, 10**6, 8, 4_000_000) == 4_000_000
    assert zero2_slot_numel(10**9, 525_336_576, 8, 4_000_000) == 525_336_576  # Llama 3 8B's vocab table
    assert zero2_slot_numel(217_667, 16_384, 4, 4_000_000) == 217_668  # a tiny model: one bucket, padded
    s, dp = 4_000_000, 8
    assert zero2_buffer_bytes(s, dp) == 2 * (4 * s + 4 * s // dp)
    assert zero2_buffer_bytes(s, dp, reduce_bf16=True) == 2 * (4 * s + 2 * s + 2 * s // dp)


@pytest.mark.parametrize("dp", [2, 8])
def test_dp_traffic_follows_the_zero_paper(dp):
    """ZeRO paper Sec. 7.2: all-reduce = reduce-scatter + all-gather = 2*Psi*(Nd-1)/Nd per rank. The trainer's
    ZeRO-1 reduce-scatters the step's accumulated gradients once (Megatron's distributed optimizer) and
    ZeRO-2 every micro-batch (m times), then both all-gather the weights once; under bf16 ZeRO-1/2 the
    all-gather moves 2-byte weights: ZeRO-1 sends 4 + 2 = 6 bytes per parameter (x (Nd-1)/Nd), 2 + 2 with
    bf16 gradient reduction; under PowerSGD it all-reduces (whole matrices) and sends what ZeRO-0 does plus
    the all-gather."""
    psi, m = 1e9, 4
    ring = (dp - 1) / dp

    def total(traffic):
        return sum(b for _, b, _ in traffic)

    assert total(comm.dp_traffic(psi, 0, dp, m, 4, 4)) == pytest.approx(2 * 4 * psi * ring)
    assert total(comm.dp_traffic(psi, 2, dp, 1, 4, 4)) == pytest.approx(2 * 4 * psi * ring)  # = all-reduce
    z2 = comm.dp_traffic(psi, 2, dp, m, 4, 2)
    assert z2 == [("reduce_scatter", pytest.approx(m * 4 * psi * ring), m),
                  ("all_gather", pytest.approx(2 * psi * ring), 1)]
    assert comm.dp_traffic(psi, 1, dp, m, 4, 2) == [("reduce_scatter", pytest.approx(4 * psi * ring), 1),
                                                    ("all_gather", pytest.approx(2 * psi * ring), 1)]
    assert total(comm.dp_traffic(psi, 1, dp, m, 4, 2)) == pytest.approx(6 * psi * ring)
    assert total(comm.dp_traffic(psi, 1, dp, m, 2, 2)) == pytest.approx(4 * psi * ring)
    psgd = (0.5 * psi, 0.01 * psi)
    assert total(comm.dp_traffic(psi, 1, dp, m, 4, 2, powersgd=psgd)) == pytest.approx(
        total(comm.dp_traffic(psi, 0, dp, m, 4, 2, powersgd=psgd)) + 2 * psi * ring)


# Korthikanti et al. 2022, Table 3: (name, heads a, hidden h, layers L, tp t, pp p, micro-batch b); s = 2048.
KORTHIKANTI_MODELS = [
    ("22B", 64, 6144, 48, 8, 1, 4),
    ("175B", 96, 12288, 96, 8, 8, 1),
    ("530B", 128, 20480, 105, 8, 35, 1),
    ("1T", 160, 25600, 128, 8, 64, 1),
]
SEQ = 2048


def gpt_shape(a: int, h: int, L: int) -> ModelShape:
    return ModelShape(layers=L, hidden=h, heads=a, kv_heads=a, ffn_hidden=4 * h, vocab=51200, seq_len=SEQ,
                      activation="gelu", norm="layernorm", position="learned", tied_embeddings=True, bias=True,
                      dropout=0.1)


@pytest.mark.parametrize("name,a,h,L,t,p,b", KORTHIKANTI_MODELS)
def test_korthikanti_table_2(name, a, h, L, t, p, b):
    m, s = gpt_shape(a, h, L), SEQ
    sbh = s * b * h

    def got(tp: int, sp: bool, rec: str) -> float:
        return layer_activation_bytes(m, b, tp, sp, rec, 2)

    assert got(1, False, "none") == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)  # no parallelism
    assert got(t, False, "none") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)  # TP
    assert got(t, True, "none") == pytest.approx(sbh / t * (34 + 5 * a * s / h), rel=1e-12)  # TP + SP
    assert got(t, False, "selective") == pytest.approx(sbh * (10 + 24 / t), rel=1e-12)  # TP + selective
    assert got(t, True, "selective") == pytest.approx(34 * sbh / t, rel=1e-12)  # TP + SP + selective
    assert got(t, False, "full") == pytest.approx(2 * sbh, rel=1e-12)  # full recompute: the layer input
    assert got(t, True, "full") == pytest.approx(2 * sbh / t, rel=1e-12)


def _spec(pp: int, v: int, layers: int, heads: int, hidden: int, tp: int, recompute: str, m: int):
    sched = "interleaved" if v > 1 else "1f1b"
    return load_spec_text(f"""
name: k
model: {{layers: {layers}, hidden: {hidden}, heads: {heads}, ffn_hidden: {4 * hidden}, vocab: 51200,
         seq_len: {SEQ}, bias: true, dropout: 0.1, tied_embeddings: true}}
parallel: {{tp: {tp}, pp: {pp}, dp: 1, sequence_parallel: true, micro_batch: 1, schedule: {sched},
           virtual_stages: {v}, stage_layers: {[layers // (pp * v)] * (pp * v)}}}
train: {{global_batch: {m}, steps: 10, recompute: {recompute}}}
cluster: {{nodes: {tp * pp // 8}, gpus_per_node: 8, gpu: a100-80gb, interconnect: hdr}}
launcher: {{backend: slurm}}
""")


def test_first_stage_holds_p_microbatches_1f1b():
    """Korthikanti Sec. 4.2.3: with 1F1B the first stage keeps p micro-batches of L/p layers = L layers'
    worth (34*s*b*h*L/t with SP + selective in the paper), plus the embedding dropout mask s*b*h/t per
    micro-batch; and (not in the paper) autocast's one 16-bit copy of the stage's L/p layers' matmul weights
    (12h^2/t each: QKV and O 4h^2, the 4h MLP 8h^2), which it saves for backward as the weights are fp32."""
    a, h, L, t, p = 96, 12288, 96, 8, 8  # the 175B row
    spec = _spec(pp=p, v=1, layers=L, heads=a, hidden=h, tp=t, recompute="selective", m=64)
    ev = Evaluator(context_from_spec(spec))
    from trainctl.plan.plan import candidate_from_spec

    first = ev.evaluate(candidate_from_spec(spec)).ranks[0]
    sbh = SEQ * 1 * h
    per_layer = trainer_layer_activation_bytes(ModelShape.from_spec(spec.model), 1, t, True, "selective", "bf16",
                                                 on_gpu=True)
    copies = 2 * L // p * 12 * h * h / t
    assert first.activations == pytest.approx(per_layer * L + p * sbh / t + copies, rel=1e-12)


def test_interleaved_scaling_of_first_stage():
    """Korthikanti Sec. 4.2.3: interleaving with v chunks multiplies the first stage's activations by
    1 + (p-1)/(p*v) (here with full recompute: the block input per layer, s*b*h/t values with SP)."""
    a, h, L, t, p, v = 96, 12288, 96, 8, 8, 2
    spec = _spec(pp=p, v=v, layers=L, heads=a, hidden=h, tp=t, recompute="full", m=64)
    from trainctl.plan.plan import candidate_from_spec

    first = Evaluator(context_from_spec(spec)).evaluate(candidate_from_spec(spec)).ranks[0]
    sbh = SEQ * h
    layers_worth = 2 * sbh / t * L * (1 + (p - 1) / (p * v))  # the trainer keeps each block's bf16 input
    emb_mask = (2 * p - 1) * sbh / t  # chunk 0 of the first rank holds 2p-1 micro-batches at the peak
    assert first.activations == pytest.approx(layers_worth + emb_mask, rel=1e-12)


BASE = """
name: dp-growth
model: {preset: llama3-8b}
parallel: {tp: 1, pp: 1, dp: auto}
train: {global_batch: 4096, steps: 10}
cluster: {nodes: 1, gpus_per_node: 8, gpu: h100-sxm}
"""


@settings(max_examples=60, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4]), v=st.sampled_from([1, 2]),
    zero=st.sampled_from([1, 2, 3]), mb=st.sampled_from([1, 2]), rec=st.sampled_from(["none", "selective", "full"]),
    dp=st.sampled_from([1, 2, 4, 8, 16]), growth=st.sampled_from([2, 4, 8]), fixed_global=st.booleans(),
)
def test_memory_per_gpu_never_grows_with_dp_under_zero(tp, pp, v, zero, mb, rec, dp, growth, fixed_global):
    """ZeRO >= 1 shards model states over dp; activations depend on micro-batches in flight, which never
    rise when each replica gets fewer micro-batches. So more dp never needs more memory per GPU."""
    if v > 1 and pp == 1:
        v = 1
    sched = "interleaved" if v > 1 else "1f1b"
    spec = load_spec_text(BASE)
    ctx0 = context_from_spec(spec)
    per_replica = 8 * pp  # micro-batches per replica at the smaller dp (a multiple of pp)
    gb = per_replica * mb * dp * growth  # divisible at both sizes

    def total(d: int, global_batch: int) -> float:
        ctx = replace(ctx0, world=tp * pp * d, global_batch=global_batch)
        c = Candidate(tp=tp, pp=pp, dp=d, zero=zero, micro_batch=mb, recompute=rec, sequence_parallel=tp > 1,
                      schedule=sched, virtual_stages=v)
        return Evaluator(ctx).evaluate(c, detail=False).memory_total

    small = total(dp, gb if fixed_global else per_replica * mb * dp)
    large = total(dp * growth, gb if fixed_global else per_replica * mb * dp * growth)
    assert large <= small * (1 + 1e-12)


# Measured on one NVIDIA H100 80GB (torch 2.11+cu130, 2026-11-27), `bench/saved_tensors.py --device cuda
# --micro-batch 8` at --recompute none and selective: the bytes autocast saved for backward in one forward of a
# 2-layer Llama-style stage (h 2048, GQA 16/8, SwiGLU 5632, vocabulary 32,000, sequence 2048, bf16 autocast,
# fp32 weights), summed over the layers' modules, the final norm + LM head + loss, and the 16-bit weight copies.
GPU_SAVED = {"none": 2_252_619_808, "selective": 2_049_196_032}  # both layers
GPU_HEAD = 2_231_586_816
GPU_WEIGHT_COPIES = 319_815_680
# What the planner leaves out: RoPE's cos and sin rows (2 x 2048 x 128 fp32, shared by the stage's layers),
# the flash kernel's RNG seed and offset (2 int64 per layer), the norms' bf16 weight casts (2048 values each,
# two per layer and the final norm), the loss's int64 targets and bool mask per token.
ROPE_ROWS, RNG_SCALARS, LOSS_TARGETS = 2 * 2048 * 128 * 4, 2 * 2 * 8, 8 * 2048 * (8 + 1)
LAYER_NORM_CASTS, FINAL_NORM_CAST = 2 * 2 * 2048 * 2, 2048 * 2


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_gpu_activations_are_what_an_h100_saved(recompute):
    """On a GPU, CUDA's fused RMSNorm keeps its bf16 input and fp32 rstd only (the CPU's lean_ops RMSNorm keeps
    the same), the SwiGLU only [gate; up], and autocast saves one 16-bit copy of each matmul weight."""
    from trainctl.model_shape import stage_matmul_params_per_gpu
    from trainctl.plan.memory import AUTOCAST_COPY_BYTES, autocast_copies, trainer_head_activation_bytes
    from trainctl.spec.models import ModelSpec

    m = ModelShape.from_spec(ModelSpec(layers=2, hidden=2048, heads=16, kv_heads=8, ffn_hidden=5632, vocab=32000,
                                       seq_len=2048, activation="swiglu", norm="rmsnorm", position="rope",
                                       tied_embeddings=False, bias=False))
    layers = 2 * trainer_layer_activation_bytes(m, 8, 1, False, recompute, "bf16", on_gpu=True)
    rng = RNG_SCALARS if recompute == "none" else 0  # selective recompute re-runs the attention core
    assert layers == GPU_SAVED[recompute] - ROPE_ROWS - rng - LAYER_NORM_CASTS
    head = trainer_head_activation_bytes(m, 8, 1, False, 32000, "bf16", on_gpu=True)
    assert head == GPU_HEAD - LOSS_TARGETS - FINAL_NORM_CAST
    # independently: 2 bytes x (2 layers x (QKV 2048 x 4096 + O 2048^2 + gate/up 2048 x 11264 + down 5632 x 2048)
    # + the LM head 32000 x 2048)
    copies = 2 * (2 * (2048 * 4096 + 2048**2 + 2048 * 11264 + 5632 * 2048) + 32000 * 2048)
    assert copies == GPU_WEIGHT_COPIES
    assert autocast_copies("bf16", 0, 1) and AUTOCAST_COPY_BYTES * stage_matmul_params_per_gpu(m, 1, 2, True) == copies
    # a 16-bit RMSNorm on a CPU keeps what CUDA's does (runtime/model/lean_ops.rms_norm_16bit)
    assert trainer_layer_activation_bytes(m, 8, 1, False, recompute, "bf16", on_gpu=False) == layers / 2


def test_trainer_tp_sp_selective_against_korthikanti():
    """The trainer's per-layer bytes under TP + SP + selective recompute (bf16, a GPU) against Megatron's.

    GPT shapes: Korthikanti et al. 2022, Table 2, 34*s*b*h/t. Llama (SwiGLU, GQA, RMSNorm, no dropout or
    biases), derived term by term as the paper does (Sec. 4.1) for Megatron-LM, 2 bytes a value, all split over
    t: the two norm inputs (4sbh), the QKV input (2sbh), its [q; k; v] output (2sb(h + 2kv)), the output
    projection's input (2sbh), the MLP input (2sbh), the fused SwiGLU's input [gate; up] (4sbf) and the down
    projection's input (2sbf). The trainer keeps what Megatron keeps: the column-parallel layers keep their
    sequence shard, the residual stream and so the norm inputs are bf16, and the SwiGLU recomputes silu(gate).
    What remains different, asserted exactly: the norms keep fp32 per-token statistics (LayerNorm mean and
    rstd, RMSNorm rstd; the paper leaves them out), under 0.5% here."""
    for _name, a, h, L, t, _p, b in KORTHIKANTI_MODELS:
        m, s = gpt_shape(a, h, L), SEQ
        sb, sbh = s * b, s * b * h
        paper = 34 * sbh / t
        got = trainer_layer_activation_bytes(m, b, t, True, "selective", "bf16", on_gpu=True)
        assert got == pytest.approx(paper + 2 * 2 * 4 * sb / t, rel=1e-12)
        assert got / paper < 1.005
    s, b, t, h, kv, f = 8192, 1, 8, 8192, 1024, 28672  # Llama 3 70B at TP8
    llama = ModelShape(layers=80, hidden=h, heads=64, kv_heads=8, ffn_hidden=f, vocab=128256, seq_len=s,
                       activation="swiglu", norm="rmsnorm", position="rope", tied_embeddings=False, bias=False)
    sb, sbh = s * b, s * b * h
    megatron = (4 * sbh + 2 * sbh + 2 * sb * (h + 2 * kv) + 2 * sbh + 2 * sbh + 4 * sb * f + 2 * sb * f) / t
    got = trainer_layer_activation_bytes(llama, b, t, True, "selective", "bf16", on_gpu=True)
    assert got == pytest.approx(megatron + 2 * 4 * sb / t, rel=1e-12)
    assert got / megatron < 1.001


def test_dropout_on_a_gpu_keeps_no_attention_scores() -> None:
    """On CUDA, SDPA's flash and memory-efficient kernels take attention dropout without keeping the s x s scores
    (the mask is regenerated from the RNG state in backward); the CPU's math kernel keeps the scores, the mask and
    the dropped copy. So on a GPU dropout adds only the two residual dropout masks (1 byte per value of the s x b x h
    stream each), on a CPU those and 2 + (1 + 2) bytes per score of each head."""
    from trainctl.model_shape import ModelShape
    from trainctl.plan.memory import trainer_layer_activation_bytes

    s, b, h, heads = 1024, 2, 512, 8
    plain = ModelShape(layers=2, hidden=h, heads=heads, vocab=1000, seq_len=s)
    dropped = ModelShape(layers=2, hidden=h, heads=heads, vocab=1000, seq_len=s, dropout=0.1)

    def delta(on_gpu: bool) -> float:
        return (trainer_layer_activation_bytes(dropped, b, 1, False, "none", "bf16", on_gpu=on_gpu)
                - trainer_layer_activation_bytes(plain, b, 1, False, "none", "bf16", on_gpu=on_gpu))

    masks = 2 * s * b * h
    assert delta(on_gpu=True) == masks
    assert delta(on_gpu=False) == masks + heads * s * s * b * (2 + 1 + 2)

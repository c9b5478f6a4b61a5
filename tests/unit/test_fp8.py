"""FP8 training (train.precision fp8; docs/design/trainer.md, "FP8 training"): the linear layer's three GEMMs
against an independent reference, which quantizes with PyTorch's float8 dtypes by hand and multiplies the
dequantized operands in fp64; the error against the exact product within the rounding the recipe implies;
which layers the conversion touches; a tiny model's loss curve in FP8 against the base precision; the spec rule.
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_utils import trainctl

from trainctl.model_shape import ModelShape
from trainctl.runtime.model.fp8 import Fp8Recipe, fp8_gemm, quantize
from trainctl.runtime.model.transformer import build_stage, loss_fn
from trainctl.runtime.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    enable_fp8,
)
from trainctl.units import dur

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SINGLE = TPContext.single()
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# e4m3 keeps 3 mantissa bits: a normal value rounds to within 2^-4 of itself relatively (e5m2: 2 bits, 2^-3)
U = {E4M3: 2.0**-4, E5M2: 2.0**-3}


def ref_dequantized(t: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> torch.Tensor:
    """What the recipe's quantization leaves of t, in fp64, written from the recipe's definition: scale =
    FP8 max / amax (per row of t, or of all of it) in fp32, values cast to the FP8 dtype, divided back."""
    a = t.abs().amax(dim=1, keepdim=True) if rowwise else t.abs().amax()
    scale = torch.finfo(dtype).max / a.float()
    fp8 = (t.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    return fp8.double() / scale.double()


def reference_linear(x, w, g, recipe: str):
    """(y, dx, dw) of y = x w^T with each GEMM's operands quantized along its contraction dimension: forward
    x and w in e4m3; backward g in e5m2 (tensorwise) or e4m3 (rowwise), against w's columns and x's columns."""
    rw = recipe == "rowwise"
    gd = E4M3 if rw else E5M2
    y = ref_dequantized(x, E4M3, rw) @ ref_dequantized(w, E4M3, rw).t()
    dx = ref_dequantized(g, gd, rw) @ ref_dequantized(w.t(), E4M3, rw).t()
    dw = ref_dequantized(g.t(), gd, rw) @ ref_dequantized(x.t(), E4M3, rw).t()
    return y, dx, dw


def fp8_layer(x, w, g, recipe: str, kind: type = ColumnParallelLinear):
    layer = kind(w.shape[1], w.shape[0], SINGLE)
    layer.fp8 = Fp8Recipe.named(recipe)
    with torch.no_grad():
        layer.weight.copy_(w)
    xin = x.clone().requires_grad_(True)
    y = layer(xin)
    y.backward(g)
    return y.detach(), xin.grad, layer.weight.grad


def operands(seed: int = 0, m: int = 48, k: int = 64, n: int = 32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, m).unsqueeze(1)  # rows of different scales
    w = torch.randn(n, k, generator=gen) * 0.05
    g = torch.randn(m, n, generator=gen) * 1e-3
    return x, w, g


@pytest.mark.parametrize("kind", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_matches_the_hand_quantized_reference(recipe: str, kind: type) -> None:
    """The same FP8 values on both sides, so only fp32 accumulation separates them: each output and gradient
    within 1e-5 of its largest magnitude."""
    x, w, g = operands()
    got = fp8_layer(x, w, g, recipe, kind)
    for name, a, b in zip(("y", "dx", "dw"), got, reference_linear(x.double(), w.double(), g.double(), recipe),
                          strict=True):
        err = (a.double() - b).abs().max().item() / b.abs().max().item()
        assert err < 1e-5, (name, err)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_cpu_fp8_gemm_is_the_dequantized_operands_product_exactly(recipe: str, out_dtype: torch.dtype) -> None:
    """On a CPU each FP8 GEMM, for every pair of formats the recipes multiply, is the fp32 product of its
    dequantized operands bit for bit: what the module says it computes, on torch's fast CPU path (one scale per
    tensor on two e4m3 operands otherwise runs a naive loop whose sums come out in another order)."""
    x, w, g = operands(seed=2)
    rowwise = recipe == "rowwise"
    gd = Fp8Recipe.named(recipe).grad_dtype
    for a, b, a_dtype in ((x, w, E4M3), (g, w.t().contiguous(), gd), (g.t().contiguous(), x.t().contiguous(), gd)):
        got = fp8_gemm(a, b, a_dtype=a_dtype, b_dtype=E4M3, rowwise=rowwise, out_dtype=out_dtype)
        (qa, ia), (qb, ib) = quantize(a, a_dtype, rowwise), quantize(b, E4M3, rowwise)
        dequantized = ((qa.float() * ia) @ (qb.float() * ib).t()).to(out_dtype)
        assert torch.equal(got, dequantized), (a_dtype, (got.float() - dequantized.float()).abs().max().item())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("rows_a,rows_b", [(1, 8), (8, 1), (1, 1)])
def test_a_cpu_fp8_gemm_takes_one_row_operands(recipe: str, rows_a: int, rows_b: int) -> None:
    """A one-row operand (a row of the full equivalence matrix met one: TP2 PP2 DP2 SP ZeRO-1, micro-batch 2, full
    recompute, tensorwise; an MoE expert routed a single token is one way to get there) multiplies like any other:
    the dequantized operands' fp32 product, to fp32 rounding (a one-row product is a matrix-vector product, summed
    in its own order), where the tensorwise CPU path's per-row scales once kept a stride of 0 that torch's kernel
    refused."""
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(rows_a, 16, generator=gen), torch.randn(rows_b, 16, generator=gen)
    rowwise = recipe == "rowwise"
    got = fp8_gemm(a, b, a_dtype=E4M3, b_dtype=E4M3, rowwise=rowwise, out_dtype=torch.float32)
    (qa, ia), (qb, ib) = quantize(a, E4M3, rowwise), quantize(b, E4M3, rowwise)
    torch.testing.assert_close(got, (qa.float() * ia) @ (qb.float() * ib).t(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_error_against_the_exact_product_is_the_recipes_rounding(recipe: str) -> None:
    """Against the exact fp64 product, each element's error stays within what rounding both operands implies,
    (2u + u^2) sum_k |a_ik||b_jk| (u: 2^-4 for e4m3, 2^-3 for e5m2), plus the subnormal floor, and the
    quantization is real: the error is far above fp32's. Rowwise is the more accurate on rows of unequal scale."""
    x, w, g = operands(seed=1)
    y, dx, dw = fp8_layer(x, w, g, recipe)
    gd = E4M3 if recipe == "rowwise" else E5M2
    xd, wd, gdd = x.double(), w.double(), g.double()
    errors = {}
    for name, got, a, b, ua, ub in (("y", y, xd, wd, U[E4M3], U[E4M3]), ("dx", dx, gdd, wd.t(), U[gd], U[E4M3]),
                                    ("dw", dw, gdd.t(), xd.t(), U[gd], U[E4M3])):
        exact = a @ b.t()
        bound = (ua + ub + ua * ub) * (a.abs() @ b.abs().t())
        err = (got.double() - exact).abs()
        assert (err <= bound * 1.01 + 1e-9 * exact.abs().max()).all(), name
        errors[name] = (err.max() / exact.abs().max()).item()
        assert errors[name] > 1e-4, (name, errors[name])  # fp32 would give ~1e-7
    print(recipe, {k: f"{v:.1e}" for k, v in errors.items()})


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_expert_given_no_tokens_runs(recipe: str) -> None:
    """A routed expert may receive no rows: an empty output and zero weight gradient, as F.linear gives."""
    _, w, _ = operands()
    y, dx, dw = fp8_layer(torch.zeros(0, w.shape[1]), w, torch.zeros(0, w.shape[0]), recipe)
    assert y.shape == (0, w.shape[0]) and dx.shape == (0, w.shape[1])
    assert torch.equal(dw, torch.zeros_like(w))


def test_rowwise_scales_follow_each_row() -> None:
    """A row 10^5 times smaller than the largest keeps e4m3's relative precision under rowwise and loses most
    of it under tensorwise (one scale for all puts its values among e4m3's subnormals, 2^-9 to 2^-6)."""
    x, w, g = operands(seed=2)
    x[0] *= 1e-4  # its entries ~1e-6, the largest ~40
    exact = x.double() @ w.double().t()
    small = exact[0].abs().max()
    errs = {r: ((fp8_layer(x, w, g, r)[0][0].double() - exact[0]).abs().max() / small).item()
            for r in ("tensorwise", "rowwise")}
    assert errs["rowwise"] < 0.1 < errs["tensorwise"], errs


def test_conversion_leaves_the_lm_head_and_embeddings_alone() -> None:
    cfg = ModelShape(layers=2, hidden=32, heads=4, vocab=255, seq_len=16, tied_embeddings=False,
                     activation="swiglu", norm="rmsnorm", position="rope")
    model = build_stage(cfg, range(2), first=True, last=True, seed=1)
    n = enable_fp8(model, Fp8Recipe.named("tensorwise"))
    converted = {name for name, m in model.named_modules() if getattr(m, "fp8", None) is not None}
    assert n == len(converted) == 2 * 4  # qkv, proj, fc1, fc2 per layer
    assert all(name.split(".")[-1] in ("qkv", "proj", "fc1", "fc2") for name in converted)
    assert model.head.fp8 is None


def _structured_batch(cfg: ModelShape, step: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences a model can learn: each token is (3 * previous + 7) mod vocab from a random start, with
    one in eight replaced by noise, so the loss falls well below ln(vocab) and stays above 0."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, cfg.vocab, (b, 1), generator=gen)
    seq = [start]
    for _ in range(cfg.seq_len):
        seq.append((3 * seq[-1] + 7) % cfg.vocab)
    ids = torch.cat(seq, 1)
    noise = torch.rand(ids.shape, generator=gen) < 0.125
    ids = torch.where(noise, torch.randint(0, cfg.vocab, ids.shape, generator=gen), ids)
    return ids[:, :-1], ids[:, 1:]


def loss_curve(fp8: str | None, steps: int) -> list[float]:
    cfg = ModelShape(layers=2, hidden=32, heads=4, vocab=64, seq_len=16, tied_embeddings=False,
                     activation="swiglu", norm="rmsnorm", position="rope")
    model = build_stage(cfg, range(2), first=True, last=True, seed=5)
    if fp8:
        enable_fp8(model, Fp8Recipe.named(fp8))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for step in range(steps):
        x, y = _structured_batch(cfg, step, 8)
        loss = loss_fn(model(x), y, cfg, SINGLE)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


STEPS, WINDOW = 200, 20
BAND = 0.02  # FP8's loss within 2% of the base precision's, averaged over each window of 20 steps


def test_fp8_loss_curve_stays_within_the_band_of_the_base_precision() -> None:
    """A tiny Llama on learnable sequences, 200 steps in fp32 and in FP8 (both recipes): the loss falls by
    more than half in every run, and each 20-step window's mean FP8 loss stays within 2% of fp32's. The band:
    e4m3's 2^-4 rounding per operand perturbs each GEMM by a few percent of its output, which changes the path
    of training, not where it goes; the windows average out the per-batch noise."""
    base = loss_curve(None, STEPS)
    assert base[-1] < 0.5 * base[0]
    for recipe in ("tensorwise", "rowwise"):
        fp8 = loss_curve(recipe, STEPS)
        assert fp8[-1] < 0.5 * fp8[0]
        gaps = [abs(sum(fp8[i:i + WINDOW]) - sum(base[i:i + WINDOW])) / sum(base[i:i + WINDOW])
                for i in range(0, STEPS, WINDOW)]
        assert max(gaps) <= BAND, (recipe, [f"{gap:.3f}" for gap in gaps])
        assert fp8 != base  # FP8 really ran
        print(f"{recipe}: final loss fp32 {base[-1]:.3f} fp8 {fp8[-1]:.3f}, worst window gap {max(gaps):.2%}")


def test_fp8_is_refused_in_one_line_without_fp8_tensor_cores() -> None:
    r = trainctl("validate", "--set", "train.precision=fp8", "--set", "cluster.gpu=a100-80gb")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if "train.precision" in ln]
    assert len(lines) == 1 and "a100-80gb has no FP8 tensor cores" in lines[0] and "h100-sxm" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    ok = trainctl("validate", "--set", "train.precision=fp8", "--set", "train.fp8_recipe=rowwise",
                  "--set", "cluster.gpu=h100-sxm")
    assert ok.returncode == 0, ok.stderr


def _plan(precision: str, *sets: str) -> dict:
    r = trainctl("plan", "--json", *sets, "--set", "model.preset=llama3-8b", "--set", "parallel.tp=8", "--set",
                 "parallel.pp=1", "--set", "parallel.dp=4", "--set", "parallel.zero=0", "--set",
                 "parallel.sequence_parallel=true", "--set", "parallel.micro_batch=1", "--set", "train.global_batch=64",
                 "--set", "train.recompute=none", "--set", "cluster.nodes=4", "--set", "cluster.gpus_per_node=8",
                 "--set", "cluster.gpu=h100-sxm", "--set", "launcher.backend=slurm",
                 "--set", f"train.precision={precision}")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_plan_prices_fp8_gemms_at_the_fp8_peak_and_reports_mfu_against_bf16() -> None:
    """Llama 3 8B on 32 H100 SXM (TP8 + SP, DP4): the linear layers' GEMM FLOPs at the FP8 peak (1,979 against
    989.4 TFLOP/s dense, NVIDIA's H100 datasheet), the attention core and the LM head at bf16's. By hand, per
    token: each layer's matmul weights n = h(h + 2*kv*hd) + h*h + 3*h*f, 6n FLOPs, the attention core 12*h*s,
    the head 6*V*h. MFU stays against the BF16 peak; the memory loses autocast's 2-byte copies of the layers'
    weights (the FP8 layers quantize the fp32 weight itself)."""
    h, f, kv_hd, layers, vocab, seq, tp = 4096, 14336, 8 * 128, 32, 128256, 8192, 8
    n = h * (h + 2 * kv_hd) + h * h + 3 * h * f
    ratio = 1979.0 / 989.4
    bf16_flops = layers * (6 * n + 12 * h * seq) + 6 * vocab * h
    fp8_flops = layers * (6 * n / ratio + 12 * h * seq) + 6 * vocab * h
    flat = ("--set", "estimate.compute_efficiency=0.6")  # one rate for every FLOP: the ratio is the FLOPs'
    bf16, fp8 = _plan("bf16", *flat), _plan("fp8", *flat)
    assert fp8["prediction"]["compute_s"] / bf16["prediction"]["compute_s"] == pytest.approx(fp8_flops / bf16_flops,
                                                                                          rel=1e-9)
    # the operator model (plan/operators.py) runs only the linear layers' GEMMs faster, and prices the quantization
    # of their operands: fused (train.compile, estimate.elementwise fused) the step is shorter, between that and
    # nothing; eager, each linear layer's input and output gradient are quantized twice at 33 bytes a value and
    # transposed once (4 bytes), 70 bytes a value against fused's 10 (plan/operators.py fp8_activation_bytes):
    # per layer and micro-batch sum(t*k + t*n) over the rank's four linear layers, t = 8192 tokens (SP gathers
    # them), (k, n) = (4096, 768), (512, 4096), (4096, 3584), (1792, 4096); 32 layers, 16 micro-batches, 3.35 TB/s
    fused = ("--set", "estimate.elementwise=fused")
    plans = {(p, e): _plan(p, *e) for p in ("bf16", "fp8") for e in ((), fused)}
    ops = {k: j["prediction"]["compute_s"] for k, j in plans.items()}
    assert 0.5 < ops["fp8", fused] / ops["bf16", fused] < 1.0, ops
    quantize = (70 - 10) * 8192 * (4864 + 4608 + 7680 + 5888) * 32 * 16 / 3.35e12
    eager_extra = (ops["fp8", ()] - ops["bf16", ()]) - (ops["fp8", fused] - ops["bf16", fused])
    assert eager_extra == pytest.approx(quantize, rel=1e-9)
    assert ops["fp8", ()] > ops["bf16", ()]  # eager, the quantization costs more than the FP8 GEMMs save
    # and the plan says so, with the bf16 step and the compiled one (train.compile fuses the quantization)
    warning = next(w["message"] for w in plans["fp8", ()]["warnings"] if w["code"] == "FP8_EAGER")
    compiled = _plan("fp8", "--set", "train.compile=true")
    assert dur(plans["fp8", ()]["prediction"]["step_time_s"]) in warning
    assert dur(plans["bf16", ()]["prediction"]["step_time_s"]) in warning
    assert dur(compiled["prediction"]["step_time_s"]) in warning
    assert not [w for w in compiled["warnings"] if w["code"] == "FP8_EAGER"]
    assert fp8["hardware"]["peak_flops"] == bf16["hardware"]["peak_flops"] == 989.4e12
    p = fp8["prediction"]
    assert p["mfu"] == pytest.approx(fp8["flops"]["model_per_step"] / (p["step_time_s"] * 32 * 989.4e12), rel=1e-9)
    assert p["mfu"] > bf16["prediction"]["mfu"]
    saved = bf16["memory"]["total"] - fp8["memory"]["total"]
    assert saved == pytest.approx(2 * layers * n / tp, rel=1e-12)


def test_mfu_report_states_the_fp8_convention_on_a_gpu() -> None:
    from trainctl.report.summary import mfu_convention

    on_gpu = mfu_convention("fp8", "catalog h100-sxm dense BF16 989.4 TFLOP/s (NVIDIA H100 80GB HBM3 via NVML)")
    assert "against the dense BF16 peak" in on_gpu
    assert "bf16" in mfu_convention("bf16", "catalog h100-sxm dense BF16 989.4 TFLOP/s")

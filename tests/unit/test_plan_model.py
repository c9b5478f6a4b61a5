"""Parameter counts and FLOPs against published formulas and figures.

Sources:
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC21): Sec. 5.1 / Appendix, parameter count P = 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h))
  and FLOPs per iteration with full recompute F = 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)); Table 1 rows.
- Chowdhery et al. 2022, "PaLM", Appendix B: model FLOPs per token 6N + 12*L*H*Q*T, and PaLM 540B's
  46.2% MFU (238.3K tokens/s on 6144 TPU v4 chips of 275 TFLOP/s peak).
"""

from __future__ import annotations

import pytest

from trainctl import model_shape as model
from trainctl.model_shape import ModelShape
from trainctl.spec import load_spec_text
from trainctl.spec.models import ModelSpec

V, S = 51200, 2048  # Megatron-LM 2021: vocabulary (padded GPT-2 BPE) and sequence length of every row

# Narayanan et al. 2021, Table 1: (parameters in billions as printed, heads, hidden, layers, batch).
MEGATRON_TABLE1 = [
    (1.7, 24, 2304, 24, 512),
    (3.6, 32, 3072, 30, 512),
    (7.5, 32, 4096, 36, 512),
    (18.4, 48, 6144, 40, 1024),
    (39.1, 64, 8192, 48, 1536),
    (76.1, 80, 10240, 60, 1792),
    (145.6, 96, 12288, 80, 2304),
    (310.1, 128, 16384, 96, 2160),
    (529.6, 128, 20480, 105, 2520),
    (1008.0, 160, 25600, 128, 3072),
]
# GPT-3 175B (Brown et al. 2020; Megatron-LM 2021 Sec. 5.2): 96 layers, 12288 hidden, 96 heads.
ROWS = [*MEGATRON_TABLE1, (175.0, 96, 12288, 96, 1536)]


def gpt(layers: int, hidden: int, heads: int) -> ModelShape:
    """Megatron's GPT: LayerNorm, biases, learned positions, tied embeddings, 4h GELU MLP."""
    return ModelShape(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn_hidden=4 * hidden, vocab=V,
                      seq_len=S, activation="gelu", norm="layernorm", position="learned", tied_embeddings=True,
                      bias=True, dropout=0.1)


@pytest.mark.parametrize("billions,heads,h,l,batch", ROWS)
def test_parameter_count_matches_megatron_formula(billions, heads, h, l, batch):  # noqa: E741 - the paper's l
    # P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) = 12 l h^2 + 13 l h + (V + s) h, in integers.
    megatron = 12 * l * h * h + 13 * l * h + (V + S) * h
    counts = model.param_counts(gpt(l, h, heads))
    # The paper's formula leaves out the final LayerNorm (weight + bias = 2h); we count it.
    assert counts.total == megatron + 2 * h
    # The printed figure is P rounded to 0.1 B (the 175B row is GPT-3's nominal size: 174.6 B).
    tolerance = 0.051 if billions != 175.0 else 0.5
    assert abs(counts.total / 1e9 - billions) < tolerance


@pytest.mark.parametrize("billions,heads,h,l,batch", ROWS)
def test_flops_per_iteration_matches_megatron_formula(billions, heads, h, l, batch):  # noqa: E741
    shape = gpt(l, h, heads)
    tokens = batch * S
    # Full recompute: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) = 96Bslh^2 + 16Bs^2lh + 6BsVh.
    full = 96 * batch * S * l * h * h + 16 * batch * S * S * l * h + 6 * batch * S * V * h
    assert model.hardware_flops_per_token(shape, "full") * tokens == full
    # Model FLOPs (no recompute): 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) = 72Bslh^2 + 12Bs^2lh + 6BsVh.
    plain = 72 * batch * S * l * h * h + 12 * batch * S * S * l * h + 6 * batch * S * V * h
    assert model.model_flops_per_token_of(shape) * tokens == plain
    assert model.hardware_flops_per_token(shape, "none") * tokens == plain
    # Selective recompute re-runs QK^T and A*V forward: 4*s*h per token per layer (Korthikanti et al. 2022).
    assert model.hardware_flops_per_token(shape, "selective") * tokens == plain + 4 * batch * S * S * l * h


def test_gpt3_plan_hardware_flops_equal_megatron_formula():
    """The whole planner on a GPT-3 175B spec (full recompute, B = 1536): Narayanan et al. 2021's F."""
    spec = load_spec_text("""
name: gpt3
model: {preset: gpt3-175b}
parallel: {tp: 8, pp: 8, dp: 24, micro_batch: 1, schedule: interleaved, virtual_stages: 2}
train: {global_batch: 1536, steps: 10, recompute: full}
cluster: {nodes: 192, gpus_per_node: 8, gpu: a100-80gb, interconnect: hdr}
launcher: {backend: slurm}
""")
    from trainctl.plan.plan import build_plan

    p = build_plan(spec)
    B, l, h = 1536, 96, 12288  # noqa: E741
    full = 96 * B * S * l * h**2 * (1 + S / (6 * h) + V / (16 * l * h))
    plain = 72 * B * S * l * h**2 * (1 + S / (6 * h) + V / (12 * l * h))
    assert p.est.hardware_flops == pytest.approx(full, rel=1e-12)
    assert p.est.model_flops == pytest.approx(plain, rel=1e-12)
    assert p.to_json()["flops"]["hardware_per_step"] == pytest.approx(full, rel=1e-12)


def test_palm_540b_model_flops_and_mfu():
    """PaLM (Chowdhery et al. 2022), Appendix B: 6N + 12*L*H*Q*T with N = 540.35B, L = 118, H = 48,
    Q = 256, T = 2048; at 238.3K tokens/s on 6144 chips of 275 TFLOP/s that is 46.2% MFU (Table 3)."""
    N, L, H, Q, T = 540.35e9, 118, 48, 256, 2048
    per_token = model.model_flops_per_token(N, L, H * Q, T)
    assert per_token == 6 * N + 12 * L * H * Q * T
    assert per_token == pytest.approx(3.2778e12, rel=1e-4)
    mfu = 238.3e3 * per_token / (6144 * 275e12)
    assert round(mfu * 100, 1) == 46.2


def test_design_convention_attention_width_is_hidden():
    """The MFU convention: 6N + 12*L*h*s, where heads*head_dim = hidden in this model family."""
    shape = ModelShape.from_spec(ModelSpec(preset="llama3-8b"))
    N = model.param_counts(shape).matmul
    assert model.model_flops_per_token_of(shape) == 6 * N + 12 * 32 * 4096 * 8192


def test_llama3_parameter_counts():
    """Llama 3 (Dubey et al. 2024, Table 3): 8B, 70B, 405B; untied embeddings, RMSNorm, no biases."""
    for preset, billions in (("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85)):
        total = model.param_counts(ModelShape.from_spec(ModelSpec(preset=preset))).total
        assert total / 1e9 == pytest.approx(billions, abs=0.01)


def test_stage_params_tied_copy_and_tp_split():
    """Per-GPU parameters: matmuls and column biases split over tp; tied embeddings get a second copy on
    the last stage when it is not also the first (Megatron's embedding group)."""
    m = gpt(4, 64, 4)
    vp = m.padded_vocab(2)
    per_layer = model.layer_params_per_gpu(m, 2)
    split, repl = model.layer_bias_params(m)
    assert per_layer == (model.layer_matmul_params(m) + split) / 2 + repl + model.layer_norm_params(m)
    first = model.stage_params_per_gpu(m, 2, 2, first=True, last=False)
    last = model.stage_params_per_gpu(m, 2, 2, first=False, last=True)
    both = model.stage_params_per_gpu(m, 2, 4, first=True, last=True)
    assert first == 2 * per_layer + vp * 64 / 2 + S * 64
    assert last == 2 * per_layer + vp * 64 / 2 + m.norm_params
    assert both == 4 * per_layer + vp * 64 / 2 + S * 64 + m.norm_params  # one copy at pp = 1

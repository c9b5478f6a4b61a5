"""Hugging Face transformers' format of the trainer's model: which transformers class matches a model shape,
its config.json, and where each of our parameters lives in its safetensors. No torch.

One owner for the mapping: `trainctl export --format hf` (runtime/model/hf_weights.py writes through it),
`model.init_from` (reads through it) and the tests (compare with transformers through it) use these tables.

Families (docs/design/checkpoints.md, "Hugging Face weights"):
    llama    LlamaForCausalLM: RMSNorm, RoPE, SwiGLU, GQA; `bias: true` is its attention_bias + mlp_bias
    mixtral  MixtralForCausalLM: the llama family whose every layer is an MoE of routed experts only
             (topk_softmax router, no shared experts, no biases)
    gpt2     GPT2LMHeadModel: LayerNorm, learned positions, GELU (tanh), multi-head attention; GPT-2's linear
             layers are Conv1D, weight [in, out]: our [out, in] transposed. A model without biases exports
             them as zeros (exact) and marks its config.json (`trainctl_zero_biases`), so init_from reads it
             back with `bias: false`; other GPT-2 weights have biases and need `bias: true`.

Our fused tensors are concatenations of transformers' rows (`Piece`): qkv = [q; k; v] (GPT-2: the columns
of c_attn), SwiGLU's fc1 = [gate; up] (Mixtral's experts: [w1; w3], fc2 = w2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainctl.errors import UsageError
from trainctl.model_shape import ModelShape

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"  # sharded: {"weight_map": {key: file}}
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # transformers' names of F.gelu(approximate="tanh")
PREFIXES = ("transformer.", "model.")  # old GPT-2 files name their keys without the model's prefix


@dataclass(frozen=True)
class Piece:
    """`length` rows of one of our tensors, taken from rows [start, start + length) of transformers' tensor
    `key`, or of its transpose when `transposed` (GPT-2's Conv1D). A tensor's pieces, in order, are its rows
    (dim 0)."""

    key: str
    start: int
    length: int
    transposed: bool = False


@dataclass(frozen=True)
class HFLayout:
    """Where every parameter of a model shape lives in transformers' state dict."""

    family: str
    architecture: str
    pieces: dict[str, list[Piece]]  # our global parameter name -> its rows
    shapes: dict[str, tuple[int, ...]]  # every tensor transformers' class loads -> its shape


def family(m: ModelShape) -> str:
    """The transformers family of a model shape; UsageError naming what does not fit."""
    llama = m.norm == "rmsnorm" and m.position == "rope" and m.activation == "swiglu"
    gpt2 = m.norm == "layernorm" and m.position == "learned" and m.activation == "gelu"
    if m.moe is not None:
        e = m.moe
        if llama and not m.bias and e.router == "topk_softmax" and not e.shared_experts and e.every == 1 \
                and not e.first_dense:
            return "mixtral"
        raise UsageError("export of this MoE model is not supported yet: Hugging Face format covers Mixtral "
                         "(norm rmsnorm, position rope, activation swiglu, moe.router topk_softmax, every layer "
                         "MoE, no shared experts, bias false)",
                         hint="dense Llama and GPT-2 models and Mixtral-shaped MoE models export")
    if llama:
        return "llama"
    if gpt2 and m.kv_heads == m.heads:
        return "gpt2"
    raise UsageError(f"model (norm {m.norm}, position {m.position}, activation {m.activation}, kv_heads "
                     f"{m.kv_heads} of heads {m.heads}) matches no Hugging Face class trainctl maps",
                     hint="Llama: rmsnorm + rope + swiglu; GPT-2: layernorm + learned + gelu with kv_heads = heads")


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "gpt2": "GPT2LMHeadModel"}


def layout(m: ModelShape) -> HFLayout:
    fam = family(m)
    pieces: dict[str, list[Piece]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    (_gpt2 if fam == "gpt2" else _llama)(m, pieces, shapes)
    return HFLayout(fam, ARCHITECTURES[fam], pieces, shapes)


def _one(pieces: dict[str, list[Piece]], shapes: dict[str, tuple[int, ...]], ours: str, key: str,
         shape: tuple[int, ...], transposed: bool = False) -> None:
    """Our `ours` is transformers' `key` (of `shape`) whole, or its transpose."""
    shapes[key] = shape
    rows = shape[-1] if transposed else shape[0]
    pieces[ours] = [Piece(key, 0, rows, transposed=transposed)]


def _llama(m: ModelShape, pieces: dict[str, list[Piece]], shapes: dict[str, tuple[int, ...]]) -> None:
    h, v, hq, kv = m.hidden, m.vocab, m.heads * m.head_dim, m.kv_width
    _one(pieces, shapes, "embed.tok.weight", "model.embed_tokens.weight", (v, h))
    if not m.tied_embeddings:
        _one(pieces, shapes, "head.weight", "lm_head.weight", (v, h))
    _one(pieces, shapes, "final_norm.weight", "model.norm.weight", (h,))
    for i in range(m.layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        _one(pieces, shapes, ours + "attn_norm.weight", hf + "input_layernorm.weight", (h,))
        _one(pieces, shapes, ours + "mlp_norm.weight", hf + "post_attention_layernorm.weight", (h,))
        proj = [("q_proj", hq), ("k_proj", kv), ("v_proj", kv)]
        for kind in ("weight", "bias") if m.bias else ("weight",):
            for name, rows in proj:
                shapes[f"{hf}self_attn.{name}.{kind}"] = (rows, h) if kind == "weight" else (rows,)
            pieces[f"{ours}attn.qkv.{kind}"] = [Piece(f"{hf}self_attn.{name}.{kind}", 0, rows) for name, rows in proj]
        _one(pieces, shapes, ours + "attn.proj.weight", hf + "self_attn.o_proj.weight", (h, hq))
        if m.bias:
            _one(pieces, shapes, ours + "attn.proj.bias", hf + "self_attn.o_proj.bias", (h,))
        if m.moe is not None:  # mixtral (family() allows no other MoE)
            # the format of Mixtral's published files, which transformers 5 also saves (it stacks on load)
            e, f, moe = m.moe.num_experts, m.moe.expert_ffn_hidden, hf + "block_sparse_moe."
            _one(pieces, shapes, ours + "mlp.router.weight", moe + "gate.weight", (e, h))
            for x in range(e):
                w = f"{moe}experts.{x}."
                shapes.update({w + "w1.weight": (f, h), w + "w3.weight": (f, h), w + "w2.weight": (h, f)})
                fc1 = [Piece(w + "w1.weight", 0, f), Piece(w + "w3.weight", 0, f)]  # [gate; up]
                pieces[f"{ours}mlp.experts.{x}.fc1.weight"] = fc1
                pieces[f"{ours}mlp.experts.{x}.fc2.weight"] = [Piece(w + "w2.weight", 0, h)]
            continue
        f = m.ffn_hidden
        for kind in ("weight", "bias") if m.bias else ("weight",):
            gate_up = [f"{hf}mlp.{name}.{kind}" for name in ("gate_proj", "up_proj")]
            for key in gate_up:
                shapes[key] = (f, h) if kind == "weight" else (f,)
            pieces[f"{ours}mlp.fc1.{kind}"] = [Piece(key, 0, f) for key in gate_up]
        _one(pieces, shapes, ours + "mlp.fc2.weight", hf + "mlp.down_proj.weight", (h, f))
        if m.bias:
            _one(pieces, shapes, ours + "mlp.fc2.bias", hf + "mlp.down_proj.bias", (h,))


def _gpt2(m: ModelShape, pieces: dict[str, list[Piece]], shapes: dict[str, tuple[int, ...]]) -> None:
    h, f = m.hidden, m.ffn_hidden
    _one(pieces, shapes, "embed.tok.weight", "transformer.wte.weight", (m.vocab, h))
    _one(pieces, shapes, "embed.pos.weight", "transformer.wpe.weight", (m.seq_len, h))
    if not m.tied_embeddings:
        _one(pieces, shapes, "head.weight", "lm_head.weight", (m.vocab, h))
    norms = [("final_norm", "transformer.ln_f")]
    linears = []  # (ours, theirs, in, out): Conv1D weights are [in, out]
    for i in range(m.layers):
        ours, hf = f"layers.{i}.", f"transformer.h.{i}."
        norms += [(ours + "attn_norm", hf + "ln_1"), (ours + "mlp_norm", hf + "ln_2")]
        linears += [(ours + "attn.qkv", hf + "attn.c_attn", h, 3 * h), (ours + "attn.proj", hf + "attn.c_proj", h, h),
                    (ours + "mlp.fc1", hf + "mlp.c_fc", h, f), (ours + "mlp.fc2", hf + "mlp.c_proj", f, h)]
    # GPT-2 always has these biases: a model without them exports zeros (the shapes below, no piece)
    for ours, hf in norms:
        _one(pieces, shapes, ours + ".weight", hf + ".weight", (h,))
        shapes[hf + ".bias"] = (h,)
        if m.bias:
            _one(pieces, shapes, ours + ".bias", hf + ".bias", (h,))
    for ours, hf, n_in, n_out in linears:
        _one(pieces, shapes, ours + ".weight", hf + ".weight", (n_in, n_out), transposed=True)
        shapes[hf + ".bias"] = (n_out,)
        if m.bias:
            _one(pieces, shapes, ours + ".bias", hf + ".bias", (n_out,))


# --- config.json ------------------------------------------------------------------------------------


ZERO_BIASES = "trainctl_zero_biases"  # config.json key of a GPT-2 export of a model without biases


def config(m: ModelShape) -> dict[str, Any]:
    """config.json of the transformers class that matches `m` (fp32 weights, as the checkpoint holds them)."""
    fam = family(m)
    common: dict[str, Any] = {"architectures": [ARCHITECTURES[fam]], "model_type": fam, "vocab_size": m.vocab,
                              "tie_word_embeddings": m.tied_embeddings, "initializer_range": m.init_std,
                              "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": None}
    if fam == "gpt2":
        return {**common, "n_embd": m.hidden, "n_layer": m.layers, "n_head": m.heads, "n_inner": m.ffn_hidden,
                "n_positions": m.seq_len, "activation_function": GELU_TANH[0], "layer_norm_epsilon": m.norm_eps,
                "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout,
                # GPT-2 files always hold biases; ours are zeros when the model has none, and saying so lets
                # init_from read the export back into the same bias-free spec (transformers keeps unknown keys)
                **({} if m.bias else {ZERO_BIASES: True})}
    out = {**common, "hidden_size": m.hidden, "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
           "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim, "intermediate_size": m.ffn_hidden,
           "hidden_act": "silu", "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps,
           # rope_parameters is transformers 5's spelling, rope_theta the 4.x one
           "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
           "attention_dropout": m.dropout, "attention_bias": m.bias, "mlp_bias": m.bias}
    if fam == "mixtral":
        assert m.moe is not None
        out.update(intermediate_size=m.moe.expert_ffn_hidden, num_local_experts=m.moe.num_experts,
                   num_experts_per_tok=m.moe.top_k, router_jitter_noise=0.0, output_router_logits=False,
                   router_aux_loss_coef=m.moe.aux_loss_coeff, sliding_window=None)
    return out


def config_shape(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(family, the spec's model fields that fix the weights' shapes) of a transformers config.json; UsageError
    for a class trainctl does not map."""
    kind = cfg.get("model_type")
    if kind == "gpt2":
        act = cfg.get("activation_function", GELU_TANH[0])
        if act not in GELU_TANH:
            raise UsageError(f"GPT-2 config.json: activation_function {act!r} is not the tanh GELU the trainer runs",
                             hint=f"the trainer's gelu is transformers' {' or '.join(GELU_TANH)}")
        h = cfg["n_embd"]
        return "gpt2", {"layers": cfg["n_layer"], "hidden": h, "heads": cfg["n_head"], "kv_heads": cfg["n_head"],
                        "ffn_hidden": cfg.get("n_inner") or 4 * h, "vocab": cfg["vocab_size"], "norm": "layernorm",
                        "position": "learned", "activation": "gelu", "bias": not cfg.get(ZERO_BIASES, False),
                        "tied_embeddings": cfg.get("tie_word_embeddings", True)}
    if kind in ("llama", "mixtral"):
        if cfg.get("hidden_act", "silu") != "silu":
            raise UsageError(f"{kind} config.json: hidden_act {cfg.get('hidden_act')!r} is not silu (SwiGLU)")
        heads = cfg["num_attention_heads"]
        h = cfg["hidden_size"]
        if cfg.get("head_dim") not in (None, h // heads):
            raise UsageError(f"{kind} config.json: head_dim {cfg['head_dim']} is not hidden_size / "
                             f"num_attention_heads = {h // heads}, which the trainer's attention assumes")
        bias = bool(cfg.get("attention_bias", False))
        if bool(cfg.get("mlp_bias", False)) != bias:
            raise UsageError(f"{kind} config.json: attention_bias {bias} with mlp_bias {cfg.get('mlp_bias')}: the "
                             "trainer's model.bias sets both")
        shape = {"layers": cfg["num_hidden_layers"], "hidden": h, "heads": heads,
                 "kv_heads": cfg.get("num_key_value_heads") or heads, "vocab": cfg["vocab_size"],
                 "norm": "rmsnorm", "position": "rope", "activation": "swiglu", "bias": bias,
                 "tied_embeddings": cfg.get("tie_word_embeddings", False)}
        if kind == "mixtral":
            shape["moe"] = {"num_experts": cfg["num_local_experts"], "top_k": cfg.get("num_experts_per_tok", 2),
                            "expert_ffn_hidden": cfg["intermediate_size"], "shared_experts": 0, "every": 1,
                            "first_dense": 0, "router": "topk_softmax"}
        else:
            shape["ffn_hidden"] = cfg["intermediate_size"]
        return kind, shape
    raise UsageError(f"config.json: model_type {kind!r} is not one trainctl maps",
                     hint="llama, mixtral or gpt2 (docs/design/checkpoints.md, \"Hugging Face weights\")")


def positions_rows(cfg: dict[str, Any]) -> int | None:
    """Rows of a GPT-2 config's learned position table (a run may use its first seq_len); None for RoPE."""
    return cfg.get("n_positions") if cfg.get("model_type") == "gpt2" else None

"""Model presets: published architectures a spec can name with `model: {preset: NAME}`.

Each preset is a plain dict of ModelSpec fields; fields given next to `preset` override it.
"""

from __future__ import annotations

from typing import Any

_LLAMA3 = {
    "activation": "swiglu",
    "norm": "rmsnorm",
    "position": "rope",
    "rope_theta": 500000.0,
    "tied_embeddings": False,
    "bias": False,
    "vocab": 128256,
    "seq_len": 8192,
}
_GPT = {
    "activation": "gelu",
    "norm": "layernorm",
    "position": "learned",
    "tied_embeddings": True,
    "bias": True,
}

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Tiny model for CPU quickstart and tests (byte-level vocabulary).
    "tiny": {**_GPT, "layers": 4, "hidden": 64, "heads": 4, "ffn_hidden": 256, "vocab": 256,
             "seq_len": 64, "bias": False},
    # The Llama 3 architecture at CPU size: RMSNorm, RoPE, SwiGLU (ffn ~ 8h/3), grouped-query attention,
    # untied head, no biases; byte-level vocabulary.
    "tiny-llama": {**_LLAMA3, "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 176,
                   "vocab": 256, "seq_len": 64, "rope_theta": 10000.0},
    # Radford et al. 2019 (GPT-2), smallest model; HF config n_layer=12, n_embd=768, n_head=12.
    "gpt2-124m": {**_GPT, "layers": 12, "hidden": 768, "heads": 12, "ffn_hidden": 3072, "vocab": 50257,
                  "seq_len": 1024},
    # Brown et al. 2020 (GPT-3), Table 2.1: 96 layers, d_model 12288, 96 heads, context 2048.
    "gpt3-175b": {**_GPT, "layers": 96, "hidden": 12288, "heads": 96, "ffn_hidden": 49152,
                  "vocab": 51200, "seq_len": 2048},
    # Llama 3 herd paper (Dubey et al. 2024), Table 3.
    "llama3-8b": {**_LLAMA3, "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8,
                  "ffn_hidden": 14336},
    "llama3-70b": {**_LLAMA3, "layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8,
                   "ffn_hidden": 28672},
    "llama3-405b": {**_LLAMA3, "layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8,
                    "ffn_hidden": 53248},
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", Table 1; HF mistralai/Mixtral-8x7B-v0.1
    # config.json): Mistral 7B's attention (32 layers, dim 4096, 32 heads, 8 KV heads), every layer's MLP
    # 8 SwiGLU experts of 14336, top-2, softmax over the top-2 logits; vocab 32000, rope_theta 1e6,
    # context 32768 (trained here at 4096). 46.7B parameters, 12.9B active.
    "mixtral-8x7b": {**_LLAMA3, "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn_hidden": 14336,
                     "vocab": 32000, "seq_len": 4096, "rope_theta": 1000000.0,
                     "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_hidden": 14336, "router": "topk_softmax",
                             "aux_loss_coeff": 0.02}},
    # OLMoE-1B-7B (Muennighoff et al. 2024, "OLMoE: Open Mixture-of-Experts Language Models", Table 1/14;
    # HF allenai/OLMoE-1B-7B-0924 config.json): 16 layers, dim 2048, 16 heads, 64 SwiGLU experts of 1024,
    # top-8, softmax over all experts then top-8 without renormalisation (norm_topk_prob false), aux loss
    # 0.01, router z-loss 0.001; vocab 50304, untied, sequence 4096. 6.9B parameters, 1.3B active. (Its
    # QK-norm, 2 x 2048 weights per layer, is not in this model family: 65,536 parameters fewer.)
    "olmoe-1b-7b": {**_LLAMA3, "layers": 16, "hidden": 2048, "heads": 16, "ffn_hidden": 1024, "vocab": 50304,
                    "seq_len": 4096, "rope_theta": 10000.0,
                    "moe": {"num_experts": 64, "top_k": 8, "expert_ffn_hidden": 1024, "router": "softmax_topk",
                            "aux_loss_coeff": 0.01, "z_loss_coeff": 0.001}},
    # A tiny mixture of experts for the CPU: tiny-llama with 4 SwiGLU experts of 96, top-2, one shared expert.
    "tiny-moe": {**_LLAMA3, "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 176,
                 "vocab": 256, "seq_len": 64, "rope_theta": 10000.0,
                 "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden": 96, "shared_experts": 1,
                         "router": "topk_softmax", "aux_loss_coeff": 0.01}},
}

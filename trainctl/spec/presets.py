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
}

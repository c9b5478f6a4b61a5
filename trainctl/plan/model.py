"""Model arithmetic: parameter counts and FLOPs per token, from the model's shape alone.

Conventions (design.md, "MFU"):
- N, the *matmul* parameter count, counts every weight that takes part in a matrix multiply,
  including the output projection (LM head) even when it is tied to the embedding, and excludes the
  embedding lookup and position embeddings (a lookup is not a matmul).
- Model FLOPs per token = 6*N + 12*L*h*s (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, App. B:
  6N + 12*L*H*Q*T): 2 FLOPs per weight per token forward, twice that backward; the attention
  scores QK^T and the weighted sum A*V cost 2*s*h each forward per token per layer, 3x with backward;
  causal masking is *not* halved and recompute is *not* counted.
- Hardware FLOPs add what the job really computes on top: the padded vocabulary (spec.padded_vocab) and
  the recomputed forward passes (see `recompute_flops_per_token`).

Everything here is plain integer arithmetic on a light dataclass, so the `--auto` search can call it
for thousands of layouts without building pydantic models.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.spec.models import ModelSpec


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a ModelSpec the planner needs (kv_heads/ffn defaults already resolved)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    swiglu: bool = False
    layernorm: bool = True  # LayerNorm has weight and bias (2h); RMSNorm only a weight (h)
    learned_pos: bool = True  # learned position embeddings (s*h parameters); RoPE has none
    tied: bool = True  # LM head shares the embedding matrix
    bias: bool = False  # linear layers carry biases
    dropout: bool = False  # dropout > 0: the masks are stored for backward (Korthikanti et al. 2022)

    @classmethod
    def from_spec(cls, m: ModelSpec) -> ModelShape:
        return cls(
            layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads or m.heads,
            ffn=m.ffn_hidden or 4 * m.hidden, vocab=m.vocab, seq=m.seq_len,
            swiglu=m.activation == "swiglu", layernorm=m.norm == "layernorm",
            learned_pos=m.position == "learned", tied=m.tied_embeddings, bias=m.bias,
            dropout=m.dropout > 0,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        """Width of the K (and of the V) projection: kv_heads * head_dim (= hidden without GQA)."""
        return self.kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        """SwiGLU has gate, up and down projections; GELU has up and down."""
        return 3 if self.swiglu else 2


# --- parameters ------------------------------------------------------------------------------------


def layer_matmul_params(m: ModelShape) -> int:
    """Matmul weights of one transformer layer: Q and O (h x h), K and V (h x kv_width), the MLP.

    `trainctl.plan.pipeline.layer_params` is this count for a ModelSpec."""
    h = m.hidden
    return h * h + 2 * h * m.kv_width + h * h + m.mlp_matrices * h * m.ffn


def embedding_cost(m: ModelShape) -> float:
    """The embedding / LM head (V*h weights, and 2*V*h FLOPs per token for the head) in units of one
    layer's matmul weights: the extra load the first and last pipeline stage carry."""
    return m.vocab * m.hidden / layer_matmul_params(m)


def layer_norm_params(m: ModelShape) -> int:
    """Two norms per layer (before attention, before the MLP); replicated over TP ranks."""
    return 2 * (2 if m.layernorm else 1) * m.hidden


def layer_bias_params(m: ModelShape) -> tuple[int, int]:
    """(split over TP, replicated over TP) bias parameters of one layer.

    Column-parallel layers (QKV, MLP up/gate) split their bias with the output columns; row-parallel
    layers (attention output, MLP down) add their bias after the all-reduce, so every TP rank holds it."""
    if not m.bias:
        return 0, 0
    h = m.hidden
    split = (h + 2 * m.kv_width) + (m.mlp_matrices - 1) * m.ffn
    replicated = h + h
    return split, replicated


def final_norm_params(m: ModelShape) -> int:
    return (2 if m.layernorm else 1) * m.hidden


@dataclass(frozen=True)
class ParamCounts:
    matmul: int  # N of the MFU convention: layer matmuls + LM head (even when tied)
    layers_matmul: int  # matmul weights of the transformer layers only
    embedding: int  # token embedding V*h (the lookup; also the LM head when tied)
    lm_head: int  # V*h: the output projection's weight (shared with the embedding when tied)
    position: int  # learned position embeddings s*h (0 with RoPE)
    norms: int  # every norm weight/bias, final norm included
    biases: int  # every linear bias
    total: int  # unique trainable parameters: what a checkpoint holds


def param_counts(m: ModelShape, vocab: int | None = None) -> ParamCounts:
    """Parameter counts of the whole model (unpadded vocabulary unless `vocab` is given)."""
    v = m.vocab if vocab is None else vocab
    h, L = m.hidden, m.layers
    layers_mm = L * layer_matmul_params(m)
    emb = v * h
    pos = m.seq * h if m.learned_pos else 0
    norms = L * layer_norm_params(m) + final_norm_params(m)
    biases = L * sum(layer_bias_params(m))
    untied_head = 0 if m.tied else emb
    return ParamCounts(
        matmul=layers_mm + emb, layers_matmul=layers_mm, embedding=emb, lm_head=emb, position=pos,
        norms=norms, biases=biases, total=layers_mm + emb + untied_head + pos + norms + biases,
    )


def layer_params_per_gpu(m: ModelShape, tp: int) -> float:
    """Parameters of one transformer layer held by one TP rank (matmuls and split biases / tp)."""
    split, replicated = layer_bias_params(m)
    return (layer_matmul_params(m) + split) / tp + replicated + layer_norm_params(m)


def stage_params_per_gpu(m: ModelShape, tp: int, padded_vocab: int, layers: int, first: bool, last: bool) -> float:
    """Parameters one GPU holds for `layers` transformer layers plus the ends it owns.

    The embedding is vocab-parallel (padded_vocab*h/tp per rank) on the first stage, with the learned
    position embedding replicated. The LM head is on the last stage; with tied embeddings and pp > 1 the
    last stage holds its own copy of the embedding matrix and the two copies' gradients are summed
    every step (Megatron's "embedding group"); when one stage is both first and last (pp = 1) there is
    one copy."""
    out = layers * layer_params_per_gpu(m, tp)
    vocab_shard = padded_vocab * m.hidden / tp
    if first:
        out += vocab_shard + (m.seq * m.hidden if m.learned_pos else 0)
    if last:
        out += final_norm_params(m)
        if not m.tied or not first:
            out += vocab_shard
    return out


# --- FLOPs -----------------------------------------------------------------------------------------


def model_flops_per_token(matmul_params: float, layers: int, attn_width: int, seq: int) -> float:
    """6*N + 12*L*(H*Q)*T: PaLM (Chowdhery et al. 2022, App. B) and design.md's MFU convention.

    attn_width is heads*head_dim (= hidden in this model family); seq is the sequence length."""
    return 6 * matmul_params + 12 * layers * attn_width * seq


def model_flops_per_token_of(m: ModelShape) -> float:
    """The MFU numerator per token for this model (unpadded vocabulary)."""
    return model_flops_per_token(param_counts(m).matmul, m.layers, m.heads * m.head_dim, m.seq)


def layer_flops_per_token(m: ModelShape, recompute: str) -> float:
    """Hardware FLOPs of one transformer layer per token, forward + backward + recompute.

    - none: 6 per matmul weight + 12*s*h for QK^T and A*V (2*s*h each forward, x3 with backward).
    - selective (Korthikanti et al. 2022, Sec. 4.2 / 5): the attention core (QK^T, softmax, dropout,
      A*V) is recomputed in backward: one more forward of QK^T and A*V = 4*s*h per token.
    - full: the whole layer's forward again = 2 per matmul weight + 4*s*h. The LM head is not
      recomputed (Narayanan et al. 2021, eq. for F: 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))).
    """
    attn = m.heads * m.head_dim * m.seq
    base = 6 * layer_matmul_params(m) + 12 * attn
    if recompute == "full":
        return base + 2 * layer_matmul_params(m) + 4 * attn
    if recompute == "selective":
        return base + 4 * attn
    return base


def head_flops_per_token(m: ModelShape, vocab: int) -> float:
    """LM head (output projection) forward + backward per token; the loss itself is negligible."""
    return 6 * vocab * m.hidden


def hardware_flops_per_token(m: ModelShape, recompute: str, vocab: int | None = None) -> float:
    """Everything the GPUs compute per token, with recompute and the (padded) vocabulary."""
    v = m.vocab if vocab is None else vocab
    return m.layers * layer_flops_per_token(m, recompute) + head_flops_per_token(m, v)

"""The model's shape and everything derived from it: parameter counts by kind, matmul N, FLOPs per token.

One owner for these facts: the planner, the MFU meter and the trainer's model builder all read this module,
so the parameter count a plan predicts is the count the trainer builds (a test builds every recipe on the
meta device and compares). Torch-free plain integer arithmetic on a light dataclass, so the `--auto` search
can call it for thousands of layouts without building pydantic models.

Conventions (docs/design/memory.md, "MFU convention"):
- N, the *matmul* parameter count, counts every weight that takes part in a matrix multiply, including the
  output projection (LM head) even when it is tied to the embedding, and excludes the embedding lookup and
  position embeddings (a lookup is not a matmul).
- Model FLOPs per token = 6*N + 12*L*h*s (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, App. B:
  6N + 12*L*H*Q*T): 2 FLOPs per weight per token forward, twice that backward; the attention scores QK^T
  and the weighted sum A*V cost 2*s*h each forward per token per layer, 3x with backward; causal masking
  is *not* halved and recompute is *not* counted.
- Hardware FLOPs add what the job really computes on top: the padded vocabulary and the recomputed
  forward passes (see `layer_flops_per_token`).
- Mixture of experts (`MoEShape`): N counts the *active* matmul weights of a token: attention, the router
  gate (h x E per MoE layer), top_k routed experts and the shared experts (and dense layers' MLPs), so
  model FLOPs per token = 6*N_active + 12*L*h*s. `ParamCounts.total` counts every expert; `active` is
  the per-token active parameters (embeddings included), the figure papers quote (Mixtral 8x7B 12.9B of
  46.7B; OLMoE-1B-7B 1.3B of 6.9B).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainctl.spec.models import ModelSpec


def default_ffn_hidden(hidden: int, activation: str) -> int:
    """MLP inner size when the spec gives none: 4*hidden (GPT-2), or for SwiGLU the Llama rule
    2/3 * 4*hidden rounded up to a multiple of 256 (same FLOPs as the GELU MLP with three matrices)."""
    if activation == "swiglu":
        ffn = int(2 * 4 * hidden / 3)
        return 256 * ((ffn + 255) // 256)
    return 4 * hidden


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp so each TP shard of the embedding is even.

    The trainer masks the padded logits out of the softmax, so the loss is the same for every tp
    (Megatron pads to 128*tp without masking, which changes the model with the layout)."""
    return tp * ((vocab + tp - 1) // tp)


@dataclass(frozen=True)
class MoEShape:
    """Mixture-of-experts MLPs (the `model.moe` section; field names are the spec's)."""

    num_experts: int
    top_k: int
    expert_ffn_hidden: int
    shared_experts: int = 0  # built as one MLP of shared_experts * shared_ffn_hidden (DeepSeek-MoE's)
    shared_ffn_hidden: int | None = None  # None: = expert_ffn_hidden
    every: int = 1  # layer i is MoE when i >= first_dense and i % every == 0 (DeepSeek's rule)
    first_dense: int = 0
    router: str = "topk_softmax"  # topk_softmax (Mixtral) | softmax_topk (OLMoE, Qwen-MoE)
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coeff: float = 0.0  # load-balancing loss coefficient (the trainer's; no FLOPs or parameters)
    z_loss_coeff: float | None = None  # router z-loss coefficient; None: off

    def __post_init__(self) -> None:
        if self.shared_ffn_hidden is None:
            object.__setattr__(self, "shared_ffn_hidden", self.expert_ffn_hidden)

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_dense and i % self.every == 0

    def moe_layers_in(self, start: int, stop: int) -> int:
        """MoE layers among layers start..stop-1."""
        return sum(self.is_moe_layer(i) for i in range(start, stop))


@dataclass(frozen=True)
class ModelShape:
    """The architecture, layout-free. Field names are the spec's (`model:` section)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    kv_heads: int | None = None  # None: = heads (no grouped-query attention)
    ffn_hidden: int | None = None  # None: default_ffn_hidden
    activation: str = "gelu"  # gelu | swiglu
    norm: str = "layernorm"  # layernorm | rmsnorm
    position: str = "learned"  # learned | rope
    rope_theta: float = 10000.0
    tied_embeddings: bool = True
    bias: bool = False  # linear layers (and LayerNorm) carry biases
    dropout: float = 0.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    fp32_residual: bool = False  # the residual stream in fp32 under 16-bit compute (else the compute dtype)
    moe: MoEShape | None = None  # None: dense

    def __post_init__(self) -> None:
        # frozen: fill the derived defaults once, from the same rules the spec uses
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", default_ffn_hidden(self.hidden, self.activation))

    @classmethod
    def from_spec(cls, m: ModelSpec) -> ModelShape:
        names = {f.name for f in fields(cls)}
        data = {k: v for k, v in m.model_dump().items() if k in names}
        if data.get("moe") is not None:
            moe_names = {f.name for f in fields(MoEShape)}
            data["moe"] = MoEShape(**{k: v for k, v in data["moe"].items() if k in moe_names})
        return cls(**data)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        """Width of the K (and of the V) projection: kv_heads * head_dim (= hidden without GQA)."""
        return self.kv_heads * self.head_dim

    @property
    def swiglu(self) -> bool:
        return self.activation == "swiglu"

    @property
    def mlp_matrices(self) -> int:
        """SwiGLU has gate, up and down projections; GELU has up and down."""
        return 3 if self.swiglu else 2

    @property
    def learned_pos(self) -> bool:
        """Learned position embeddings (seq_len*hidden parameters); RoPE has none."""
        return self.position == "learned"

    @property
    def norm_has_bias(self) -> bool:
        """A LayerNorm carries a bias only with `bias: true` (GPT-2); RMSNorm never has one."""
        return self.norm == "layernorm" and self.bias

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: the weight (h), plus the bias (h) when it has one."""
        return (2 if self.norm_has_bias else 1) * self.hidden

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab(self.vocab, tp)

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (0 for a dense model)."""
        return 0 if self.moe is None else self.moe.moe_layers_in(0, self.layers)

    def moe_layers_in(self, start: int, stop: int) -> int:
        return 0 if self.moe is None else self.moe.moe_layers_in(start, stop)


# --- parameters ------------------------------------------------------------------------------------


def attention_matmul_params(m: ModelShape) -> int:
    """Q and O (h x h), K and V (h x kv_width)."""
    h = m.hidden
    return 2 * h * h + 2 * h * m.kv_width


def mlp_matmul_params(m: ModelShape, ffn: int) -> int:
    """One MLP (dense, one expert or one shared expert) of inner size `ffn`."""
    return m.mlp_matrices * m.hidden * ffn


def layer_matmul_params(m: ModelShape) -> int:
    """Matmul weights of one *dense* transformer layer: Q and O (h x h), K and V (h x kv_width), the MLP."""
    return attention_matmul_params(m) + mlp_matmul_params(m, m.ffn_hidden)


@dataclass(frozen=True)
class MoELayerParams:
    """Matmul weights of one MoE layer's MLP part, by kind (attention not included)."""

    router: int  # the gate, h x E (replicated over TP and EP)
    experts: int  # all routed experts, E x one expert MLP (split over EP and TP)
    experts_active: int  # the top_k experts one token passes through
    shared: int  # the shared experts (split over TP like a dense MLP)


def moe_layer_params(m: ModelShape) -> MoELayerParams:
    e = m.moe
    if e is None:
        return MoELayerParams(router=0, experts=0, experts_active=0, shared=0)
    one = mlp_matmul_params(m, e.expert_ffn_hidden)
    return MoELayerParams(router=m.hidden * e.num_experts, experts=e.num_experts * one, experts_active=e.top_k * one,
                          shared=e.shared_experts * mlp_matmul_params(m, e.shared_ffn_hidden or 0))


def active_layer_matmul_params(m: ModelShape) -> float:
    """Matmul weights one token passes through, per layer on average over the model's layers: attention, and
    the dense MLP or the router + top_k experts + shared experts. Equal to layer_matmul_params when dense."""
    if m.moe is None:
        return layer_matmul_params(m)
    p = moe_layer_params(m)
    moe_mlp = p.router + p.experts_active + p.shared
    dense_mlp = mlp_matmul_params(m, m.ffn_hidden)
    n = m.moe_layers
    return attention_matmul_params(m) + (n * moe_mlp + (m.layers - n) * dense_mlp) / m.layers


def expert_bias_params(m: ModelShape) -> tuple[int, int]:
    """(split over TP, replicated over TP) bias parameters of one routed expert (with `bias: true`)."""
    if not m.bias or m.moe is None:
        return 0, 0
    return (m.mlp_matrices - 1) * m.moe.expert_ffn_hidden, m.hidden


def embedding_cost(m: ModelShape) -> float:
    """The embedding / LM head (V*h weights, and 2*V*h FLOPs per token for the head) in units of one
    layer's (active) matmul weights: the extra load the first and last pipeline stage carry."""
    return m.vocab * m.hidden / active_layer_matmul_params(m)


def layer_norm_params(m: ModelShape) -> int:
    """Two norms per layer (before attention, before the MLP); replicated over TP ranks."""
    return 2 * m.norm_params


def layer_bias_params(m: ModelShape, moe: bool = False) -> tuple[int, int]:
    """(split over TP, replicated over TP) linear-bias parameters of one layer (an MoE layer: its
    attention and shared experts; the routed experts' biases are `expert_bias_params`, the router has none).

    Column-parallel layers (QKV, MLP up/gate) split their bias with the output columns; row-parallel
    layers (attention output, MLP down) add their bias after the all-reduce, so every TP rank holds it."""
    if not m.bias:
        return 0, 0
    h = m.hidden
    if moe and m.moe is not None:  # the shared experts are one MLP of shared_experts x shared_ffn_hidden
        shared = m.moe.shared_experts
        split = (h + 2 * m.kv_width) + shared * (m.mlp_matrices - 1) * (m.moe.shared_ffn_hidden or 0)
        return split, h + (h if shared else 0)
    split = (h + 2 * m.kv_width) + (m.mlp_matrices - 1) * m.ffn_hidden
    replicated = h + h
    return split, replicated


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the whole model by kind; `total` is what a checkpoint holds."""

    matmul: int  # N of the MFU convention: *active* layer matmuls + LM head (even when tied)
    layers_matmul: int  # matmul weights of the transformer layers only (every expert)
    embedding: int  # token embedding V*h (the lookup; also the LM head when tied)
    lm_head: int  # V*h: the output projection's weight (shared with the embedding when tied)
    position: int  # learned position embeddings s*h (0 with RoPE)
    norms: int  # every norm weight/bias, final norm included
    biases: int  # every linear bias
    total: int  # unique trainable parameters (a tied embedding once)
    # mixture of experts (0 for a dense model); all counted in layers_matmul / biases / total above
    router: int = 0  # router gates, h x E per MoE layer
    experts: int = 0  # routed expert weights (and their biases), every expert
    shared_experts: int = 0  # shared expert weights
    dense_mlp: int = 0  # MLP weights of the dense layers (every layer of a dense model)
    attention: int = 0  # attention matmul weights, every layer
    active: int = 0  # parameters one token uses: total less the routed experts it is not sent to

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def param_counts(m: ModelShape, vocab: int | None = None) -> ParamCounts:
    """Parameter counts of the whole model (unpadded vocabulary unless `vocab` is given)."""
    v = m.vocab if vocab is None else vocab
    h, L = m.hidden, m.layers
    n_moe = m.moe_layers
    mp = moe_layer_params(m)
    attention = L * attention_matmul_params(m)
    dense_mlp = (L - n_moe) * mlp_matmul_params(m, m.ffn_hidden)
    e_split, e_repl = expert_bias_params(m)
    n_exp = m.moe.num_experts if m.moe else 0
    expert_biases = n_moe * n_exp * (e_split + e_repl)
    experts, router, shared = n_moe * mp.experts + expert_biases, n_moe * mp.router, n_moe * mp.shared
    layers_mm = attention + dense_mlp + n_moe * (mp.router + mp.experts + mp.shared)
    active_mm = attention + dense_mlp + n_moe * (mp.router + mp.experts_active + mp.shared)
    emb = v * h
    pos = m.seq_len * h if m.learned_pos else 0
    norms = L * layer_norm_params(m) + m.norm_params
    biases = (L - n_moe) * sum(layer_bias_params(m)) + n_moe * sum(layer_bias_params(m, moe=True)) + expert_biases
    untied_head = 0 if m.tied_embeddings else emb
    total = layers_mm + emb + untied_head + pos + norms + biases
    idle_experts = n_exp - m.moe.top_k if m.moe else 0  # routed experts a token is not sent to
    inactive = n_moe * (mp.experts - mp.experts_active) + n_moe * idle_experts * (e_split + e_repl)
    return ParamCounts(
        matmul=active_mm + m.vocab * h, layers_matmul=layers_mm, embedding=emb, lm_head=emb, position=pos,
        norms=norms, biases=biases, total=total, router=router, experts=experts, shared_experts=shared,
        dense_mlp=dense_mlp, attention=attention, active=total - inactive,
    )


def layer_params_per_gpu(m: ModelShape, tp: int) -> float:
    """Parameters of one dense transformer layer held by one TP rank (matmuls and split biases / tp)."""
    split, replicated = layer_bias_params(m)
    return (layer_matmul_params(m) + split) / tp + replicated + layer_norm_params(m)


def moe_layer_params_per_gpu(m: ModelShape, tp: int, ep: int) -> tuple[float, float]:
    """(non-expert, routed-expert) parameters of one MoE layer held by one GPU.

    Non-expert: attention and shared experts split over TP, norms and the router gate (h x E) replicated.
    Routed experts: num_experts/ep whole experts per EP rank, each split over TP (expert TP = tp, Megatron's
    default), the down projection's bias replicated over TP."""
    assert m.moe is not None
    p = moe_layer_params(m)
    split, replicated = layer_bias_params(m, moe=True)
    dense = (attention_matmul_params(m) + p.shared + split) / tp + replicated + layer_norm_params(m) + p.router
    e_split, e_repl = expert_bias_params(m)
    one_expert = (mlp_matmul_params(m, m.moe.expert_ffn_hidden) + e_split) / tp + e_repl
    return dense, m.moe.num_experts // ep * one_expert


def layers_params_per_gpu(m: ModelShape, tp: int, layers: int, moe_layers: int = 0, ep: int = 1
                          ) -> tuple[float, float]:
    """(non-expert, routed-expert) parameters of `layers` transformer layers, `moe_layers` of them MoE."""
    dense = (layers - moe_layers) * layer_params_per_gpu(m, tp)
    if not moe_layers:
        return dense, 0.0
    d, e = moe_layer_params_per_gpu(m, tp, ep)
    return dense + moe_layers * d, moe_layers * e


def stage_params_per_gpu(m: ModelShape, tp: int, layers: int, first: bool, last: bool, moe_layers: int = 0,
                         ep: int = 1) -> float:
    """Parameters one GPU holds for `layers` transformer layers plus the ends it owns.

    The embedding is vocab-parallel (padded_vocab*h/tp per rank) on the first stage, with the learned
    position embedding replicated. The LM head is on the last stage; with tied embeddings and the first
    and last stage in different modules the last stage holds its own copy of the embedding matrix and the
    two copies' gradients are summed every step (Megatron's "embedding group"); when one stage is both
    first and last there is one copy. `moe_layers` of the `layers` are MoE layers (experts split over ep)."""
    out = sum(layers_params_per_gpu(m, tp, layers, moe_layers, ep))
    vocab_shard = m.padded_vocab(tp) * m.hidden / tp
    if first:
        out += vocab_shard + (m.seq_len * m.hidden if m.learned_pos else 0)
    if last:
        out += m.norm_params
        if not m.tied_embeddings or not first:
            out += vocab_shard
    return out


def stage_matmul_params_per_gpu(m: ModelShape, tp: int, layers: int, last: bool, moe_layers: int = 0, ep: int = 1
                                ) -> float:
    """Matmul weights one GPU of a stage multiplies by: its layers' attention, MLP, shared and routed experts
    and the LM head; not the embedding (a lookup), norms, biases or the router (which runs in fp32). These are
    the weights autocast copies to 16 bits (plan/memory.py `autocast_copies`)."""
    dense = (layers - moe_layers) * layer_matmul_params(m) / tp
    moe = 0.0
    if moe_layers and m.moe is not None:
        p = moe_layer_params(m)
        routed = m.moe.num_experts // ep * mlp_matmul_params(m, m.moe.expert_ffn_hidden)
        moe = moe_layers * (attention_matmul_params(m) + p.shared + routed) / tp
    return dense + moe + (m.padded_vocab(tp) * m.hidden / tp if last else 0.0)


def largest_param_per_gpu(m: ModelShape, tp: int, layers: int, first: bool, last: bool) -> int:
    """Elements of the largest single parameter one GPU of a stage holds: the vocab-parallel embedding or LM
    head, the learned positions, or a layer's fused QKV or MLP up (+ gate) matrix. The trainer's ZeRO-2
    bucket buffers are sized by it (plan/memory.py `zero2_slot_numel`). Dense layers only: an MoE layer's
    routed experts are not counted."""
    h = m.hidden
    out = 0
    if layers:
        out = max((h + 2 * m.kv_width) * h, (m.mlp_matrices - 1) * m.ffn_hidden * h) // tp
    vocab_shard = m.padded_vocab(tp) * h // tp
    if first:
        out = max(out, vocab_shard, m.seq_len * h if m.learned_pos else 0)
    if last:  # the LM head, or its tied copy of the embedding
        out = max(out, vocab_shard)
    return out


# --- FLOPs -----------------------------------------------------------------------------------------


def model_flops_per_token(matmul_params: float, layers: int, attn_width: int, seq: int) -> float:
    """6*N + 12*L*(H*Q)*T: PaLM (Chowdhery et al. 2022, App. B).

    attn_width is heads*head_dim (= hidden in this model family); seq is the sequence length."""
    return 6 * matmul_params + 12 * layers * attn_width * seq


def model_flops_per_token_of(m: ModelShape) -> float:
    """The MFU numerator per token for this model (unpadded vocabulary)."""
    return model_flops_per_token(param_counts(m).matmul, m.layers, m.heads * m.head_dim, m.seq_len)


def layer_flops_per_token(m: ModelShape, recompute: str, expert_factor: float = 1.0,
                          gemm_speedup: float = 1.0) -> float:
    """Hardware FLOPs of one transformer layer per token, forward + backward + recompute; for an MoE model
    the mean over its layers of the *active* matmul weights (router, top_k experts, shared experts).
    `expert_factor` scales the routed experts' share: the planner's load-imbalance allowance (the busiest
    expert sets the pace) or the capacity factor's padding.

    - none: 6 per matmul weight + 12*s*h for QK^T and A*V (2*s*h each forward, x3 with backward).
    - selective (Korthikanti et al. 2022, Sec. 4.2 / 5): the attention core (QK^T, softmax, dropout,
      A*V) is recomputed in backward: one more forward of QK^T and A*V = 4*s*h per token.
    - full: the whole layer's forward again = 2 per matmul weight + 4*s*h. The LM head is not
      recomputed (Narayanan et al. 2021, eq. for F: 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))).

    `gemm_speedup` > 1 gives the FLOPs at the base rate that take as long: the linear layers' GEMMs (the matmul
    weights' terms) run that many times faster (FP8: the FP8 peak over the BF16 peak), the attention core and
    the router at the base rate (the router, fp32 and tiny, is counted with the linear layers)."""
    attn = m.heads * m.head_dim * m.seq_len
    n = active_layer_matmul_params(m)
    if m.moe is not None and expert_factor != 1.0:
        n += (expert_factor - 1) * moe_layer_params(m).experts_active * m.moe_layers / m.layers
    n /= gemm_speedup
    base = 6 * n + 12 * attn
    if recompute == "full":
        return base + 2 * n + 4 * attn
    if recompute == "selective":
        return base + 4 * attn
    return base


def attention_flops_per_pair(m: ModelShape) -> float:
    """FLOPs of one (query, key) pair of attention in one layer, forward + backward: QK^T and A*V are
    2*heads*head_dim each forward, x3 with backward (the 12*h*s per token of the MFU convention is this for
    every key of the sequence)."""
    return 12 * m.heads * m.head_dim


def causal_pairs_per_rank(seq_len: int, cp: int, balanced: bool = True) -> list[int]:
    """(query, key) pairs each CP rank computes under a causal mask, for one sequence of seq_len tokens.

    Balanced (what the trainer does; runtime/parallel/context_parallel.py): 2*cp chunks of c tokens, rank i holds chunks
    i and 2cp-1-i; chunk j's queries see the j whole chunks before it (j*c*c pairs) and the causal triangle of
    their own (c*(c+1)/2). A contiguous split instead gives rank k the k-th of cp chunks: the last rank does
    about (2*cp-1)/cp times the mean (k + 1/2 chunk-squares against a mean of cp/2)."""
    if balanced:
        c = seq_len // (2 * cp)
        own = c * (c + 1) // 2
        return [sum(j * c * c + own for j in (i, 2 * cp - 1 - i)) for i in range(cp)]
    c = seq_len // cp
    return [k * c * c + c * (c + 1) // 2 for k in range(cp)]


def head_flops_per_token(m: ModelShape, vocab: int) -> float:
    """LM head (output projection) forward + backward per token; the loss itself is negligible."""
    return 6 * vocab * m.hidden


def hardware_flops_per_token(m: ModelShape, recompute: str, vocab: int | None = None) -> float:
    """Everything the GPUs compute per token, with recompute and the (padded) vocabulary."""
    v = m.vocab if vocab is None else vocab
    return m.layers * layer_flops_per_token(m, recompute) + head_flops_per_token(m, v)

"""Pydantic models of the run spec.

Field-level rules (types, ranges, choices) live on the fields; rules that relate several sections
(world size, divisibility, NVLink domain) live in `trainctl.spec.rules` so each produces one message
naming the field, the value and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from trainctl.model_shape import default_ffn_hidden, padded_vocab
from trainctl.spec.presets import MODEL_PRESETS

# Upper bounds keep absurd numbers (1e30 layers) from reaching the arithmetic as overflow or hangs.
Count = Annotated[int, Field(ge=1, le=1_000_000)]
Size = Annotated[int, Field(ge=1, le=100_000_000)]
NonNegCount = Annotated[int, Field(ge=0, le=1_000_000_000)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
DEFAULT_GRACE_S = 300  # launcher.grace_s: Slurm's stop warning before a time limit, enough to save a checkpoint
# the planner's default allowance for a dropless router's load imbalance (estimate.moe_imbalance)
DEFAULT_MOE_IMBALANCE = 1.1
PositiveFloat = Annotated[float, Field(gt=0.0, le=1e9, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0.0, le=1e9, allow_inf_nan=False)]


TOKEN_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def token_count(value: object) -> object:
    """15T, 405B, 2M or 15e12 as an integer count; anything else is left for the int check to refuse."""
    if isinstance(value, str):
        text = value.strip().upper()
        scale = TOKEN_SUFFIXES.get(text[-1:], 1)
        number = text[:-1] if scale != 1 else text
        try:
            exact = float(number) * scale
        except ValueError:
            return value
        return int(exact) if exact == int(exact) else value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class Strict(BaseModel):
    """Unknown keys are errors: a typo must never be silently ignored."""

    # defer_build: a model's validator is built when first used, not when its class is defined. A spec is
    # validated by RunSpec's, so the sections without a default instance never build their own (about 45 ms
    # of every command that reads a spec)
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, defer_build=True)


class MoESpec(Strict):
    """Mixture-of-experts MLPs (absent: a dense model). The rules (spec/rules.py) relate it to the layout."""

    num_experts: Annotated[int, Field(ge=0, le=1_000_000)] = Field(
        0, description="Routed experts per MoE layer (Mixtral 8, OLMoE 64)")
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] = Field(
        2, description="Experts each token is routed to (Mixtral 2, OLMoE 8)")
    expert_ffn_hidden: Size | None = Field(None, description="Inner size of one expert's MLP; default model.ffn_hidden")
    shared_experts: Annotated[int, Field(ge=0, le=1_000)] = Field(
        0, description="Shared experts every token passes through (DeepSeek-MoE, Qwen-MoE); 0: none")
    shared_ffn_hidden: Size | None = Field(None, description="Inner size of one shared expert; default "
                                           "expert_ffn_hidden")
    every: Count = Field(1, description="Every n-th layer is an MoE layer (layer i when i % every == 0); 1: all")
    first_dense: Annotated[int, Field(ge=0, le=1_000_000)] = Field(
        0, description="The first k layers stay dense (DeepSeek's first_k_dense_replace)")
    router: Literal["topk_softmax", "softmax_topk"] = Field(
        "topk_softmax", description="topk_softmax: softmax over the top-k logits, renormalised (Mixtral); "
        "softmax_topk: softmax over all experts, then top-k, not renormalised (OLMoE, Qwen-MoE)")
    aux_loss_coeff: Annotated[float, Field(ge=0.0, le=1e3, allow_inf_nan=False)] = Field(
        0.01, description="Load-balancing loss coefficient, Switch/GShard form: E * sum_i f_i * P_i")
    z_loss_coeff: Annotated[float, Field(ge=0.0, le=1e3, allow_inf_nan=False)] | None = Field(
        None, description="Router z-loss coefficient (ST-MoE, Zoph et al. 2022); null: off")
    capacity_factor: Annotated[float, Field(le=1e6, allow_inf_nan=False)] | None = Field(
        None, description="Tokens an expert takes, as a multiple of the even share; null: dropless (default)")

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (0-based) is an MoE layer (trainctl.model_shape.MoEShape owns the same rule)."""
        return i >= self.first_dense and i % self.every == 0


class ModelSpec(Strict):
    preset: str | None = Field(None, description="A published architecture to start from, one of "
                               f"{', '.join(sorted(MODEL_PRESETS))}; fields given beside it override the preset's")
    layers: Count = Field(description="Transformer blocks")
    hidden: Size = Field(description="Model width: the size of the residual stream and the embeddings")
    heads: Count = Field(description="Attention heads (the query heads under grouped-query attention)")
    kv_heads: Count | None = Field(None, description="Grouped-query attention KV heads; default = heads")
    ffn_hidden: Size | None = Field(None, description="MLP inner size; default 4*hidden (GELU) or "
                                    "the Llama rule 2/3*4*hidden rounded up to 256 (SwiGLU)")
    vocab: Size = Field(description="Vocabulary size (token ids 0 to vocab-1); the embedding and LM head are "
                        "padded to a multiple of parallel.tp")
    seq_len: Size = Field(description="Tokens per training sequence (the context length)")
    activation: Literal["gelu", "swiglu"] = Field("gelu", description="MLP activation: gelu (GPT) or swiglu, "
                                                  "the gated SiLU of Llama")
    norm: Literal["layernorm", "rmsnorm"] = Field("layernorm", description="Normalisation layers: layernorm (GPT) "
                                                  "or rmsnorm (Llama)")
    position: Literal["learned", "rope"] = Field("learned", description="Position encoding: learned absolute "
                                                 "position embeddings (GPT) or rotary embeddings (rope, Llama)")
    rope_theta: PositiveFloat = Field(10000.0, description="Base of the rotary frequencies (position: rope); "
                                      "Llama 3 uses 500000")
    tied_embeddings: bool = Field(True, description="The LM head shares the input embedding's weights")
    bias: bool = Field(False, description="Biases in the attention and MLP linear layers (and the LayerNorms); "
                       "GPT-2 has them, Llama does not")
    dropout: Fraction = Field(0.0, description="Dropout probability on the attention weights and on the attention "
                              "and MLP outputs before each residual add")
    norm_eps: PositiveFloat = Field(1e-5, description="Epsilon of the normalisation layers")
    fp32_residual: bool = Field(False, description="Keep the residual stream in fp32 under bf16/fp16 compute "
                                "(Megatron's fp32_residual_connection): the norm inputs, a recomputed block's "
                                "input and the pipeline's messages take 4 bytes a value instead of 2, for a "
                                "slightly lower loss early in training; no effect in fp32")
    moe: MoESpec | None = Field(None, description="Mixture-of-experts MLPs; absent: dense")
    init_from: str | None = Field(None, description="Start from these weights instead of a random init: a Hugging "
                                  "Face directory (config.json + safetensors), a trainctl run directory (its newest "
                                  "valid checkpoint) or a checkpoint directory; resharded to this run's layout. A "
                                  "run that has a checkpoint of its own resumes from it instead")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            name = data["preset"]
            if not isinstance(name, str) or name not in MODEL_PRESETS:
                raise ValueError(
                    f"unknown preset {name!r}; choose one of {', '.join(sorted(MODEL_PRESETS))} "
                    "or give layers/hidden/heads/vocab/seq_len explicitly"
                )
            preset = MODEL_PRESETS[name]
            merged = {**preset, **data}
            if isinstance(preset.get("moe"), dict) and isinstance(data.get("moe"), dict):
                merged["moe"] = {**preset["moe"], **data["moe"]}  # model.moe.top_k=4 keeps the preset's experts
            data = merged
        return data

    @model_validator(mode="after")
    def _fill_defaults(self) -> ModelSpec:
        # frozen model: fill derived defaults through object.__setattr__ once, at validation.
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", default_ffn_hidden(self.hidden, self.activation))
        if self.moe is not None:
            if self.moe.expert_ffn_hidden is None:
                object.__setattr__(self.moe, "expert_ffn_hidden", self.ffn_hidden)
            if self.moe.shared_ffn_hidden is None:
                object.__setattr__(self.moe, "shared_ffn_hidden", self.moe.expert_ffn_hidden)
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class PowerSGDSpec(Strict):
    """PowerSGD (Vogels et al. 2019) of the data-parallel gradient all-reduce (runtime/parallel/powersgd.py). The bounds
    are spec rules (spec/rules.py), so a bad value gets a message with its fix."""

    rank: Annotated[int, Field(ge=-1_000_000, le=1_000_000)] = Field(
        4, description="Rank of each gradient matrix's approximation: an n x m matrix sends (n + m) * rank "
        "values instead of n * m")
    start_step: Annotated[int, Field(ge=-1_000_000, le=1_000_000_000)] = Field(
        10, description="First compressed step (1-based); the steps before it all-reduce uncompressed (warm-up)")


class GradCompressionSpec(Strict):
    powersgd: PowerSGDSpec | None = Field(None, description="Low-rank gradient compression with error feedback "
                                          "and warm start (plain DP and ZeRO-1)")


class ParallelSpec(Strict):
    tp: Count = Field(1, description="Tensor-parallel size: each layer's weight matrices are split over tp ranks "
                      "(Megatron-LM), within one NVLink domain unless allow_tp_across_nodes")
    cp: Count = Field(1, description="Context-parallel size: each sequence is split into 2*cp chunks and CP rank i "
                      "holds chunks i and 2*cp-1-i (balanced causal work); K/V are all-gathered over the CP group "
                      "(Megatron-Core order tp-cp-ep-dp-pp). Gradients are reduced, and ZeRO shards, over dp x cp")
    pp: Count = Field(1, description="Pipeline-parallel size: the layers are split into pp stages (more with "
                      "virtual_stages), each on its own ranks")
    dp: Count | Literal["auto"] = Field("auto", description="Data-parallel size; auto: the world size divided by "
                                        "tp x cp x pp")
    ep: Count = Field(1, description="Expert-parallel size: the routed experts are split over ep ranks carved from "
                      "the data-parallel group (Megatron-Core order tp-cp-ep-dp-pp); the expert weights' gradients "
                      "and optimizer state are then reduced/sharded over the expert-data-parallel group of dp/ep")
    virtual_stages: Count = Field(1, description="Model chunks per pipeline rank (interleaved 1F1B, zero-bubble; "
                                  "always 2 under zbv, its default there)")
    zero: Literal[0, 1, 2, 3] = Field(0, description="0 plain DP, 1 optimizer, 2 +grads, 3 +weights (FSDP)")
    sequence_parallel: bool = Field(False, description="Megatron sequence parallelism: the norms, dropout and "
                                    "residual adds between the tensor-parallel regions work on a 1/tp slice of the "
                                    "sequence (less activation memory; reduce-scatter and all-gather instead of "
                                    "all-reduce)")
    micro_batch: Count = Field(1, description="Sequences per micro-batch on each data-parallel rank; "
                               "train.global_batch / (micro_batch x dp) micro-batches make one step")
    schedule: Literal["1f1b", "interleaved", "gpipe", "zero-bubble", "zbv"] = Field(
        "1f1b", description="Pipeline schedule; zero-bubble: interleaved zero-bubble (backward split into input- "
        "and weight-gradient parts, Qi et al. 2023), chunks placed as interleaved; zbv: ZB-V (Qi et al. 2023, "
        "Sec. 6), exactly 2 stages per rank placed in a V (rank r holds stages r and 2*pp-1-r, so rank 0 holds "
        "the embedding and the LM head); virtual_stages defaults to 2 with it")
    stage_layers: list[Annotated[int, Field(ge=0, le=1_000_000)]] | None = Field(
        None,
        description="Transformer layers on each of the pp*virtual_stages pipeline stages, first to "
        "last; default: even split, fewer on the first/last stage to balance embedding and LM head",
    )
    allow_tp_across_nodes: bool = Field(
        False, description="Permit a TP group larger than the NVLink domain (slow; normally an error)"
    )
    offload: Literal["none", "optimizer"] = Field(
        "none", description="optimizer: keep the fp32 master weights and AdamW moments in host memory and step "
        "them on the CPU (ZeRO-Offload; ZeRO-1/2: this rank's slice, ZeRO-3: FSDP2's CPU offload policy, which "
        "also keeps the weight and gradient shards there); needs zero 1, 2 or 3")
    grad_reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="Dtype of the data-parallel gradient reduction: bf16 halves its bytes; gradients "
        "still accumulate over micro-batches in fp32 on each rank")
    grad_compression: GradCompressionSpec | None = Field(
        None, description="Compress the data-parallel gradient reduction: {powersgd: {rank, start_step}}")

    @model_validator(mode="before")
    @classmethod
    def _zbv_stages(cls, data: Any) -> Any:
        # ZB-V always runs two stages per rank: left unset, virtual_stages is 2 (any other value is a spec rule)
        if isinstance(data, dict) and data.get("schedule") == "zbv" and data.get("virtual_stages") is None:
            data = {**data, "virtual_stages": 2}
        return data

    @property
    def powersgd(self) -> PowerSGDSpec | None:
        return self.grad_compression.powersgd if self.grad_compression is not None else None


class DivergenceSpec(Strict):
    """The divergence guard (runtime/train/divergence.py): what happens when the loss or the gradient norm is not a
    finite number. The bounds are spec rules (spec/rules.py), so a bad value gets a message with its fix."""

    max_consecutive_skips: Annotated[int, Field(ge=-1_000_000, le=1_000_000)] = Field(
        5, description="A step whose loss or global gradient norm is NaN/inf is skipped (no optimizer update, on "
        "every rank); after this many skipped steps in a row the run stops as diverged (exit 3), or rolls back")
    rollback: bool = Field(
        False, description="Instead of stopping: reload the last checkpoint before the skips began and skip the "
        "data window since it (PaLM, Chowdhery et al. 2022, sec. 5.1), at most max_rollbacks times")
    max_rollbacks: Annotated[int, Field(ge=-1_000, le=1_000)] = Field(
        2, description="Rollbacks a run may make before it stops as diverged (with rollback: true)")


class ProfileSpec(Strict):
    """torch.profiler traces of a window of steps (runtime/observe/profiling.py). The bounds against train.steps and the
    world size are spec rules (spec/rules.py), so a bad value gets a message with its fix."""

    start_step: Annotated[int, Field(ge=-1_000_000, le=1_000_000_000)] = Field(
        description="First profiled step (1-based, as metrics.jsonl counts them); a step after the first of an "
        "attempt leaves the warm-up out of the trace")
    steps: Annotated[int, Field(ge=-1_000_000, le=1_000_000)] = Field(
        2, description="Profiled steps from start_step on: one trace per selected rank covers all of them")
    ranks: list[Annotated[int, Field(ge=-1_000_000, le=1_000_000)]] = Field(
        default_factory=lambda: [0], description="Global ranks that write a trace (and, on GPU, a memory snapshot)")

    @property
    def last_step(self) -> int:
        return self.start_step + self.steps - 1


class StageSpec(Strict):
    """One stage of a staged run (train.stages): its token budget at its own batch, sequence length and context
    parallelism; what it leaves out is the spec's own. Only plan prices stages: the trainer runs one shape."""

    name: str = Field(min_length=1, max_length=64, description="The stage's name, as plan prints it")
    tokens: Annotated[int, BeforeValidator(token_count), Field(gt=0, le=10**17)] = Field(
        description="Tokens the stage trains on (252M, 2.87T): a multiple of its global_batch x seq_len")
    global_batch: Count | None = Field(None, description="Sequences per optimizer step in this stage; default "
                                       "train.global_batch")
    seq_len: Size | None = Field(None, description="Tokens per sequence in this stage; default model.seq_len")
    cp: Count | None = Field(None, description="Context parallelism in this stage; default parallel.cp (with dp, "
                             "to keep the world size)")
    dp: Count | None = Field(None, description="Data parallelism in this stage; default parallel.dp")
    micro_batch: Count | None = Field(None, description="Sequences per micro-batch in this stage; default "
                                      "parallel.micro_batch")
    nodes: Count | None = Field(None, description="Nodes the stage runs on, at most cluster.nodes (its tp x pp x "
                                "cp x dp fills them); default cluster.nodes. The plan counts a stage's GPU-hours "
                                "and failures on its own GPUs")
    recompute: Literal["none", "selective", "full"] | None = Field(
        None, description="Activation recomputation in this stage; default train.recompute")


class TrainSpec(Strict):
    global_batch: Count = Field(description="Sequences per optimizer step, across all DP ranks")
    # up to a billion: a 15T-token budget at 4M tokens per step is 3.6M steps
    steps: Annotated[int, Field(ge=1, le=1_000_000_000)] | None = Field(
        None, description="Optimizer steps to train for; give this or train.tokens (a run directory's frozen "
        "spec holds both: the steps its tokens imply)")
    tokens: Annotated[int, BeforeValidator(token_count), Field(gt=0, le=10**17)] | None = Field(
        None, description="Tokens to train on (15e12, 15T, 405B, 2M), instead of train.steps: the steps are "
        "tokens / (global_batch x model.seq_len), which must divide it")
    lr: PositiveFloat = Field(3e-4, description="Peak learning rate, reached at the end of the warm-up")
    min_lr: Annotated[float, Field(ge=0.0, le=1e9, allow_inf_nan=False)] | None = Field(
        None, description="Floor of the schedule; default lr/10"
    )
    lr_schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay from lr to min_lr over the steps after the warm-up; constant: stay at lr")
    warmup: NonNegCount = Field(0, description="Steps of linear warm-up from lr/warmup to lr")
    weight_decay: Annotated[float, Field(ge=0.0, le=10.0)] = Field(
        0.1, description="AdamW weight decay, on the weight matrices (linear and embedding) only, not on norms "
        "and biases")
    beta1: Fraction = Field(0.9, description="AdamW's decay rate of the gradient's running mean")
    beta2: Fraction = Field(0.95, description="AdamW's decay rate of the squared gradient's running mean")
    eps: PositiveFloat = Field(1e-8, description="AdamW's epsilon, added to the denominator")
    precision: Literal["bf16", "fp16", "fp32", "fp8"] = Field(
        "bf16", description="Compute precision: bf16 or fp16 autocast over fp32 master weights (fp16 with "
        "dynamic loss scaling), fp32 throughout, or fp8: the linear layers' GEMMs in FP8 with dynamic scales "
        "(train.fp8_recipe) and the rest in bf16 (GPUs with FP8 tensor cores; emulated on a CPU); on a CPU "
        "bf16, fp16 and fp8's non-FP8 parts compute in fp32 unless low_precision_on_cpu")
    fp8_recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise", description="FP8 scaling (train.precision fp8): tensorwise, one scale per tensor, e5m2 "
        "gradients (the fastest, torchtitan's default); rowwise, one scale per row (token, output channel), "
        "e4m3 throughout: more accurate with outlier rows, slower")
    low_precision_on_cpu: bool = Field(
        False, description="Run bf16/fp16 autocast on the CPU too instead of falling back to fp32 (slow on "
        "CPUs without bf16 matrix units; it exercises the mixed-precision path a GPU run takes)")
    deterministic: bool = Field(
        False, description="GPU: deterministic kernels only (torch.use_deterministic_algorithms, a fixed cuBLAS "
        "workspace), so a resumed run retraces the uninterrupted one bit for bit; slower, and an op without a "
        "deterministic kernel stops the run with its name. CPU runs are deterministic already")
    compile: bool = Field(
        False, description="torch.compile each transformer block: inductor fuses the norms, rotary, SwiGLU and "
        "residual adds into few kernels (GPU); the first step pays the compilation")
    compile_backend: Literal["inductor", "aot_eager"] = Field(
        "inductor", description="train.compile's backend: aot_eager traces the blocks as inductor does but runs "
        "PyTorch's own kernels (to tell a compiler problem from a tracing one; no speed-up)")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="Activation recomputation in the backward pass: selective recomputes the attention "
        "core, full each whole transformer block (least memory, one more forward of every block)")
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] = Field(
        1234, description="Random seed of the weight initialisation, dropout and the data order (the shuffle of "
        "token files, the synthetic tokens)")
    grad_clip: PositiveFloat | None = Field(1.0, description="Clip the global gradient norm to this value; null: "
                                            "no clipping")
    log_every: Count = Field(1, description="Write a metrics line (console and RUN/metrics.jsonl) every n steps, "
                             "and after the last step and every skipped one")
    watchdog_s: PositiveFloat | None = Field(
        600.0, description="Hang watchdog: a rank with no step progress this long dumps its stacks and exits; "
        "null disables (env TRAINCTL_WATCHDOG_S overrides)")
    divergence: DivergenceSpec = Field(DivergenceSpec(), description="Divergence guard: skip non-finite steps, "
                                       "stop (or roll back) after several in a row")
    profile: ProfileSpec | None = Field(None, description="torch.profiler Chrome/Perfetto traces of a window of "
                                        "steps on selected ranks (RUN/profile/); absent: no profiler")
    stages: list[StageSpec] | None = Field(
        None, min_length=1, max_length=64, description="The whole run as stages in order (a batch-size ramp, a "
        "long-context stage, annealing), each its tokens at its own shape: plan prices each stage's steps at its "
        "shape and sums them, and train.steps is their total; launch refuses it (the trainer runs one shape: give "
        "each stage its own spec)")

    @model_validator(mode="after")
    def _steps_or_tokens(self) -> TrainSpec:
        if self.steps is None and self.tokens is None and not self.stages:
            raise ValueError("give train.steps, train.tokens or train.stages (the steps are derived)")
        return self

    @property
    def compile_with(self) -> str | None:
        """The torch.compile backend the blocks run under; None: eager."""
        return self.compile_backend if self.compile else None


TokenFormat = Literal["auto", "flat", "megatron"]
TokenDtype = Literal["uint16", "uint32"]
# data.* and data.blend[].* describe a token file alike
TOKEN_FORMAT_DESCRIPTION = "auto: megatron when P.idx exists beside the path, else flat"
TOKEN_DTYPE_DESCRIPTION = "Token dtype of a flat file"


class DataSource(Strict):
    """One token source of a weighted blend (Megatron's `--data-path W1 P1 W2 P2`)."""

    path: str = Field(description="Token file, or a Megatron indexed-dataset prefix (P.bin + P.idx)")
    weight: PositiveFloat = Field(1.0, description="Share of the training sequences (normalised over the blend)")
    format: TokenFormat = Field("auto", description=TOKEN_FORMAT_DESCRIPTION)
    dtype: TokenDtype = Field("uint16", description=TOKEN_DTYPE_DESCRIPTION)


class DataSpec(Strict):
    path: str | None = Field(None, description="Token file (flat array of token ids, nanoGPT) or a Megatron "
                             "indexed-dataset prefix (P.bin + P.idx, dtype from the index)")
    format: TokenFormat = Field("auto", description=TOKEN_FORMAT_DESCRIPTION)
    dtype: TokenDtype = Field("uint16", description=TOKEN_DTYPE_DESCRIPTION)
    blend: list[DataSource] | None = Field(None, min_length=1, description="Weighted blend of token sources, "
                                           "instead of data.path")
    synthetic: bool = Field(False, description="Train on generated sequences (a short motif repeated, a function "
                            "of train.seed) instead of a token file: no data needed")

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        given = [name for name, on in (("data.path", self.path), ("data.blend", self.blend),
                                       ("data.synthetic: true", self.synthetic)) if on]
        if len(given) > 1:
            raise ValueError(f"give one data source: {' and '.join(given)}, not both")
        if not given:
            raise ValueError("no data source: set data.path to a token file, data.blend, or data.synthetic: true")
        return self

    def sources(self) -> list[DataSource]:
        """The token sources of the run: the blend, or data.path as a blend of one ([] when synthetic)."""
        if self.blend:
            return list(self.blend)
        if self.path:
            return [DataSource(path=self.path, format=self.format, dtype=self.dtype)]
        return []


class CheckpointSpec(Strict):
    dir: str | None = Field(None, description="Default: <run dir>/checkpoints")
    every_steps: Count | None = Field(None, description="Save at every multiple of n steps. With this or "
                                      "every_minutes set a run also saves after its last step; a stop (Ctrl-C, "
                                      "cancel, the time limit) saves either way")
    every_minutes: PositiveFloat | None = Field(None, description="Save when this many minutes have passed since "
                                                "the last save")
    keep_last: Count = Field(3, description="Checkpoints kept; older ones are deleted after each save (milestones "
                             "stay)")
    milestone_every: Count | None = Field(None, description="Also keep every N-th step forever")
    async_save: bool = Field(True, alias="async", description="Save in the background: training goes on once "
                             "the state is copied to host memory while the write runs; false: training waits for "
                             "the write")
    mtbf_hours: PositiveFloat | None = Field(None, description="The job's mean time between failures, for the "
                                             "Young/Daly checkpoint interval and the whole run that plan and "
                                             "mfu-report price; overrides failure_fleet")
    failure_fleet: Literal["llama3-h100", "opt175b-a100"] | None = Field(
        None, description="The published fleet whose interruption rate per GPU sets the job's MTBF (per-GPU MTBF / "
        "GPUs): llama3-h100 (419 in 54 days on 16,384 H100), opt175b-a100 (105 restarts in 2 months on 992 A100: "
        "35 manual, 70+ automatic); default the fleet of cluster.gpu's generation (A100: opt175b-a100, else "
        "llama3-h100)")


class ClusterSpec(Strict):
    nodes: Count = Field(1, description="Nodes the run uses")
    min_nodes: int | None = Field(None, description="Elastic: the fewest nodes the run may continue on after losing "
                                  "some (torchrun --nnodes=min_nodes:nodes, launcher.mode torchrun); default "
                                  "nodes (not elastic). The data-parallel size follows the nodes left and "
                                  "gradient accumulation keeps train.global_batch")
    gpus_per_node: Annotated[int, Field(ge=1, le=1024)] = Field(8, description="GPUs per node, one rank each "
                                                                "(with gpu: cpu, the ranks per node)")
    gpu: str = Field("h100-sxm", description="Accelerator, by its name in the catalog (`trainctl hardware`); cpu: "
                     "CPU ranks that communicate over gloo")
    peak_tflops: PositiveFloat | None = Field(None, description="Override the catalog's dense BF16 peak")
    memory_gb: PositiveFloat | None = Field(None, description="Override the catalog's device memory")
    nvlink_domain: Count | None = Field(None, description="GPUs per NVLink domain; default from catalog")
    host_memory_gb: PositiveFloat | None = Field(None, description="Host memory per node, GB (what optimizer "
                                                 "offload may fill); default 2,000 GB for GPU nodes (an 8-GPU "
                                                 "DGX H100/H200/B200 node), this machine's RAM for gpu: cpu")
    nvlink_gbps: PositiveFloat | None = Field(None, description="Override the catalog's NVLink bandwidth, GB/s "
                                              "per GPU and direction inside the NVLink domain")
    interconnect: str = Field("ndr", description="Inter-node fabric (see `trainctl hardware`)")
    inter_node_gbps: PositiveFloat | None = Field(None, description="Per-GPU inter-node GB/s override")
    partition: str | None = Field(None, description="Slurm --partition")
    account: str | None = Field(None, description="Slurm --account")
    qos: str | None = Field(None, description="Slurm --qos")
    time: str | None = Field(None, description="Slurm time limit, e.g. 12:00:00")
    constraint: str | None = Field(None, description="Slurm --constraint: node features the job needs")
    exclude: str | None = Field(None, description="Slurm --exclude: nodes never to run on; the nodes the run "
                                "keeps out itself (failed preflight or starts, stragglers) are added to it")
    exclude_stragglers: bool = Field(True, description="Slurm: keep a node out of the run's next job (trainctl resume, "
                                     "a requeue) when one of its ranks worked 1.5x as long as its pipeline stage's "
                                     "ranks on other nodes in 3 of 4 steps of the last start; never when the "
                                     "partition would keep fewer than cluster.nodes nodes (said instead)")
    mem: str | None = Field(None, description="Slurm --mem per node, e.g. 0 for all")
    cpus_per_task: Count | None = Field(None, description="Slurm: CPUs per rank (--cpus-per-task; in torchrun "
                                        "mode the node's one task gets this times gpus_per_node); default one per "
                                        "rank in torchrun mode, Slurm's default in srun mode")
    calibration: str | None = Field(None, description="Calibration profile from `trainctl calibrate` (JSON): the "
                                    "planner's times then come from its measured rates instead of catalog peaks "
                                    "x estimate.* efficiencies; a relative path is relative to the working directory")
    maintenance_hours_per_week: Annotated[float, Field(ge=0.0, lt=168.0, allow_inf_nan=False)] = Field(
        0.0, description="Planned maintenance apart from failures: hours a week the cluster is down; plan's whole "
        "run stretches its calendar time by 168 / (168 - hours) and counts the GPUs held through it")
    gpu_hour_price: PositiveFloat | None = Field(None, description="Price of one GPU-hour (any currency): plan then "
                                                 "prices the whole run's expected GPU-hours; no default price")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def elastic(self) -> bool:
        """min_nodes below nodes: torchrun may continue the run on fewer nodes (plan/elastic.py)."""
        return self.min_nodes is not None and self.min_nodes < self.nodes


# launcher.nccl field -> the NCCL environment variable it sets (the one owner of this mapping; NCCL's
# "Environment Variables" documentation names and values).
NCCL_VARIABLES: dict[str, str] = {
    "socket_ifname": "NCCL_SOCKET_IFNAME",
    "ib_hca": "NCCL_IB_HCA",
    "debug": "NCCL_DEBUG",
    "debug_subsys": "NCCL_DEBUG_SUBSYS",
}


class NcclSpec(Strict):
    """NCCL settings, exported to every rank as their variables (NCCL_VARIABLES); unset: NCCL's own choice."""

    socket_ifname: str | None = Field(None, min_length=1, description="NCCL_SOCKET_IFNAME: interfaces for "
                                      "bootstrap and socket transport, e.g. ib0, ^docker,lo, =eth0")
    ib_hca: str | None = Field(None, min_length=1, description="NCCL_IB_HCA: InfiniBand HCAs (and ports) to use, "
                               "e.g. mlx5_0:1,mlx5_1:1 or ^mlx5_2")
    debug: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = Field(
        None, description="NCCL_DEBUG; the Slurm batch script sets WARN when this is unset")
    debug_subsys: str | None = Field(None, min_length=1, description="NCCL_DEBUG_SUBSYS: subsystems logged at "
                                     "INFO, e.g. INIT,NET or ALL,^COLL")

    def variables(self) -> dict[str, str]:
        """The NCCL variables this section sets, by name."""
        return {NCCL_VARIABLES[k]: v for k, v in self.model_dump().items() if v is not None}


class ContainerSpec(Strict):
    """A container for the training step on Slurm, through the pyxis plugin (srun --container-*)."""

    image: str = Field(min_length=1, description="--container-image: an enroot URI (nvcr.io#nvidia/pytorch:24.05-py3)"
                       " or a squashfs file on the compute nodes")
    mounts: list[str] = Field(default_factory=list, description="--container-mounts, one SRC[:DST[:FLAGS]] per item "
                              "(absolute paths; flags joined with +, e.g. ro+rprivate); the run directory, "
                              "checkpoint directory, data and launcher.python must be visible at the same path")
    workdir: str | None = Field(None, min_length=1, description="--container-workdir: the working directory "
                                "inside the container (absolute)")


class LauncherSpec(Strict):
    backend: Literal["auto", "local", "slurm"] = Field(
        "auto", description="auto: slurm for multi-node clusters, else local torchrun on this machine"
    )
    mode: Literal["torchrun", "srun"] = Field(
        "torchrun", description="torchrun: one torchrun per node starts the node's ranks (restarts, elastic "
        "nodes); srun: Slurm starts every rank as its own task (needs the Slurm backend)")
    max_restarts: Annotated[int, Field(ge=0, le=1000)] = Field(
        0, description="torchrun --max-restarts: times torchrun restarts the ranks after a failure, from the last "
        "checkpoint, within one attempt; an elastic run needs at least 1")
    start_retries: Annotated[int, Field(ge=0, le=100)] = Field(
        3, description="Slurm: an attempt whose step fails to start (a launch failure, a revoked credential, a "
        "node lost at start: the trainer never began) requeues the job, after Slurm's requeue delay, at most "
        "this many times per job; 0 ends the run at the first such failure")
    grace_s: Annotated[int, Field(ge=1, le=65535)] = Field(
        DEFAULT_GRACE_S, description="Slurm: seconds before cluster.time at which the ranks are told to checkpoint "
        "and the job requeues itself (--signal=B:USR1@GRACE); must be well below cluster.time")
    srun_args: list[str] = Field(default_factory=list, description="Extra arguments of the training step's srun, "
                                 "after trainctl's own")
    sbatch_args: list[str] = Field(default_factory=list, description="Extra sbatch arguments, after trainctl's own "
                                   "(so they win)")
    env: dict[str, str] = Field(default_factory=dict, description="Variables set for every rank; a name that "
                                "looks like a credential (TOKEN, KEY, SECRET, PASSWORD...) is passed through the "
                                "environment instead and its value never written to the run directory")
    env_passthrough: list[str] = Field(default_factory=list, description="Names of variables every rank takes "
                                       "from the environment trainctl launch/resume runs in (e.g. [HF_TOKEN, "
                                       "WANDB_API_KEY]); only the names are written to the run directory")
    setup: list[str] = Field(default_factory=list, description="Shell lines run before the step, verbatim "
                             "(module loads, environment activation): in the Slurm batch script and again in each "
                             "node's task before torchrun (torchrun mode); with a container, in each task inside it "
                             "instead; locally, before torchrun. A line that fails stops the run")
    python: str | None = Field(None, min_length=1, description="Interpreter that starts the trainer (torchrun mode: "
                               "torchrun, which starts the ranks with it) on the compute nodes; default the "
                               "interpreter trainctl runs in")
    container: ContainerSpec | None = Field(None, description="Slurm only: run the step in a container (pyxis)")
    nccl: NcclSpec = Field(NcclSpec(), description="NCCL settings, exported to every rank as NCCL_* variables")


class WandbSpec(Strict):
    """Weights & Biases (the `wandb` extra). Its API key reaches the ranks only through
    launcher.env_passthrough: [WANDB_API_KEY] (launch/secrets.py), never the spec."""

    project: Annotated[str, Field(min_length=1, max_length=128)] = Field(
        "trainctl", description="W&B project the run is logged to")
    entity: Annotated[str, Field(min_length=1, max_length=128)] | None = Field(
        None, description="W&B team or user; default: the API key's own")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: written under RUN/wandb only (`wandb sync` uploads it later); online: "
        "streamed to the W&B server as well")


class TrackingSpec(Strict):
    """Extra sinks of the per-step metrics line; RUN/metrics.jsonl stays the record (runtime/observe/tracking.py)."""

    tensorboard: bool = Field(False, description="TensorBoard event files under RUN/tensorboard (the `tensorboard` "
                              "extra): every numeric field of the metrics line, by global step")
    wandb: WandbSpec | None = Field(None, description="Weights & Biases run of the same scalars (the `wandb` extra); "
                                    "absent: off")

    @model_validator(mode="before")
    @classmethod
    def _wandb_switch(cls, data: Any) -> Any:
        # `wandb: true` (or --set tracking.wandb=true) switches it on with the defaults; false switches it off
        if isinstance(data, dict) and isinstance(data.get("wandb"), bool):
            data = {**data, "wandb": {} if data["wandb"] else None}
        return data


class EstimateSpec(Strict):
    """Assumptions of the planner's roofline; printed with every plan."""

    compute_efficiency: Annotated[float, Field(gt=0.0, le=1.0)] | None = Field(
        None, description="A flat fraction of peak FLOP/s for all the layers' work; unset: the operator model prices "
        "each GEMM by its shape, attention by its kernel and the memory-bound work at HBM bandwidth, from the "
        "hardware catalog's cited figures (docs/plan-and-calibrate.md)"
    )
    comm_efficiency: Annotated[float, Field(gt=0.0, le=1.0)] | None = Field(
        None, description="A flat fraction of link bandwidth for collectives, no latency; unset: NCCL's model (a "
        "latency per call and step, ring or tree, the bus bandwidth of the link tier, from the catalog)"
    )
    attention_kernel: Literal["auto", "flash2", "flash3", "unfused"] = Field(
        "auto", description="The attention kernel the step is priced with: auto is what the bundled trainer runs "
        "(torch SDPA's flash backend, FlashAttention-2, on a GPU); flash3 a Hopper FlashAttention-3 / cuDNN class "
        "kernel; unfused the s x s scores materialised (Megatron before flash attention). Another stack's choice, "
        "for planning its published runs; plan prints it as an assumption"
    )
    elementwise: Literal["auto", "eager", "fused"] = Field(
        "auto", description="How the step prices the rotary embedding and SwiGLU: auto is what the bundled trainer "
        "runs (its eager PyTorch ops, several passes over HBM each; fused under train.compile); fused one pass "
        "each, as a stack with fused kernels runs them (Megatron with Transformer Engine). Another stack's choice, "
        "for planning its published runs; plan prints it as an assumption"
    )
    grad_accumulation: Literal["auto", "hook", "cast", "fused"] = Field(
        "auto", description="The passes over HBM each micro-batch makes for every matmul weight beyond its GEMMs: "
        "auto is what the bundled trainer makes (under bf16/fp16 with fp32 weights, autocast's cast of the weight "
        "and of its gradient back, then an fp32 add into the gradient buffer; 16-bit weights under ZeRO-1/2: the "
        "16-bit gradient added into the fp32 buffer); hook 16-bit weights and that add (Megatron-LM's main_grad "
        "before gradient-accumulation fusion); cast 16-bit weights whose gradient is first cast into a new fp32 "
        "tensor and then added (DeepSpeed's BF16 optimizer); fused none, the add inside the "
        "weight-gradient GEMM (Transformer Engine's fuse_wgrad_accumulation, Megatron's "
        "--gradient-accumulation-fusion). Another stack's choice, for planning its published runs; plan prints it "
        "as an assumption")
    dp_overlap: Fraction | None = Field(
        None, description="Fraction of DP communication hidden behind backward; unset: the share a calibration "
        "profile measured on the DP group's link (trainctl calibrate), else on GPUs what the bundled trainer "
        "hides (every gradient bucket's reduction but the last behind the backward still to run; the ZeRO-1/2 "
        "weight all-gather after the step, exposed), 0 on CPU ranks that occupy every core of their node (gloo "
        "reduces on the cores the compute keeps busy). Set it for another stack's overlap (Megatron-Core's "
        "--overlap-grad-reduce / --overlap-param-gather: 1.0)")
    pp_scatter_gather: bool = Field(
        False, description="Pipeline sends split over the TP group without sequence parallelism: each TP rank sends "
        "its 1/tp piece of the activation or gradient to the next stage, which gathers the pieces over its TP link "
        "(Megatron-LM's scatter/gather optimization, Narayanan et al. 2021, sec. 4.1; DeepSpeed's partitioned "
        "pipeline buffers). The bundled trainer sends whole tensors (under sequence parallelism, its sequence "
        "shard). Another stack's choice, for planning its published runs; plan prints it as an assumption")
    tp_overlap: Fraction = Field(0.0, description="Fraction of TP communication hidden behind compute; the bundled "
                                 "trainer hides none (its plan says what hiding it would save); Megatron-Core's "
                                 "--tp-comm-overlap hides it behind the GEMMs")
    moe_imbalance: Annotated[float, Field(ge=1.0, le=1000.0)] = Field(
        DEFAULT_MOE_IMBALANCE, description="Mixture of experts, dropless routing: the busiest expert's tokens over "
        "the mean, which paces the expert MLPs and sizes their activations. 1.1: a trained router with a "
        "load-balancing loss (1.05-1.2: Switch Transformer, Fedus et al. 2022; the Megatron-Core MoE report); "
        "`trainctl mfu-report` measures a run's. A capacity factor (model.moe.capacity_factor) replaces it")
    checkpoint_write_gbps: PositiveFloat = Field(2.0, description="Checkpoint write bandwidth per node to the "
                                                 "checkpoint directory's filesystem, GB/s (a save's total time)")
    checkpoint_stage_gbps: PositiveFloat = Field(10.0, description="Device-to-host copy per GPU, GB/s: what an "
                                                 "async save blocks training for (a synchronous one blocks for "
                                                 "the whole write)")
    offload_pcie_gbps: PositiveFloat = Field(25.0, description="Pinned host<->device copy per GPU and direction, "
                                             "GB/s, for parallel.offload (PCIe Gen4 x16's 32 at ~80%; Gen5 "
                                             "doubles it)")
    host_adam_gbps: PositiveFloat = Field(40.0, description="Host memory bandwidth one GPU's share of the CPU "
                                          "step gets, GB/s, for parallel.offload (fused CPU AdamW moves 28 bytes "
                                          "per fp32 element)")
    requeue_s: NonNegativeFloat = Field(120.0, description="Seconds from a failure to the job running again, "
                                        "for plan's whole-run interruption cost. Default: Slurm's requeue delay, "
                                        "which a requeued batch job waits before it may start (slurm.conf(5): "
                                        "requeue_delay, by default AuthInfo's cred_expire, 120 s); detecting a "
                                        "hang and waiting for free nodes add to it")
    startup_s: NonNegativeFloat = Field(300.0, description="Seconds a restart spends starting up before the "
                                        "checkpoint load (process groups, model build, compile), for plan's "
                                        "whole-run interruption cost. Default: an assumption, as no published "
                                        "figure covers it; mfu-report measures a run's own (start-up, launch "
                                        "to first step)")
    checkpoint_read_gbps: PositiveFloat = Field(2.0, description="Checkpoint read bandwidth per node, GB/s: a "
                                                "restart's load time in plan's whole-run interruption cost")


class RunSpec(Strict):
    name: Annotated[str, Field(min_length=1, max_length=200)] = Field(
        description="Run name: the Slurm job name and the start of the default run directory, runs/<name>-<time>")
    model: ModelSpec = Field(description="The model architecture (or a preset)")
    parallel: ParallelSpec = Field(ParallelSpec(), description="The parallel layout: tensor, context, pipeline, "
                                   "expert and data parallelism, ZeRO, the pipeline schedule")
    train: TrainSpec = Field(description="The optimisation: batch, steps, learning-rate schedule, precision, "
                             "recompute, guards")
    data: DataSpec = Field(DataSpec(synthetic=True), description="The training tokens: a token file, a weighted "
                           "blend of them, or synthetic sequences (the default)")
    checkpoint: CheckpointSpec = Field(CheckpointSpec(), description="When and where checkpoints are saved, and "
                                       "how many are kept")
    cluster: ClusterSpec = Field(ClusterSpec(), description="The machines: nodes, accelerators and links (the "
                                 "catalog's, or overridden), the Slurm allocation")
    launcher: LauncherSpec = Field(LauncherSpec(), description="How the ranks start: local torchrun or Slurm, "
                                   "restarts, environment, container, NCCL")
    estimate: EstimateSpec = Field(EstimateSpec(), description="Assumptions of the planner's roofline "
                                   "(efficiencies, bandwidths); printed with every plan")
    tracking: TrackingSpec = Field(TrackingSpec(), description="Extra sinks of the per-step metrics (TensorBoard, "
                                   "Weights & Biases); RUN/metrics.jsonl is always written")

    @model_validator(mode="after")
    def _steps_from_tokens(self) -> RunSpec:
        # frozen model: train.tokens sets train.steps once, at validation; a count the batch does not divide is
        # rounded down here and refused by the rules (spec/rules.py), which name the fix. Steps given beside the
        # tokens (a run directory's frozen spec holds both) stay, for the rules to hold against the tokens.
        if self.train.tokens is not None and self.train.steps is None:
            object.__setattr__(self.train, "steps", self.steps_for_tokens)
        if self.train.stages and self.train.steps is None:
            object.__setattr__(self.train, "steps", sum(self.stage_steps(s) for s in self.train.stages))
        return self

    def stage_batch_tokens(self, stage: StageSpec) -> int:
        """Tokens per optimizer step of a stage: its global_batch x seq_len, the spec's where it leaves them out."""
        return (stage.global_batch or self.train.global_batch) * (stage.seq_len or self.model.seq_len)

    def stage_steps(self, stage: StageSpec) -> int:
        """The optimizer steps a stage's tokens make (rounded down, at least 1; the rules refuse a remainder)."""
        return max(1, stage.tokens // self.stage_batch_tokens(stage))

    def stage_spec(self, stage: StageSpec) -> RunSpec:
        """The spec at a stage's shape and steps (not validated: the rules check it, spec/rules.py)."""
        parallel = self.parallel.model_copy(update={"cp": stage.cp or self.parallel.cp,
                                                    "dp": stage.dp or self.parallel.dp,
                                                    "micro_batch": stage.micro_batch or self.parallel.micro_batch})
        train = self.train.model_copy(update={"global_batch": stage.global_batch or self.train.global_batch,
                                              "steps": self.stage_steps(stage), "tokens": None, "stages": None,
                                              "recompute": stage.recompute or self.train.recompute,
                                              "warmup": 0, "profile": None})
        model = self.model.model_copy(update={"seq_len": stage.seq_len or self.model.seq_len})
        cluster = self.cluster if stage.nodes is None else self.cluster.model_copy(
            update={"nodes": stage.nodes, "min_nodes": None})
        return self.model_copy(update={"parallel": parallel, "train": train, "model": model, "cluster": cluster})

    @property
    def steps_for_tokens(self) -> int | None:
        """The optimizer steps train.tokens implies (rounded down; at least 1); None without train.tokens. The
        one place that turns a token budget into steps."""
        if self.train.tokens is None:
            return None
        return max(1, self.train.tokens // self.batch_tokens)

    @property
    def batch_tokens(self) -> int:
        """Tokens per optimizer step: global_batch sequences of model.seq_len."""
        return self.train.global_batch * self.model.seq_len

    @property
    def dp(self) -> int:
        """The data-parallel size, with `auto` resolved from the cluster (rules guarantee it divides)."""
        if self.parallel.dp == "auto":
            return max(1, self.cluster.world_size // self.model_parallel)
        return self.parallel.dp

    @property
    def model_parallel(self) -> int:
        """Ranks of one data-parallel replica: tp x cp x pp."""
        return self.parallel.tp * self.parallel.cp * self.parallel.pp

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def backend(self) -> Literal["local", "slurm"]:
        """The launcher backend with `auto` resolved."""
        if self.launcher.backend == "auto":
            return "slurm" if self.cluster.nodes > 1 else "local"
        return self.launcher.backend

    def with_calibration(self, profile: str | Path) -> RunSpec:
        """This spec priced with another `trainctl calibrate` profile (`plan` and `mfu-report --calibration`)."""
        return self.model_copy(update={"cluster": self.cluster.model_copy(update={"calibration": str(profile)})})

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step on each DP replica (gradient accumulation x pipeline)."""
        return self.train.global_batch // (self.parallel.micro_batch * self.dp)

    @property
    def padded_vocab(self) -> int:
        """The vocabulary padded to a multiple of tp (trainctl.model_shape.padded_vocab)."""
        return padded_vocab(self.model.vocab, self.parallel.tp)

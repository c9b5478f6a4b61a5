"""The DTensor tensor-parallel reference for the hand-written Megatron TP, and its test worker.

`python tests/fork_ranks.py 2 tests/dist/dtensor_ref_worker.py OUT.json` (or torchrun)

Why this exists: PyTorch-native building blocks are the default; trainctl hand-writes Megatron TP
(trainctl/runtime/parallel/tensor_parallel.py) because DTensor's per-op dispatch overhead made it 2-5x slower on
the tiny CPU models the project runs (bench/bench_tp.py measures it), and KEEPS THE NATIVE ONE AS THE CHECKED REFERENCE.
This file is that reference: a plain, unfused transformer (separate q/k/v/o projections, separate fc1/fc2 or
gate/up/down, nn.LayerNorm / nn.RMSNorm, nn.Embedding, nn.Linear head) parallelized only with
`torch.distributed.tensor.parallel.parallelize_module`:

    tok embedding     RowwiseParallel(input_layouts=Replicate())   (vocab-parallel embedding)
    q, k, v, fc1/gate/up   ColwiseParallel()
    o, fc2/down            RowwiseParallel()
    head              ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) + loss_parallel()
    with SP:          SequenceParallel() on every norm, PrepareModuleInput(Shard(1) -> Replicate()) on attention
                      and MLP, the row-parallel layers / embedding output Shard(1) (reduce-scatter).

It loads the SAME full weights as trainctl's StageModule (the single-process build_stage gives them by name; the
fused qkv rows are split into q, k, v and the SwiGLU fc1 rows into gate, up). The worker runs forward + backward
at TP = world size in fp64 on: the hand-written trainctl StageModule, this DTensor reference and (for context)
one process, gathers every gradient to a full tensor, maps the reference's names back to trainctl's, and writes
the max differences per case to OUT.json; tests/dist/test_tp_dtensor_reference.py asserts on them.

Attention reshapes with `.view(B, T, -1, head_dim)`: after ColwiseParallel each rank holds heads/tp query heads
and kv_heads/tp kv heads (docs/design/checked-facts.md, "Checked facts: PyTorch distributed on CPU/gloo").
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from tp_worker import data, gather_grads  # the same data and full-gradient gathering as the trainctl TP tests

from trainctl.model_shape import ModelShape
from trainctl.runtime.model.parallel_context import ParallelContext
from trainctl.runtime.model.transformer import build_stage, loss_fn
from trainctl.runtime.parallel.tensor_parallel import TPContext, sync_sequence_parallel_grads

SEED = 1234

# vocab divisible by tp: nn.Embedding / nn.Linear hold exactly V rows here, trainctl pads only when V % tp != 0
GPT2 = dict(layers=2, hidden=32, heads=4, vocab=256, seq_len=16, norm="layernorm", position="learned",
            activation="gelu", bias=True, tied_embeddings=True)
LLAMA = dict(layers=2, hidden=64, heads=8, kv_heads=4, ffn_hidden=96, vocab=256, seq_len=16, norm="rmsnorm",
             position="rope", rope_theta=500000.0, activation="swiglu", bias=False, tied_embeddings=False)


# ---------------------------------------------------------------------------------------------------------
# The reference model: plain, unfused modules (written independently of trainctl.runtime.model.transformer)
# ---------------------------------------------------------------------------------------------------------


def _norm(cfg: ModelShape) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=cfg.bias)


def _rope_tables(cfg: ModelShape) -> tuple[Tensor, Tensor]:
    # same numbers as trainctl's Rotary: computed in fp64, stored as fp32, cast to the compute dtype on use
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """'Rotate half' rotary embedding on x [B, heads, T, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RefAttention(nn.Module):
    def __init__(self, cfg: ModelShape):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q = nn.Linear(cfg.hidden, cfg.heads * hd, bias=cfg.bias)
        self.k = nn.Linear(cfg.hidden, cfg.kv_heads * hd, bias=cfg.bias)
        self.v = nn.Linear(cfg.hidden, cfg.kv_heads * hd, bias=cfg.bias)
        self.o = nn.Linear(cfg.heads * hd, cfg.hidden, bias=cfg.bias)
        if cfg.position == "rope":
            cos, sin = _rope_tables(cfg)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        B_, T = x.shape[0], x.shape[1]
        hd = self.cfg.head_dim
        # local tensors after ColwiseParallel: [B, T, local_heads * hd]; -1 = this rank's heads
        q = self.q(x).view(B_, T, -1, hd).transpose(1, 2)
        k = self.k(x).view(B_, T, -1, hd).transpose(1, 2)
        v = self.v(x).view(B_, T, -1, hd).transpose(1, 2)
        if self.cfg.position == "rope":
            cos, sin = self.cos[:T].to(q.dtype), self.sin[:T].to(q.dtype)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.o(y.transpose(1, 2).reshape(B_, T, -1))


class RefMLP(nn.Module):
    def __init__(self, cfg: ModelShape):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        h, f = cfg.hidden, cfg.ffn_hidden
        if self.swiglu:
            self.gate = nn.Linear(h, f, bias=cfg.bias)
            self.up = nn.Linear(h, f, bias=cfg.bias)
            self.down = nn.Linear(f, h, bias=cfg.bias)
        else:
            self.fc1 = nn.Linear(h, f, bias=cfg.bias)
            self.fc2 = nn.Linear(f, h, bias=cfg.bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class RefBlock(nn.Module):
    def __init__(self, cfg: ModelShape):
        super().__init__()
        self.attn_norm = _norm(cfg)
        self.attn = RefAttention(cfg)
        self.mlp_norm = _norm(cfg)
        self.mlp = RefMLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class RefModel(nn.Module):
    """Whole decoder (embedding, blocks, final norm, LM head); returns logits (a Shard(-1) DTensor under TP)."""

    def __init__(self, cfg: ModelShape):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        if cfg.position == "learned":
            self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.layers = nn.ModuleDict({str(i): RefBlock(cfg) for i in range(cfg.layers)})
        self.final_norm = _norm(cfg)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied_embeddings:
            self.head.weight = self.tok.weight
        self.mesh: DeviceMesh | None = None
        self.sp = False

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok(ids)
        if self.cfg.position == "learned":
            h = h + self.pos.weight[: ids.shape[1]]
            if self.sp:  # replicated -> this rank's sequence chunk (backward: all-gather)
                h = DTensor.from_local(h, self.mesh, [Replicate()], run_check=False)
                h = h.redistribute(self.mesh, [Shard(1)]).to_local()
        for block in self.layers.values():
            h = block(h)
        return self.head(self.final_norm(h))


def parallelize_reference(model: RefModel, mesh: DeviceMesh, sp: bool) -> RefModel:
    """Apply DTensor TP (+ SP) with parallelize_module only; re-tie the LM head to the embedding."""
    cfg = model.cfg
    model.mesh, model.sp = mesh, sp
    seq = Shard(1)
    # a learned position table is added to the replicated embedding output, then scattered in forward
    emb_out = seq if sp and cfg.position != "learned" else Replicate()
    plan: dict = {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=emb_out),
        "head": ColwiseParallel(input_layouts=seq if sp else Replicate(), output_layouts=Shard(-1),
                                use_local_output=False),
    }
    if sp:
        plan["final_norm"] = SequenceParallel()
    out = seq if sp else Replicate()
    for i in model.layers:
        p = f"layers.{i}."
        plan[p + "attn.q"] = ColwiseParallel()
        plan[p + "attn.k"] = ColwiseParallel()
        plan[p + "attn.v"] = ColwiseParallel()
        plan[p + "attn.o"] = RowwiseParallel(output_layouts=out)
        if cfg.activation == "swiglu":
            plan[p + "mlp.gate"] = ColwiseParallel()
            plan[p + "mlp.up"] = ColwiseParallel()
            plan[p + "mlp.down"] = RowwiseParallel(output_layouts=out)
        else:
            plan[p + "mlp.fc1"] = ColwiseParallel()
            plan[p + "mlp.fc2"] = RowwiseParallel(output_layouts=out)
        if sp:
            plan[p + "attn_norm"] = SequenceParallel()
            plan[p + "mlp_norm"] = SequenceParallel()
            plan[p + "attn"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            plan[p + "mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    parallelize_module(model, mesh, plan)
    if cfg.tied_embeddings:  # parallelize_module gave the head its own DTensor copy: tie it again
        model.head.weight = model.tok.weight
    return model


def reference_loss(model: RefModel, ids: Tensor, targets: Tensor) -> Tensor:
    """Forward + vocab-parallel cross-entropy + backward; returns the (replicated) loss as a plain tensor."""
    logits = model(ids)
    if isinstance(logits, DTensor):
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        return loss.full_tensor().detach()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach()


# ---------------------------------------------------------------------------------------------------------
# Weight and gradient mapping between trainctl's fused names and the reference's unfused ones
# ---------------------------------------------------------------------------------------------------------


def _fused_splits(cfg: ModelShape) -> dict[str, tuple[list[str], list[int]]]:
    """trainctl fused name suffix -> (reference name suffixes, row sizes)."""
    hd = cfg.head_dim
    out = {"attn.qkv": (["attn.q", "attn.k", "attn.v"], [cfg.heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd]),
           "attn.proj": (["attn.o"], [cfg.hidden])}
    f = cfg.ffn_hidden
    if cfg.activation == "swiglu":
        out["mlp.fc1"] = (["mlp.gate", "mlp.up"], [f, f])  # fused rows [gate; up]
        out["mlp.fc2"] = (["mlp.down"], [cfg.hidden])
    return out


def trainctl_to_reference(cfg: ModelShape, full: dict[str, Tensor]) -> dict[str, Tensor]:
    """Full trainctl tensors by name -> full reference tensors by name (fused rows split)."""
    splits = _fused_splits(cfg)
    out: dict[str, Tensor] = {}
    for name, t in full.items():
        if name == "embed.tok.weight":
            out["tok.weight"] = t
            if cfg.tied_embeddings:
                out["head.weight"] = t
            continue
        if name == "embed.pos.weight":
            out["pos.weight"] = t
            continue
        for fused, (parts, sizes) in splits.items():
            prefix, _, leaf = name.rpartition(".")
            if prefix.endswith(fused):
                base = prefix[: -len(fused)]
                for part, piece in zip(parts, t.split(sizes, dim=0), strict=True):
                    out[f"{base}{part}.{leaf}"] = piece
                break
        else:
            out[name] = t
    return out


def reference_to_trainctl(cfg: ModelShape, ref: dict[str, Tensor]) -> dict[str, Tensor]:
    """Full reference gradients by name -> trainctl names (unfused parts concatenated back)."""
    splits = _fused_splits(cfg)
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for name in ref:
        if name in used:
            continue
        prefix, _, leaf = name.rpartition(".")
        target = None
        for fused, (parts, _sizes) in splits.items():
            for part in parts:
                if prefix.endswith(part):
                    base = prefix[: -len(part)]
                    names = [f"{base}{p}.{leaf}" for p in parts]
                    out[f"{base}{fused}.{leaf}"] = torch.cat([ref[n] for n in names], dim=0)
                    used.update(names)
                    target = True
                    break
            if target:
                break
        if target:
            continue
        if name == "tok.weight":
            out["embed.tok.weight"] = ref[name]
        elif name == "pos.weight":
            out["embed.pos.weight"] = ref[name]
        elif name == "head.weight" and cfg.tied_embeddings:
            continue  # the same parameter as tok.weight
        else:
            out[name] = ref[name]
    return out


def build_reference(cfg: ModelShape, mesh: DeviceMesh | None, sp: bool, seed: int = SEED,
                    dtype: torch.dtype = torch.float64) -> RefModel:
    """The reference loaded with exactly trainctl's (layout-independent) initial weights, then parallelized."""
    single = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=seed, dtype=dtype)
    full = {n: p.detach() for n, p in single.named_parameters()}
    model = RefModel(cfg).to(dtype)
    weights = trainctl_to_reference(cfg, full)
    own = dict(model.named_parameters(remove_duplicate=False))
    missing = set(own) ^ set(weights)
    if missing:
        raise RuntimeError(f"weight names do not line up: {sorted(missing)}")
    with torch.no_grad():
        for n, p in own.items():
            if tuple(p.shape) != tuple(weights[n].shape):
                raise RuntimeError(f"{n}: {tuple(p.shape)} vs {tuple(weights[n].shape)}")
            p.copy_(weights[n])
    if mesh is not None and mesh.size() > 1:
        parallelize_reference(model, mesh, sp)
    return model


def reference_grads(model: RefModel) -> dict[str, Tensor]:
    """Full gradients by reference name (DTensor grads gathered, Partial ones reduced)."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is None:
            g = torch.zeros(p.shape, dtype=p.dtype)
        out[n] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


# ---------------------------------------------------------------------------------------------------------
# Worker
# ---------------------------------------------------------------------------------------------------------


def trainctl_step(cfg: ModelShape, tp: TPContext, x: Tensor, y: Tensor, dtype=torch.float64):
    stage = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=SEED, ctx=ParallelContext(tp=tp),
                        dtype=dtype)
    loss = loss_fn(stage(x), y, cfg, tp)
    loss.backward()
    sync_sequence_parallel_grads(stage, tp)
    return loss.detach(), gather_grads([stage], tp)


def _max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> tuple[float, str]:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))
    worst = max(a, key=lambda n: (a[n] - b[n]).abs().max().item())
    return (a[worst] - b[worst]).abs().max().item(), worst


def compare(kw: dict, mesh: DeviceMesh, sp: bool) -> dict:
    cfg = ModelShape(**kw)
    x, y = data(cfg)
    group = mesh.get_group()
    tp = TPContext.from_group(group, sequence_parallel=sp)
    single_loss, single = trainctl_step(cfg, TPContext.single(), x, y)
    hand_loss, hand = trainctl_step(cfg, tp, x, y)

    ref = build_reference(cfg, mesh, sp)
    local_q_rows = ref.layers["0"].attn.q.weight.to_local().shape[0]
    seen: dict[str, int] = {}

    def record_seq(_mod, args):  # the sequence length one rank's first norm really sees
        a = args[0]
        seen["norm_seq"] = (a.to_local() if isinstance(a, DTensor) else a).shape[1]

    hook = ref.layers["0"].attn_norm.register_forward_pre_hook(record_seq)
    ref_loss = reference_loss(ref, x, y)
    hook.remove()
    norm_grad = ref.layers["0"].attn_norm.weight.grad
    with torch.no_grad():
        logits_local = ref(x).to_local().shape[-1]
    dt = reference_to_trainctl(cfg, reference_grads(ref))

    grad_diff, worst = _max_diff(hand, dt)
    return {
        "loss_hand": hand_loss.item(), "loss_dtensor": ref_loss.item(), "loss_single": single_loss.item(),
        "loss_diff": abs(hand_loss.item() - ref_loss.item()),
        "grad_diff": grad_diff, "grad_diff_param": worst,
        "grad_scale": max(g.abs().max().item() for g in dt.values()),
        "dtensor_vs_single_loss": abs(ref_loss.item() - single_loss.item()),
        "dtensor_vs_single_grad": _max_diff(dt, single)[0],
        "hand_vs_single_grad": _max_diff(hand, single)[0],
        "n_params": len(dt),
        "dtensor_local_q_rows": local_q_rows, "full_q_rows": cfg.heads * cfg.head_dim,
        "dtensor_local_logits": logits_local, "dtensor_norm_local_seq": seen["norm_seq"],
        "dtensor_norm_grad_placements": [str(p) for p in norm_grad.placements]
        if isinstance(norm_grad, DTensor) else "plain tensor",
    }


def main() -> None:
    torch.set_num_threads(1)
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    results: dict = {}
    t0 = time.perf_counter()
    for name, kw in (("gpt2", GPT2), ("llama", LLAMA)):
        results[name] = compare(kw, mesh, sp=False)
        results[f"{name}_sp"] = compare(kw, mesh, sp=True)
    # vocab 255: trainctl pads to 256 (masked column); DTensor shards the 255 rows unevenly (128 + 127)
    results["gpt2_vocab255"] = compare({**GPT2, "vocab": 255}, mesh, sp=False)
    results["llama_sp_vocab255"] = compare({**LLAMA, "vocab": 255}, mesh, sp=True)
    results["seconds"] = time.perf_counter() - t0
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # avoids the random SIGABRT at interpreter shutdown (docs/design/checked-facts.md, "Checked facts: PyTorch
    # distributed on CPU/gloo")
    os._exit(0)


if __name__ == "__main__":
    main()

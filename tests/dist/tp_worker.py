"""Worker for the tensor-parallel tests: `python tests/fork_ranks.py N tests/dist/tp_worker.py OUT.json` (or torchrun).

Every rank builds the tensor-parallel model (TP = world size, gloo, fp64) AND the single-process reference model
(TPContext.single(), same seed, same data) in the same process, runs forward + backward on both, gathers the
TP shards of every gradient into full tensors and compares them by name with the reference. Rank 0 writes one
JSON object per case to OUT.json; the pytest file asserts on it. Also:
  - `nofull_*`: records every tensor produced by any op (forward and backward, a TorchDispatchMode) and reports
    the largest dimension seen: it must be V_padded/tp on TP ranks (no full-vocab logits), V on one process;
  - `dropout_*`: TP-aware dropout masks differ across TP ranks where activations are sharded and agree where
    they are replicated; recompute replays dropout exactly;
  - `pp_chain_*`: two StageModules (layers 0-1 and 2-3) chained under TP+SP equal the single model, with the
    tied embedding's grad being the sum of the first and last stage copies.
`--bench` times forward+backward+SGD of a tiny model instead (ms/step, TP=N vs one process).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from trainctl.model_shape import ModelShape
from trainctl.runtime.model.parallel_context import ParallelContext
from trainctl.runtime.model.transformer import StageModule, build_stage, loss_fn
from trainctl.runtime.parallel.tensor_parallel import (
    TPContext,
    sync_sequence_parallel_grads,
    tp_dropout,
    unshard_tensors,
    vocab_parallel_cross_entropy,
)

SEED = 1234
B = 2

GPT2 = dict(layers=2, hidden=32, heads=4, vocab=255, seq_len=16, norm="layernorm", position="learned",
            activation="gelu", bias=True, tied_embeddings=True)
LLAMA = dict(layers=2, hidden=64, heads=8, kv_heads=4, ffn_hidden=96, vocab=255, seq_len=16, norm="rmsnorm",
             position="rope", rope_theta=500000.0, activation="swiglu", bias=False, tied_embeddings=False)


def data(cfg: ModelShape, batch: int = B, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def gather_grads(stages: list[StageModule], tp: TPContext) -> dict[str, torch.Tensor]:
    """Full gradients by global name (copies of a tied weight summed)."""
    out: dict[str, torch.Tensor] = {}
    for stage in stages:
        metas = stage.named_param_meta()
        for name, p in stage.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if tp.enabled:
                shards = [torch.empty_like(g) for _ in range(tp.size)]
                dist.all_gather(shards, g.contiguous(), group=tp.group)
            else:
                shards = [g]
            full = unshard_tensors(shards, metas[name].shard)
            out[name] = out[name] + full if name in out else full
    return out


def run(stages: list[StageModule], cfg: ModelShape, tp: TPContext, x, y, rng_seed: int = 99):
    torch.manual_seed(rng_seed)  # the default stream, identical on every TP rank (as the engine sets it)
    h = x
    for s in stages:
        h = s(h)
    loss = loss_fn(h, y, cfg, tp)
    loss.backward()
    for s in stages:
        sync_sequence_parallel_grads(s, tp)
    return loss.detach()


def equivalence(kw: dict, tp: TPContext, split: list[range] | None = None, dtype=torch.float64) -> dict:
    kw = dict(kw)
    recompute = kw.pop("recompute", "none")
    cfg = ModelShape(**kw)
    x, y = data(cfg)
    ref = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=SEED, dtype=dtype)
    ref_loss = run([ref], cfg, TPContext.single(), x, y)
    ref_grads = gather_grads([ref], TPContext.single())
    split = split or [range(cfg.layers)]
    stages = [build_stage(cfg, r, first=i == 0, last=i == len(split) - 1, seed=SEED, ctx=ParallelContext(tp=tp),
                          recompute=recompute, dtype=dtype)
              for i, r in enumerate(split)]
    loss = run(stages, cfg, tp, x, y)
    grads = gather_grads(stages, tp)
    assert set(grads) == set(ref_grads), (sorted(grads), sorted(ref_grads))
    diff = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
    scale = max(g.abs().max().item() for g in ref_grads.values())
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "loss_diff": abs(loss.item() - ref_loss.item()),
            "grad_diff": diff, "grad_scale": scale, "n_params": len(ref_grads),
            "padded_vocab": stages[-1].padded_vocab, "local_logits": cfg.padded_vocab(tp.size) // tp.size}


class MaxDim(TorchDispatchMode):
    """Records the largest dimension of every tensor any op produces (and the shapes that reach `limit`)."""

    def __init__(self, limit: int):
        super().__init__()
        self.max_dim = 0
        self.limit = limit
        self.offenders: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim():
                m = max(t.shape)
                self.max_dim = max(self.max_dim, m)
                if m >= self.limit and len(self.offenders) < 5:
                    self.offenders.append(f"{func}: {tuple(t.shape)}")
        return out


def no_full_logits(tp: TPContext) -> dict:
    # vocab chosen larger than every other dimension of the model and the batch (B*T = 32, ffn 128)
    cfg = ModelShape(layers=2, hidden=32, heads=4, vocab=384, seq_len=16, ffn_hidden=128)
    x, y = data(cfg)
    stage = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=SEED, ctx=ParallelContext(tp=tp))
    torch.manual_seed(1)
    with MaxDim(limit=cfg.vocab) as mode:
        loss = loss_fn(stage(x), y, cfg, tp)
        loss.backward()
    return {"max_dim": mode.max_dim, "offenders": mode.offenders, "vocab": cfg.vocab,
            "expected": cfg.padded_vocab(tp.size) // tp.size}


def ce_tiny_vocab(tp: TPContext) -> dict:
    """vocab = tp + 1: the last rank holds padding only (tp > 2) or one real column; compares with F.cross_entropy."""
    vocab = tp.size + 1
    padded = tp.size * ((vocab + tp.size - 1) // tp.size)
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2, 5, padded, generator=g, dtype=torch.float64)
    full[..., vocab:] = 1e3  # garbage in the padded columns must not matter
    targets = torch.randint(0, vocab, (2, 5), generator=g)
    local = full.chunk(tp.size, dim=-1)[tp.rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, targets, tp, vocab)
    loss.backward()
    ref_in = full[..., :vocab].clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(ref_in.reshape(-1, vocab), targets.reshape(-1))
    ref.backward()
    grad_full = torch.cat(gather_all(local.grad, tp), dim=-1)
    return {"loss_diff": abs(loss.item() - ref.item()),
            "grad_diff": (grad_full[..., :vocab] - ref_in.grad).abs().max().item(),
            "pad_grad_max": grad_full[..., vocab:].abs().max().item()}


def gather_all(t: torch.Tensor, tp: TPContext) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(tp.size)]
    dist.all_gather(out, t.contiguous(), group=tp.group)
    return out


def dropout_checks(tp: TPContext) -> dict:
    x = torch.ones(2, 8, 16)
    torch.manual_seed(5)
    sharded = tp_dropout(x, 0.5, True, tp, sharded=True)
    torch.manual_seed(5)
    replicated = tp_dropout(x, 0.5, True, tp, sharded=False)
    s_all, r_all = gather_all(sharded, tp), gather_all(replicated, tp)
    res = {"sharded_differ": all(not torch.equal(s_all[0], s) for s in s_all[1:]),
           "replicated_equal": all(torch.equal(r_all[0], r) for r in r_all[1:])}
    # recompute replays dropout exactly (attention, residual and embedding dropout, TP+SP)
    base = {**LLAMA, "dropout": 0.1}
    tps = TPContext(tp.group, tp.size, tp.rank, True)
    x, y = data(ModelShape(**base))
    out = {}
    for rc in ("none", "selective", "full"):
        cfg = ModelShape(**base)
        stage = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=SEED, ctx=ParallelContext(tp=tps),
                            recompute=rc, dtype=torch.float64)
        loss = run([stage], cfg, tps, x, y, rng_seed=3)
        out[rc] = (loss, {n: p.grad.clone() for n, p in stage.named_parameters()})
    for rc in ("selective", "full"):
        res[f"recompute_{rc}_loss_diff"] = abs(out[rc][0].item() - out["none"][0].item())
        res[f"recompute_{rc}_grad_diff"] = max((out[rc][1][n] - g).abs().max().item()
                                               for n, g in out["none"][1].items())
    # dropout really is active: a different RNG seed gives a different loss
    cfg = ModelShape(**base)
    stage = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=SEED, ctx=ParallelContext(tp=tps),
                        dtype=torch.float64)
    res["dropout_changes_loss"] = abs(run([stage], cfg, tps, x, y, rng_seed=4).item() - out["none"][0].item())
    return res


def bench(tp: TPContext, steps: int = 60) -> dict:
    kw = dict(layers=4, hidden=64, heads=4, vocab=256, seq_len=32)
    res = {}
    variants = (("single", TPContext.single()), ("tp", tp), ("tp_sp", TPContext(tp.group, tp.size, tp.rank, True)),
                ("tp_sp_deferred", TPContext(tp.group, tp.size, tp.rank, True, True)))
    for label, tp_variant in variants:
        cfg = ModelShape(**kw)
        stage = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=SEED,
                            ctx=ParallelContext(tp=tp_variant))
        opt = torch.optim.SGD(stage.parameters(), lr=0.01)
        x, y = data(cfg)
        times = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            loss = loss_fn(stage(x), y, cfg, tp_variant)
            loss.backward()
            sync_sequence_parallel_grads(stage, tp_variant)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        times.sort()
        res[label] = {"median_ms": round(1000 * times[len(times) // 2], 2), "min_ms": round(1000 * times[0], 2)}
    return res


def main() -> None:
    torch.set_num_threads(1)
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    tp = TPContext.from_group(dist.group.WORLD)
    tps = TPContext.from_group(dist.group.WORLD, sequence_parallel=True)
    results: dict[str, dict] = {}
    if "--bench" in sys.argv:
        results["bench"] = bench(tp)
    else:
        t0 = time.perf_counter()
        for name, kw in (("gpt2", GPT2), ("llama", LLAMA)):
            results[f"{name}"] = equivalence(kw, tp)
            results[f"{name}_sp"] = equivalence(kw, tps)
        results["gpt2_sp_deferred"] = equivalence(GPT2, TPContext.from_group(dist.group.WORLD, True, True))
        results["gpt2_sp_selective"] = equivalence({**GPT2, "recompute": "selective"}, tps)
        results["llama_sp_full"] = equivalence({**LLAMA, "recompute": "full"}, tps)
        four = {"layers": 4}
        results["pp_chain_gpt2_sp"] = equivalence({**GPT2, **four}, tps, split=[range(0, 2), range(2, 4)])
        results["pp_chain_llama"] = equivalence({**LLAMA, **four}, tp, split=[range(0, 1), range(1, 3), range(3, 4)])
        results["llama_sp_fp32"] = equivalence(LLAMA, tps, dtype=torch.float32)
        results["nofull"] = no_full_logits(tp)
        results["nofull_single"] = no_full_logits(TPContext.single())
        results["dropout"] = dropout_checks(tp)
        results["ce_tiny_vocab"] = ce_tiny_vocab(tp)
        results["seconds"] = {"total": time.perf_counter() - t0}
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

"""The MoE layer (runtime/model/moe.py) side by side on 2 ranks: expert parallelism EP=2 vs EP=1, and a dense MLP
of the same active FLOPs.

Each rank holds its own batch of tokens (data parallel) and runs forward + backward of one MLP part of a layer
(after the norm, before the residual add) on it; the step time of a variant is the slowest rank's, the median
over the timed steps after warm-up. tokens/s counts both ranks' tokens. fp32, one thread per rank, gloo.

    moe_ep1    every expert on both ranks (EP=1: no token exchange)
    moe_ep2    the experts split over the two ranks (EP=2: dispatch and combine by all-to-all)
    dense      a dense MLP whose matmul weights per token equal the MoE's active ones (router + top_k experts
               + shared experts), rounded to whole columns (the printed FLOP ratio says how close)

Variants run interleaved (one step of each per round), so load from other processes hits all of them alike.

    .venv/bin/python bench/bench_moe.py                 # relaunches itself under torchrun with 2 ranks
    .venv/bin/python bench/bench_moe.py --hidden 128 --experts 8 --top-k 2 --expert-ffn 256 --json out.json

Reports only; there are no thresholds (timings on a shared 2-core CPU are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEED = 1234


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int, default=512)
    ap.add_argument("--shared-experts", type=int, default=0)
    ap.add_argument("--json", default="", help="also write the results here")
    return ap.parse_args()


def launch() -> int:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [str(torchrun), "--standalone", "--nproc-per-node=2", __file__, *sys.argv[1:]]
    return subprocess.run(cmd, env=env).returncode


def shapes(a: argparse.Namespace):
    """(the MoE model, the dense model of the same active matmul weights per token)."""
    from trainctl.model_shape import ModelShape, MoEShape, active_layer_matmul_params, attention_matmul_params

    common = dict(layers=1, hidden=a.hidden, heads=4, vocab=256, seq_len=a.seq, activation="swiglu", norm="rmsnorm",
                  position="rope", tied_embeddings=False)
    moe = ModelShape(**common, moe=MoEShape(num_experts=a.experts, top_k=a.top_k, expert_ffn_hidden=a.expert_ffn,
                                            shared_experts=a.shared_experts, aux_loss_coeff=0.01))
    active_mlp = active_layer_matmul_params(moe) - attention_matmul_params(moe)  # router + top_k + shared
    dense = ModelShape(**common, ffn_hidden=round(active_mlp / (3 * a.hidden)))
    return moe, dense


def make_steps(a: argparse.Namespace, x) -> tuple[dict, dict]:
    import torch.distributed as dist

    from trainctl.runtime.model.init import init_parameters
    from trainctl.runtime.model.moe import EPContext, MoEContext
    from trainctl.runtime.model.parallel_context import ParallelContext
    from trainctl.runtime.model.transformer import Block
    from trainctl.runtime.parallel.tensor_parallel import TPContext

    moe_cfg, dense_cfg = shapes(a)
    tp = TPContext.single()

    def variant(cfg, moe):
        block = Block(cfg, ParallelContext(tp=tp, moe=moe), "none", layer=0)
        init_parameters(block, SEED, tp)
        mlp = block.mlp
        x_ = x.clone().requires_grad_()

        def step():
            mlp(x_).sum().backward()
            mlp.zero_grad(set_to_none=True)
            x_.grad = None
        return step

    group = dist.new_group([0, 1])
    steps = {"moe_ep1": variant(moe_cfg, MoEContext.single(moe_cfg)),
             "moe_ep2": variant(moe_cfg, MoEContext.build(moe_cfg, EPContext(group, 2, dist.get_rank()))),
             "dense": variant(dense_cfg, None)}
    from trainctl.model_shape import active_layer_matmul_params, attention_matmul_params

    active = {name: active_layer_matmul_params(c) - attention_matmul_params(c)
              for name, c in (("moe", moe_cfg), ("dense", dense_cfg))}
    return steps, {"moe_active_matmul_per_token": active["moe"], "dense_matmul_per_token": active["dense"],
                   "dense_ffn_hidden": dense_cfg.ffn_hidden}


def main_rank(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(SEED + rank)  # each rank its own tokens
    x = torch.randn(a.batch, a.seq, a.hidden, generator=g)
    steps, flops = make_steps(a, x)
    from bench_tp import time_interleaved  # the same interleaved timing (slowest rank, median) as bench_tp

    median_s = {v: r["median_ms"] / 1e3 for v, r in time_interleaved(steps, a.steps, a.warmup).items()}
    tokens = 2 * a.batch * a.seq
    res = {"config": {**vars(a), **flops}, "median_ms": {v: s * 1e3 for v, s in median_s.items()},
           "tokens_per_s": {v: tokens / s for v, s in median_s.items()}}
    if rank == 0:
        tps = res["tokens_per_s"]
        c = res["config"]
        print(f"MoE layer: hidden {a.hidden}, {a.experts} experts top-{a.top_k} of {a.expert_ffn} (SwiGLU), "
              f"{a.shared_experts} shared; {a.batch} x {a.seq} tokens per rank, 2 ranks, fp32, {a.steps} timed steps")
        print(f"dense MLP of ffn {c['dense_ffn_hidden']}: matmul weights per token {c['dense_matmul_per_token']:,} vs "
              f"the MoE's active {c['moe_active_matmul_per_token']:,.0f} "
              f"({c['dense_matmul_per_token'] / c['moe_active_matmul_per_token']:.3f}x)")
        print(f"  {'variant':<10} {'median ms':>10} {'tokens/s':>10}")
        for v in steps:
            print(f"  {v:<10} {res['median_ms'][v]:>10.2f} {tps[v]:>10.0f}")
        ratios = {"moe_ep2 / moe_ep1": tps["moe_ep2"] / tps["moe_ep1"],
                  "moe_ep1 / dense": tps["moe_ep1"] / tps["dense"], "moe_ep2 / dense": tps["moe_ep2"] / tps["dense"]}
        res["ratios"] = ratios
        for label, r in ratios.items():
            print(f"  tokens/s {label:<18} {r:6.2f}x")
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # avoids the random SIGABRT at interpreter shutdown (docs/design/checked-facts.md, "Checked facts: PyTorch
    # distributed on CPU/gloo")
    os._exit(0)


if __name__ == "__main__":
    args = parse()
    if "RANK" not in os.environ:
        sys.exit(launch())
    main_rank(args)

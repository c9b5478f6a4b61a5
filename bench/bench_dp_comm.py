"""Benchmark: data-parallel gradient reduction per step, fp32 vs bf16 vs PowerSGD rank 4, and ZeRO-1's
reduce-scatter against the all-reduce it replaced, on 2 and 4 ranks.

The trainer's own GradSync (runtime/parallel/data_parallel.py) over a model's real parameters (the trainer's model,
built on every rank; ZeRO-0 buckets), with random gradients in its buckets: each step times `finish()`, which
launches every bucket's reduction and waits for it (for PowerSGD also its matmuls and QRs: what it adds to a
step), after a barrier so every rank starts together. The ZeRO-1 variants (bf16 weights, fp32 gradients) add
`after_step()`, the all-gather of the updated weights: `zero1` reduce-scatters (6 bytes per parameter),
`zero1-allreduce` is what ZeRO-1 did before, ZeRO-0's all-reduce of the same buckets and then the same
all-gather (10 bytes). The variants alternate step by step in one process group, so a busy shared machine
slows them alike; the median per variant is printed with its ratio to fp32 and the bytes one rank sends per
step (plan/comm.py `dp_traffic` with plan/powersgd.py), for each world size, and the ZeRO-1 ratio new / old.
No thresholds: the ratios are the result.

    .venv/bin/python bench/bench_dp_comm.py                    # worlds 2 and 4, a 17M-parameter GPT
    .venv/bin/python bench/bench_dp_comm.py --worlds 2 --steps 10 --hidden 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("fp32", "bf16", "powersgd-r4", "zero1-allreduce", "zero1")
ZERO1 = {"zero1-allreduce": 0, "zero1": 1}  # the ZeRO-1 variants: the stage whose reduction they run


def model_spec(a: argparse.Namespace) -> dict:
    return {"layers": a.layers, "hidden": a.hidden, "heads": 8, "vocab": a.vocab, "seq_len": 256,
            "norm": "layernorm", "position": "learned", "activation": "gelu", "tied_embeddings": True, "bias": True}


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from trainctl.model_shape import ModelShape
    from trainctl.plan import comm, powersgd
    from trainctl.plan.placement import Layout
    from trainctl.runtime.model.transformer import build_stage
    from trainctl.runtime.parallel.data_parallel import GradSync, ParamInfo
    from trainctl.runtime.parallel.process_groups import RankEnv, parallel_groups, start_process_group
    from trainctl.spec.loader import validate_spec

    torch.set_num_threads(1)
    env = RankEnv.from_env()
    device = start_process_group(env, gpu=torch.cuda.is_available())
    world = env.world_size
    spec = validate_spec({"name": "bench-dp-comm", "model": model_spec(a),
                          "parallel": {"dp": world}, "train": {"global_batch": world, "steps": 1},
                          "data": {"synthetic": True}, "cluster": {"nodes": 1, "gpus_per_node": world, "gpu": "cpu"}})
    par = parallel_groups(Layout.from_spec(spec), env, device)
    assert par is not None
    cfg = ModelShape.from_spec(spec.model)
    syncs = {}
    for v in VARIANTS:  # one model per variant: a GradSync owns its parameters' .grad
        model = build_stage(cfg, range(0, cfg.layers), first=True, last=True, seed=1, device=device)
        infos = [ParamInfo(n, p, True, False, False) for n, p in model.named_parameters()]
        syncs[v] = GradSync(infos, par, ZERO1.get(v, 0), 1, reduce_dtype=torch.bfloat16 if v == "bf16" else None,
                            powersgd=(4, 1, 1) if v.startswith("powersgd") else None,
                            param_dtype=torch.bfloat16 if v == "zero1" else None)
    n_params = sum(p.numel() for p in model.parameters())
    mats = powersgd.stage_matrices(cfg, 1, cfg.layers, True, True)
    c = powersgd.compression(mats, 4)
    traffic = {"fp32": comm.dp_traffic(n_params, 0, world, 1, 4, 4),
               "bf16": comm.dp_traffic(n_params, 0, world, 1, 2, 2),
               "powersgd-r4": comm.dp_traffic(n_params, 0, world, 1, 4, 4,
                                              powersgd=(c.compressed_params, c.factor_elements)),
               "zero1-allreduce": [*comm.dp_traffic(n_params, 0, world, 1, 4, 4),
                                   ("all_gather", comm.gather_bytes(2 * n_params, world), 1.0)],
               "zero1": comm.dp_traffic(n_params, 1, world, 1, 4, 2)}
    gen = torch.Generator().manual_seed(env.rank)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for step in range(1, a.warmup + a.steps + 1):
        for v in VARIANTS:
            s = syncs[v]
            s.start_step(step)
            for b in s.buckets:  # this rank's gradients, as a backward would leave them
                b.grad.copy_(torch.randn(b.grad.shape, generator=gen))
            dist.barrier()
            t0 = time.perf_counter()
            s.finish()
            if v in ZERO1:  # the same bf16 all-gather of the updated weights after either reduction
                syncs["zero1"].after_step()
            dt = time.perf_counter() - t0
            if step > a.warmup:
                times[v].append(dt)
    # the slowest rank's median: a collective ends when its last rank does
    med = {v: statistics.median(t) for v, t in times.items()}
    every = [None] * world
    dist.all_gather_object(every, med)
    if env.rank == 0:
        out = {v: {"median_s": max(m[v] for m in every), "bytes_per_rank": sum(x for _, x, _ in traffic[v])}
               for v in VARIANTS}
        print("RESULT " + json.dumps({"world": world, "params": n_params, "variants": out}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    print(f"DP gradient reduction per step (GradSync.finish, ZeRO-0; ZeRO-1 + after_step; gloo on CPU), model "
          f"{a.layers}x{a.hidden}, vocab {a.vocab}; median of {a.steps} steps, slowest rank")
    print(f"{'ranks':>5} {'variant':<15} {'seconds':>9} {'vs fp32':>8} {'MB/rank':>9} {'bytes vs fp32':>13}")
    for world in a.worlds:
        args = [torchrun, "--standalone", f"--nproc-per-node={world}", str(Path(__file__).resolve()), "--worker",
                "--steps", str(a.steps), "--warmup", str(a.warmup), "--layers", str(a.layers),
                "--hidden", str(a.hidden), "--vocab", str(a.vocab)]
        r = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if r.returncode or line is None:
            sys.exit(f"world {world} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        res = json.loads(line[len("RESULT "):])
        v = res["variants"]
        for name in VARIANTS:
            x = v[name]
            print(f"{world:>5} {name:<15} {x['median_s']:>9.4f} {x['median_s'] / v['fp32']['median_s']:>8.2f} "
                  f"{x['bytes_per_rank'] / 1e6:>9.2f} {x['bytes_per_rank'] / v['fp32']['bytes_per_rank']:>13.3f}")
        new, old = v["zero1"], v["zero1-allreduce"]
        print(f"{world:>5} ZeRO-1 step's DP time, reduce-scatter / all-reduce (+ all-gather both): "
              f"{new['median_s'] / old['median_s']:.2f} (bytes {new['bytes_per_rank'] / old['bytes_per_rank']:.2f})")


if __name__ == "__main__":
    main()

"""Context parallelism side by side: the trainer at CP1, CP2 and CP4 on one fixed long sequence, and the two
ways of exchanging K/V (all-gather, what the trainer does, vs a ring of send/recv overlapped with attention).

1. Training: the same model, sequence and batch at cp = 1, 2, 4 (cp ranks, dp 1). Per rank: the peak bytes
   saved for backward (the trainer's own meter, metrics.jsonl `memory`; it must fall close to 1/cp), the
   planner's prediction of the same, and tokens/s per rank (median step; also per second of the rank's own CPU
   time, which other load on a shared machine disturbs less). On a 2-core machine 4 ranks share 2 cores, so
   tokens/s per rank at CP4 measures contention as much as CP.
2. K/V exchange, one layer's forward on the CP group: (a) all-gather the K/V blocks, then attend the local
   queries to the whole sequence; (b) a ring: cp-1 rounds of isend/irecv of a K/V block, each overlapped with
   attention to the block in hand. The ring is given every advantage (no causal skipping, no log-sum-exp
   merge of partial results); if (a) is still as fast, the all-gather stays (docs/design/trainer.md,
   "Context parallelism").

    .venv/bin/python bench/bench_cp.py                       # seq 4096, 2 layers, hidden 128, GQA 8/2 heads
    .venv/bin/python bench/bench_cp.py --seq 8192 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import ROOT, TORCHRUN, train_run  # bench/ is sys.path[0]: the script's own directory

sys.path.insert(0, str(ROOT))


def make_spec(a: argparse.Namespace, cp: int) -> dict:
    return {
        "name": f"bench-cp{cp}",
        "model": {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads, "vocab": 256,
                  "seq_len": a.seq, "norm": "rmsnorm", "position": "rope", "activation": "swiglu",
                  "tied_embeddings": False},
        "parallel": {"tp": 1, "cp": cp, "pp": 1, "dp": 1, "micro_batch": 1},
        "train": {"global_batch": 1, "steps": a.steps, "lr": 3e-4, "warmup": 1, "precision": "fp32", "seed": 1},
        "data": {"synthetic": True},
        "cluster": {"nodes": 1, "gpus_per_node": cp, "gpu": "cpu"},
        "launcher": {"backend": "local"},
    }


def train(a: argparse.Namespace, cp: int, tmp: Path) -> dict:
    from trainctl.plan.plan import build_plan
    from trainctl.spec.loader import validate_spec

    spec = make_spec(a, cp)
    recs = train_run(spec, tmp / f"cp{cp}", cp, f"cp{cp}")
    mem = next(x["memory"] for x in recs if "memory" in x)
    planned = build_plan(validate_spec(spec)).to_json()["memory"]["activations"]
    steps = recs[2:] or recs  # the first steps also run start-up work and the memory meter's hooks
    return {"act": mem["max"]["activations_peak"], "planned": planned,
            "tok_s_rank": statistics.median(x["tokens_per_s_per_gpu"] for x in steps),
            "step_s": statistics.median(x["step_time_s"] for x in steps), "loss": recs[-1]["loss"],
            # rank 0's tokens per second of its own CPU time: robust to other load on a shared machine
            "tok_cpu_s": a.seq / cp / statistics.median(x["cpu_time_s"] for x in steps)}


def exchange_worker(a: argparse.Namespace, out: Path) -> None:
    """One layer's K/V exchange + attention forward on every rank: all-gather vs ring (see the docstring)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cp, rank = dist.get_world_size(), dist.get_rank()
    hd = a.hidden // a.heads
    n = a.seq // cp
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, a.heads, n, hd, generator=g)
    kv = torch.randn(2, 1, a.kv_heads, n, hd, generator=g)

    def all_gather() -> torch.Tensor:
        full = kv.new_empty((cp, *kv.shape))
        dist.all_gather_into_tensor(full.view(cp * kv.shape[0], *kv.shape[1:]), kv)
        k, v = full.permute(1, 2, 3, 0, 4, 5).reshape(2, 1, a.kv_heads, cp * n, hd)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def ring(compute: bool = True) -> torch.Tensor:
        cur, outs = kv, []
        for step in range(cp):
            if step < cp - 1:
                nxt = torch.empty_like(kv)
                reqs = [dist.isend(cur, (rank + 1) % cp), dist.irecv(nxt, (rank - 1) % cp)]
            if compute:  # overlapped with the transfer of the next block
                outs.append(F.scaled_dot_product_attention(q, cur[0], cur[1], enable_gqa=True))
            if step < cp - 1:
                for r in reqs:
                    r.wait()
                cur = nxt
        return torch.stack(outs).mean(0) if outs else cur  # the mean stands in for the log-sum-exp merge

    def gather_only() -> torch.Tensor:
        full = kv.new_empty((cp, *kv.shape))
        dist.all_gather_into_tensor(full.view(cp * kv.shape[0], *kv.shape[1:]), kv)
        return full

    fns = {"all_gather": all_gather, "ring": ring, "all_gather_only": gather_only,
           "ring_only": lambda: ring(compute=False)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(a.reps + 2):
        for name, fn in (fns.items() if i % 2 else reversed(fns.items())):  # alternate the order
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i >= 2:  # warm-up
                times[name].append(dt)
    mine = {k: statistics.median(v) for k, v in times.items()}
    every: list = [None] * cp
    dist.all_gather_object(every, mine)
    if rank == 0:
        out.write_text(json.dumps({k: max(r[k] for r in every) for k in mine}))  # the slowest rank paces
    dist.barrier()
    dist.destroy_process_group()


def exchange(a: argparse.Namespace, cp: int, tmp: Path) -> dict:
    out = tmp / f"exchange-cp{cp}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([TORCHRUN, "--standalone", f"--nproc-per-node={cp}", __file__, "--exchange-worker", str(out),
                        "--seq", str(a.seq), "--hidden", str(a.hidden), "--heads", str(a.heads),
                        "--kv-heads", str(a.kv_heads), "--reps", str(a.reps)], env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"exchange cp{cp} failed:\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--exchange-worker", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.exchange_worker:
        exchange_worker(a, a.exchange_worker)
        return
    cps = [int(x) for x in a.cps.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        res = {cp: train(a, cp, Path(tmp)) for cp in cps}
        ex = {cp: exchange(a, cp, Path(tmp)) for cp in cps if cp > 1}
    base = res[cps[0]]
    print(f"model: {a.layers} layers, hidden {a.hidden}, {a.heads} heads / {a.kv_heads} KV heads (RoPE, SwiGLU), "
          f"one sequence of {a.seq:,} tokens per step, fp32, 1 thread per rank, {os.cpu_count()} cores")
    print(f"{'cp':>3} {'activations/rank':>17} {'x CP1':>7} {'1/cp':>6} {'planned':>10} {'plan err':>9} "
          f"{'tokens/s/rank':>14} {'x CP1':>7} {'tokens/CPU-s':>13} {'x CP1':>7} {'loss':>8}")
    for cp, r in res.items():
        print(f"{cp:>3} {r['act'] / 2**20:>13.2f} MiB {r['act'] / base['act']:>7.3f} {1 / cp:>6.3f} "
              f"{r['planned'] / 2**20:>6.2f} MiB {(r['act'] - r['planned']) / r['planned']:>+9.1%} "
              f"{r['tok_s_rank']:>14,.0f} {r['tok_s_rank'] / base['tok_s_rank']:>7.3f} {r['tok_cpu_s']:>13,.0f} "
              f"{r['tok_cpu_s'] / base['tok_cpu_s']:>7.3f} {r['loss']:>8.4f}")
    kv_mib = 2 * a.seq * a.kv_heads * (a.hidden // a.heads) * 4 / 2**20
    print(f"K/V exchange of one layer ({kv_mib:.2f} MiB of K/V per sequence; each rank receives (cp-1)/cp of it "
          "either way), slowest rank, median:")
    for cp, e in ex.items():
        print(f"  cp {cp}: exchange alone: all-gather {e['all_gather_only'] * 1e3:.2f} ms, ring "
              f"{e['ring_only'] * 1e3:.2f} ms | with the layer's attention forward: all-gather then attend "
              f"{e['all_gather'] * 1e3:.2f} ms, ring overlapped {e['ring'] * 1e3:.2f} ms "
              f"(ring / all-gather {e['ring'] / e['all_gather']:.2f})")


if __name__ == "__main__":
    main()

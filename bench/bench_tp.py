"""Tensor parallel at TP=2, side by side: hand-written Megatron TP (trainctl) vs the DTensor reference vs one process.

ms/step of forward + vocab-parallel cross-entropy + backward (median over the timed steps after warm-up; the
slowest rank counts for each step), fp32, one thread per rank, for a tiny model (4 layers, hidden 64, seq 32) and
a larger one (4 layers, hidden 512, seq 128 by default). Variants:

    single        trainctl StageModule, one process (both ranks run it at once, one core each)
    single_ref    the unfused reference model, one process (what DTensor starts from, without DTensor)
    hand          trainctl's hand-written TP=2 (tensor_parallel.py)
    hand_sp       ... with sequence parallelism (norm-weight grads summed in autograd, one all-reduce each)
    hand_sp_def   ... with SP and defer_sp_grad_sync (one flattened all-reduce after backward)
    dtensor       the DTensor reference (tests/dist/dtensor_ref_worker.py: parallelize_module + loss_parallel), TP=2
    dtensor_sp    ... with SequenceParallel norms (their Partial grads reduced after backward, as an optimizer
                  step would have to)

Variants run interleaved (one step of each per round), so load from other processes hits all of them alike.

    .venv/bin/python bench/bench_tp.py                  # relaunches itself under torchrun with 2 ranks
    .venv/bin/python bench/bench_tp.py --large-hidden 256 --large-seq 64 --json out.json

Reports only; there are no thresholds (timings on a shared 2-core CPU are noisy).
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
sys.path.insert(0, str(ROOT))
# the DTensor reference lives beside its test: tests/dist/dtensor_ref_worker.py
sys.path.insert(0, str(ROOT / "tests" / "dist"))

SEED = 1234


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30, help="timed steps, tiny model")
    ap.add_argument("--large-steps", type=int, default=10, help="timed steps, larger model")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--large-hidden", type=int, default=512)
    ap.add_argument("--large-heads", type=int, default=8)
    ap.add_argument("--large-seq", type=int, default=128)
    ap.add_argument("--large-vocab", type=int, default=4096)
    ap.add_argument("--only", default="", help="comma-separated variants to run (default: all)")
    ap.add_argument("--json", default="", help="also write the results here")
    return ap.parse_args()


def launch(a: argparse.Namespace) -> int:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [str(torchrun), "--standalone", f"--nproc-per-node={a.nproc}", __file__, *sys.argv[1:]]
    return subprocess.run(cmd, env=env).returncode


def make_steps(cfg, x, y, mesh, only: set[str]) -> dict:
    """One zero-argument forward+backward step function per variant (each with its own model)."""
    import torch
    import torch.nn.functional as F
    from dtensor_ref_worker import build_reference, reference_loss
    from torch.distributed.tensor import DTensor, Replicate

    from trainctl.runtime.model.parallel_context import ParallelContext
    from trainctl.runtime.model.transformer import build_stage, loss_fn
    from trainctl.runtime.parallel.tensor_parallel import TPContext, sync_sequence_parallel_grads

    group = mesh.get_group()

    def trainctl_variant(tp: TPContext):
        stage = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=SEED, ctx=ParallelContext(tp=tp))

        def step():
            loss = loss_fn(stage(x), y, cfg, tp)
            loss.backward()
            sync_sequence_parallel_grads(stage, tp)  # only does something with defer_sp_grad_sync
            stage.zero_grad(set_to_none=True)
        return step

    def single_ref_variant():
        ref = build_reference(cfg, None, False, seed=SEED, dtype=torch.float32)

        def step():
            loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
            loss.backward()
            ref.zero_grad(set_to_none=True)
        return step

    def dtensor_variant(sp: bool):
        ref = build_reference(cfg, mesh, sp, seed=SEED, dtype=torch.float32)

        def step():
            reference_loss(ref, x, y)
            # under SP the norm weights' grads come back Partial (not yet summed over TP): reduce them here, as
            # an optimizer step would have to, so the step ends with usable grads like trainctl's
            for p in ref.parameters():
                if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
                    p.grad = p.grad.redistribute(placements=[Replicate()] * p.grad.device_mesh.ndim)
            ref.zero_grad(set_to_none=True)
        return step

    variants = {
        "single": lambda: trainctl_variant(TPContext.single()),
        "single_ref": single_ref_variant,
        "hand": lambda: trainctl_variant(TPContext.from_group(group)),
        "hand_sp": lambda: trainctl_variant(TPContext.from_group(group, sequence_parallel=True)),
        "hand_sp_def": lambda: trainctl_variant(TPContext.from_group(group, True, defer_sp_grad_sync=True)),
        "dtensor": lambda: dtensor_variant(False),
        "dtensor_sp": lambda: dtensor_variant(True),
    }
    return {v: make() for v, make in variants.items() if not only or v in only}


def time_interleaved(steps: dict, n: int, warmup: int) -> dict:
    """One step of every variant per round, so load from other processes hits all variants alike."""
    import torch
    import torch.distributed as dist

    times: dict[str, list[float]] = {v: [] for v in steps}
    for i in range(warmup + n):
        for v, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank is the step time
            if i >= warmup:
                times[v].append(dt.item() * 1000)
    return {v: {"median_ms": round(statistics.median(t), 2), "min_ms": round(min(t), 2)} for v, t in times.items()}


def main_rank(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from dtensor_ref_worker import data
    from torch.distributed.device_mesh import init_device_mesh

    from trainctl.model_shape import ModelShape

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    models = {
        "tiny": (dict(layers=4, hidden=64, heads=4, vocab=256, seq_len=32), a.steps),
        "large": (dict(layers=4, hidden=a.large_hidden, heads=a.large_heads, vocab=a.large_vocab,
                       seq_len=a.large_seq), a.large_steps),
    }
    only = set(filter(None, a.only.split(",")))
    results: dict = {}
    for mname, (kw, n) in models.items():
        cfg = ModelShape(**kw)
        x, y = data(cfg, batch=a.batch)
        results[mname] = {"config": {**kw, "batch": a.batch, "timed_steps": n},
                          **time_interleaved(make_steps(cfg, x, y, mesh, only), n, a.warmup)}

    if dist.get_rank() == 0:
        print_table(results)
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # avoids the random SIGABRT at interpreter shutdown (docs/design/checked-facts.md, "Checked facts: PyTorch
    # distributed on CPU/gloo")
    os._exit(0)


def print_table(results: dict) -> None:
    for mname, res in results.items():
        c = res["config"]
        print(f"\n{mname}: layers {c['layers']} hidden {c['hidden']} heads {c['heads']} vocab {c['vocab']} "
              f"seq {c['seq_len']} batch {c['batch']} ({c['timed_steps']} timed steps, fp32, TP=2 on gloo/CPU)")
        print(f"  {'variant':<12} {'median ms':>10} {'min ms':>8}")
        for v, r in res.items():
            if v != "config":
                print(f"  {v:<12} {r['median_ms']:>10.2f} {r['min_ms']:>8.2f}")
        m = {v: r["median_ms"] for v, r in res.items() if v != "config"}
        ratios = [("dtensor / hand", "dtensor", "hand"), ("dtensor_sp / hand_sp", "dtensor_sp", "hand_sp"),
                  ("dtensor_sp / hand_sp_def", "dtensor_sp", "hand_sp_def"),
                  ("hand / single", "hand", "single"), ("hand_sp / single", "hand_sp", "single"),
                  ("dtensor / single_ref", "dtensor", "single_ref"), ("single_ref / single", "single_ref", "single")]
        for label, num, den in ratios:
            if num in m and den in m:
                print(f"  {label:<26} {m[num] / m[den]:6.2f}x")


if __name__ == "__main__":
    args = parse()
    if "RANK" not in os.environ:
        sys.exit(launch(args))
    main_rank(args)

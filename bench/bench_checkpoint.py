"""Benchmark: how long checkpointing blocks training (async vs sync) and save/load throughput vs a plain copy.

An MLP + AdamW with >= 100 MB of state (fp32 weights + two moments). For each mode it trains, saves
every `--every` steps, and reports:
  - blocked: the time save() holds the training loop (async: the host-memory snapshot; sync: the
    whole write + fsync + checksums + commit); target: async blocked < 20% of sync;
  - slowdown: extra wall time of the steps that ran while an async save was writing (CPU and
    memory-bandwidth contention; on 2 cores the writer competes with training);
  - throughput: the sync save and a DCP load, in MB/s of checkpoint bytes, against copying the same
    shard bytes with shutil.copyfile + fsync, and reading them back.

    .venv/bin/python bench/bench_checkpoint.py [--hidden 2048] [--layers 3] [--saves 3] [--dir /tmp/x]
    .venv/bin/torchrun --standalone --nproc-per-node=2 bench/bench_checkpoint.py   # DP=2, sharded writes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainctl.checkpoint import file_digest, list_checkpoints  # noqa: E402
from trainctl.runtime.checkpoint.storage import CheckpointManager  # noqa: E402

OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


def build(hidden: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.GELU()]
    model = nn.Sequential(*mods)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, world: int) -> None:
    loss = model(x).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    if world > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad)
    optim.step()


def state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, optim, options=OPTS)
    return {"model": msd, "optim": osd}


def run_mode(args, ckdir: Path, async_save: bool, rank: int, world: int, base_step: float) -> dict:
    model, optim = build(args.hidden, args.layers)
    x = torch.randn(args.batch, args.hidden)
    step(model, optim, x, world)  # creates the optimizer state
    mgr = CheckpointManager(ckdir, rank=rank, world_size=world, keep_last=2, async_save=async_save)
    blocked, slowdowns, totals = [], [], []
    s = 1
    for _ in range(args.saves):
        t0 = time.perf_counter()
        mgr.save(s, state(model, optim))
        blocked.append(time.perf_counter() - t0)
        # Train until the background write is done (at least `every` steps) and time those steps.
        t1, n = time.perf_counter(), 0
        while n < args.every or mgr.in_flight():
            step(model, optim, x, world)
            n += 1
        t2 = time.perf_counter()
        mgr.wait()
        totals.append(mgr.last_stats.get("total_s", blocked[-1]))
        slowdowns.append(max(0.0, (t2 - t1) - n * base_step))
        s += n
    return {"blocked_s": statistics.median(blocked), "slowdown_s": statistics.median(slowdowns),
            "save_total_s": statistics.median(totals), "stats": mgr.last_stats, "blocked": blocked}


def throughput(ckdir: Path, tmp: Path, args, rank: int, world: int) -> dict:
    latest = [i for i in list_checkpoints(ckdir) if i.valid][-1]
    files = sorted(p for p in latest.path.iterdir() if p.name.startswith(f"__{rank}_"))
    nbytes = sum(p.stat().st_size for p in files)
    copies = []
    for _ in range(args.saves):  # median of a few: page-cache writeback makes single writes noisy
        t0 = time.perf_counter()
        for p in files:
            dst = tmp / f"copy-{rank}-{p.name}"
            shutil.copyfile(p, dst)
            fd = os.open(dst, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            dst.unlink()
        copies.append(time.perf_counter() - t0)
    copy_s = statistics.median(copies)
    t0 = time.perf_counter()
    for p in files:
        with open(p, "rb") as f:
            while f.read(8 << 20):
                pass
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in files:
        file_digest(p)
    hash_s = time.perf_counter() - t0
    model, optim = build(args.hidden, args.layers)
    step(model, optim, torch.randn(2, args.hidden), 1 if world == 1 else world)
    mgr = CheckpointManager(ckdir, rank=rank, world_size=world, keep_last=None, async_save=False)
    st = state(model, optim)
    t0 = time.perf_counter()
    mgr.load(latest.step, st, deep=False)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    mgr.load(latest.step, st, deep=True)
    load_deep_s = time.perf_counter() - t0
    return {"rank_bytes": nbytes, "copy_s": copy_s, "read_s": read_s, "hash_s": hash_s, "load_s": load_s,
            "load_deep_s": load_deep_s, "total_bytes": latest.size_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--every", type=int, default=5, help="training steps between saves (at least)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on /tmp)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    if world > 1:
        box = [str(root)]
        dist.broadcast_object_list(box, src=0)
        root = Path(box[0])

    model, optim = build(args.hidden, args.layers)
    x = torch.randn(args.batch, args.hidden)
    step(model, optim, x, world)
    n_params = sum(p.numel() for p in model.parameters())
    state_mb = n_params * 4 * 3 / 1e6
    for _ in range(2):
        step(model, optim, x, world)
    t0 = time.perf_counter()
    for _ in range(10):
        step(model, optim, x, world)
    base_step = (time.perf_counter() - t0) / 10
    del model, optim

    sync = run_mode(args, root / "sync", False, rank, world, base_step)
    asyn = run_mode(args, root / "async", True, rank, world, base_step)
    tp = throughput(root / "sync", root, args, rank, world)
    res = {
        "world": world, "params": n_params, "state_mb": round(state_mb, 1), "step_s": round(base_step, 4),
        "sync_blocked_s": round(sync["blocked_s"], 4), "async_blocked_s": round(asyn["blocked_s"], 4),
        "async_ratio": round(asyn["blocked_s"] / sync["blocked_s"], 4),
        "async_slowdown_s": round(asyn["slowdown_s"], 4), "async_save_total_s": round(asyn["save_total_s"], 4),
        "async_effective_ratio": round((asyn["blocked_s"] + asyn["slowdown_s"]) / sync["blocked_s"], 4),
        "save_MBps": round(tp["total_bytes"] / sync["blocked_s"] / 1e6, 1),
        "copy_MBps": round(tp["rank_bytes"] / tp["copy_s"] / 1e6, 1),
        "read_MBps": round(tp["rank_bytes"] / tp["read_s"] / 1e6, 1),
        "sha256_MBps": round(tp["rank_bytes"] / tp["hash_s"] / 1e6, 1),
        "load_MBps": round(tp["total_bytes"] / tp["load_s"] / 1e6, 1),
        "load_verified_MBps": round(tp["total_bytes"] / tp["load_deep_s"] / 1e6, 1),
        "sync_write_s": round(sync["stats"].get("write_s", 0), 4),
        "sync_commit_s": round(sync["stats"].get("commit_s", 0), 4),
        "async_blocked_each_s": [round(b, 4) for b in asyn["blocked"]],
    }
    if rank == 0:
        if args.json:
            print(json.dumps(res, indent=1))
        else:
            print(f"state {res['state_mb']} MB ({n_params / 1e6:.1f} M params, fp32 + AdamW), world {world}, "
                  f"train step {base_step * 1e3:.0f} ms")
            print(f"blocked per save: sync {res['sync_blocked_s']:.3f} s, async {res['async_blocked_s']:.3f} s "
                  f"-> ratio {res['async_ratio']:.1%} (target < 20%); async each save "
                  f"{res['async_blocked_each_s']} (the first allocates the host buffers)")
            print(f"async background save {res['async_save_total_s']:.3f} s; extra step time while it ran "
                  f"{res['async_slowdown_s']:.3f} s -> blocked + slowdown = {res['async_effective_ratio']:.1%} of sync")
            print(f"throughput MB/s: sync save {res['save_MBps']} (write {res['sync_write_s']} s + commit "
                  f"{res['sync_commit_s']} s), load {res['load_MBps']}, load+verify {res['load_verified_MBps']} | "
                  f"copyfile+fsync {res['copy_MBps']}, read {res['read_MBps']}, sha256 {res['sha256_MBps']}")
    if not args.dir and rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    if world > 1:
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

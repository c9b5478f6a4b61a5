"""Multi-process checkpoint test worker: `python tests/fork_ranks.py N tests/dist/ckpt_worker.py MODE ...`
(or torchrun).

An MLP + AdamW, replicated over DP ranks with hand-written gradient averaging (every rank holds the full
state), or with --fsdp sharded by FSDP2 (DTensor parameters and moments).

    train CKPT OUT --steps S --save-at a,b --async-at b [--hidden H] [--kill-rank R --kill-after T]
        trains S steps, saves after the listed steps (async where listed), keeps training while an
        async save is in flight, and dumps the state of each saved step to OUT/saved-<step>-rank<r>.pt
    load CKPT OUT [--step N]
        builds a differently seeded model, loads (latest valid or N), dumps OUT/loaded-rank<r>.pt
Timings go to OUT/timing-rank<r>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from trainctl.runtime.checkpoint.storage import CheckpointManager
from trainctl.runtime.train import faults

OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


def build(hidden: int, seed: int, fsdp: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 8))
    if fsdp:  # FSDP2: parameters and AdamW moments become DTensors sharded over the ranks
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, rank: int, world: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)  # each DP rank sees its own batch
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    optim.zero_grad()
    loss.backward()
    if world > 1 and not isinstance(next(model.parameters()), DTensor):  # FSDP2 reduces grads itself
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    optim.step()
    return loss.item()


def app_state(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> dict:
    msd, osd = get_state_dict(model, optim, options=OPTS)
    return {"model": msd, "optim": osd, "extra": {"step": step, "tokens": step * 16}}


def rank_state(step: int) -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "data_pos": step * 16}


def snapshot(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> dict:
    msd, osd = get_state_dict(model, optim, options=OPTS)
    clone = {k: (v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()) if torch.is_tensor(v) else v
             for k, v in {**msd, **osd}.items()}  # full tensors, comparable across layouts
    return {"state": clone, "rank_state": rank_state(step), "step": step}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "load"])
    ap.add_argument("ckpt")
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save-at", default="")
    ap.add_argument("--async-at", default="")
    ap.add_argument("--slow-at", type=int, default=-1, help="step whose async save is made slow")
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-after", type=float, default=1.0)
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (DTensor state)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    timing: dict = {}

    if args.mode == "train":
        model, optim = build(args.hidden, seed=0, fsdp=args.fsdp)
        save_at = {int(s) for s in args.save_at.split(",") if s}
        async_at = {int(s) for s in args.async_at.split(",") if s}
        sync_mgr = CheckpointManager(args.ckpt, rank=rank, world_size=world, keep_last=args.keep_last,
                                     async_save=False)
        async_mgr = CheckpointManager(args.ckpt, rank=rank, world_size=world, keep_last=args.keep_last,
                                      async_save=True)
        for step in range(1, args.steps + 1):
            train_step(model, optim, step, rank, world)
            random.random(), np.random.rand(), torch.rand(1)  # advance every RNG so restores are visible
            if step in save_at:
                mgr = async_mgr if step in async_at else sync_mgr
                sync_mgr.wait()
                async_mgr.wait()
                torch.save(snapshot(model, optim, step), out / f"saved-{step}-rank{rank}.pt")
                if step == args.slow_at:
                    os.environ.update(faults.encode(slow_write_s=60))
                t0 = time.perf_counter()
                mgr.save(step, app_state(model, optim, step), rank_state(step), meta={"tokens": step * 16})
                timing[f"save-{step}"] = {"async": step in async_at, "call_s": time.perf_counter() - t0}
                if step == args.slow_at and rank == args.kill_rank:
                    time.sleep(args.kill_after)
                    (out / "killing").write_text(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        async_mgr.wait()
        timing["final_wait_s"] = time.perf_counter() - t0
        timing["last_async_stats"] = async_mgr.last_stats
        timing["last_sync_stats"] = sync_mgr.last_stats
    else:
        model, optim = build(args.hidden, seed=123, fsdp=args.fsdp)
        mgr = CheckpointManager(args.ckpt, rank=rank, world_size=world, async_save=False)
        state = app_state(model, optim, 0)
        info, rstate = mgr.load(args.step, state)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"], options=OPTS)
        snap = snapshot(model, optim, info.step)
        snap["rank_state"] = rstate
        snap["extra"] = state["extra"]
        snap["meta"] = info.meta
        torch.save(snap, out / f"loaded-rank{rank}.pt")
    (out / f"timing-rank{rank}.json").write_text(json.dumps(timing, indent=1, default=str))
    if world > 1:
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # avoids the random SIGABRT at interpreter shutdown (docs/design/checked-facts.md, "Checked facts: PyTorch
    # distributed on CPU/gloo")
    os._exit(0)


if __name__ == "__main__":
    main()

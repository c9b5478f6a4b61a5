"""Count the HBM bytes a rank's real trainer step moves over its layers' matmul weights beyond the GEMMs.

    python tests/fork_ranks.py W tests/dist/weight_pass_worker.py CASES.json OUT_DIR

CASES.json is a list of {"id": str, "spec": {...a whole run spec...}}, each trained for its steps in one process
group, or {"id": str, "width": int, "micro_batches": int}, one linear layer under the trainer's FSDP2 policy and
schedule. Every aten op of the forward and backward passes (the step's micro-batches) that is not a GEMM, a view,
an allocation or a collective (those are priced apart) adds the bytes it reads and writes of tensors of a matmul
weight's own size (the activations are far smaller). Rank 0 writes OUT_DIR/<id>.json: {"bytes": per step, "ops":
bytes per op name, "weights": the matmul weights on one rank, "micro_batches": per step}.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from aten_bytes import VIEWS, tensors  # tests/ is on the fork server's path
from torch.utils._python_dispatch import TorchDispatchMode

from trainctl.plan.placement import Layout
from trainctl.rundir.paths import RunPaths
from trainctl.runtime.observe import metrics
from trainctl.runtime.parallel.process_groups import RankEnv, parallel_groups, start_process_group
from trainctl.runtime.train.trainer import Trainer
from trainctl.spec.loader import validate_spec

GEMMS = {"mm", "addmm", "bmm", "matmul", "linear"}
NO_TRAFFIC = {"empty", "empty_like", "new_empty", "empty_strided", "set_", "resize_", "record_stream"}
WRITE_ONLY = {"zero_", "fill_", "copy_", "_foreach_copy_"}


class Count(TorchDispatchMode):
    """The bytes each aten op reads and writes over the tensors whose element counts are in `sizes`: each tensor
    once (an op's input or output), an in-place op's own tensor twice (read, then written) unless the op only
    writes it (zero_, fill_, copy_)."""

    def __init__(self, sizes: set[int], collective_copies: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.sizes = sizes
        # gloo's reduce-scatter copies its result into the output when waited on (NCCL writes it in place): a
        # copy into a tensor of these sizes is the collective's, priced as communication
        self.collective_copies = collective_copies
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        collective = func.namespace == "c10d" or "all_gather" in name or "reduce_scatter" in name
        if collective or name in VIEWS | GEMMS | NO_TRAFFIC or (
                name == "copy_" and args[0].numel() in self.collective_copies):
            return out
        seen = {id(x): x for x in tensors([*args, *(kwargs or {}).values(), out]) if x.numel() in self.sizes}
        moved = sum(x.nbytes for x in seen.values())
        if name.endswith("_") and name not in WRITE_ONLY and args and isinstance(args[0], torch.Tensor) \
                and id(args[0]) in seen:
            moved += args[0].nbytes  # read, then written in place
        if moved:
            self.ops[name] += moved
        return out


def trainer_case(spec: dict, env: RankEnv, device: torch.device, out: Path) -> dict:
    """Steps of the real trainer: the bytes over its layers' matmul weights (each weight's own size)."""
    spec = validate_spec(spec)
    par = parallel_groups(Layout.from_spec(spec), env, device)
    assert par is not None
    paths = RunPaths(out)
    paths.root.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(spec, par, paths)
    trainer.flops = metrics.FlopsModel.from_spec(spec, par.world_size, 1e12, "weight-passes")
    weights = [p for m in trainer.modules for n, p in m.named_parameters() if ".layers." in f".{n}" and p.dim() == 2]
    buckets = [b.numel for b in getattr(trainer.sync, "buckets", [])]  # the gradient buffer, padded
    weight_count = Count({p.numel() for p in weights})
    slices = frozenset(n // spec.dp for n in buckets)
    buffer_count = Count({*buckets, *slices}, collective_copies=slices)  # a bucket, and its DP slice

    def counting(fn):  # noqa: ANN001, ANN202 - the trainer's own callables
        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            with weight_count, buffer_count:
                return fn(*args, **kwargs)
        return counted

    trainer.train_step(0)  # the first step's one-time work left out
    trainer.executor.run = counting(trainer.executor.run)  # the micro-batches' forward and backward passes
    trainer.sync.start_step = counting(trainer.sync.start_step)  # the fresh gradient buffer before each step
    trainer.sync.finish = counting(trainer.sync.finish)  # the reductions still in flight after the backward
    for step in range(1, spec.train.steps):
        trainer.train_step(step)
    steps = spec.train.steps - 1
    return {"bytes": sum(weight_count.ops.values()) / steps, "ops": dict(weight_count.ops),
            "weights": sum(p.numel() for p in weights), "buffer_bytes": sum(buffer_count.ops.values()) / steps,
            "buffer_ops": dict(buffer_count.ops), "buffer": sum(buckets),
            "micro_batches": spec.train.global_batch // (spec.parallel.micro_batch * spec.dp)}


def fsdp_case(width: int, micro_batches: int) -> dict:
    """One width x width linear layer sharded as the trainer shards a ZeRO-3 block (its FSDP2 policy under bf16
    compute) and run by its pp = 1 schedule: the bytes over tensors of the whole weight's size (its shards are
    smaller), one step after a first."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainctl.runtime.parallel.data_parallel import fsdp_policy
    from trainctl.runtime.parallel.pipeline_schedules import Accumulate

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(width, width, bias=False))
    policy = fsdp_policy(None, torch.bfloat16)
    fully_shard(model[0], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    schedule = Accumulate(model, lambda y, _t: y.float().square().mean(), micro_batches, torch.device("cpu"),
                          torch.bfloat16,
                          fsdp=True)
    rows = 4  # activations far smaller than the weight
    schedule.run(torch.randn(micro_batches, rows, width), torch.zeros(micro_batches, rows))
    count = Count({width * width})
    with count:
        schedule.run(torch.randn(micro_batches, rows, width), torch.zeros(micro_batches, rows))
    return {"bytes": sum(count.ops.values()), "ops": dict(count.ops), "weights": width * width,
            "micro_batches": micro_batches}


def main(cases_file: str, out_dir: str) -> None:
    env = RankEnv.from_env()
    torch.set_num_threads(1)
    device = start_process_group(env, gpu=False)
    for case in json.loads(Path(cases_file).read_text()):
        got = (trainer_case(case["spec"], env, device, Path(out_dir) / case["id"]) if "spec" in case
               else fsdp_case(case["width"], case["micro_batches"]))
        if env.rank == 0:
            (Path(out_dir) / f"{case['id']}.json").write_text(json.dumps(got))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

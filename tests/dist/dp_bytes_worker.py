"""Count the bytes this rank sends in data-parallel collectives over real trainer steps.

    python tests/fork_ranks.py W tests/dist/dp_bytes_worker.py CASES.json OUT_DIR

CASES.json is a list of {"id": str, "spec": {...a whole run spec...}}, each trained for its steps in one process
group. The collectives run as always; each call on the DP group is also recorded by op with the bytes one rank
sends in the ring algorithms the plan prices (plan/comm.py): all-reduce 2(n-1)/n of the message, reduce-scatter
(n-1)/n of its input, all-gather (n-1)/n of its output; messages of a few elements under "scalars". Rank 0
writes OUT_DIR/<id>.json: {"sent": {op: bytes per step}, "calls": {op: calls per step}, "buckets": DP buckets,
"bucket_numel": their elements (padded), "params": parameters}.
"""

from __future__ import annotations

import functools
import json
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from trainctl.plan.placement import Layout
from trainctl.rundir.paths import RunPaths
from trainctl.runtime.observe import metrics
from trainctl.runtime.parallel import data_parallel
from trainctl.runtime.parallel.process_groups import RankEnv, parallel_groups, start_process_group
from trainctl.runtime.train.trainer import Trainer
from trainctl.spec.loader import validate_spec

SENT: Counter[str] = Counter()
CALLS: Counter[str] = Counter()
DP_GROUP: list[dist.ProcessGroup | None] = [None]
SCALARS = 16  # a collective of at most this many elements is counted under "scalars"


def counted(op: str, fn, tensor_arg: int, share, tensor_kw: str = ""):
    """`fn` recording, for calls on the DP group, share(n) x the bytes of its positional argument `tensor_arg`
    (or keyword argument `tensor_kw`, as FSDP2 passes it)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = kwargs.get("group")
        if group is not None and group is DP_GROUP[0]:
            n = dist.get_world_size(group)
            t = args[tensor_arg] if len(args) > tensor_arg else kwargs[tensor_kw]
            kind = "scalars" if t.numel() <= SCALARS else op  # the loss and grad-norm reductions, not the buckets
            SENT[kind] += share(n) * t.numel() * t.element_size()
            CALLS[kind] += 1
        return fn(*args, **kwargs)
    return wrapper


def observe() -> None:
    ring = lambda n: (n - 1) / n  # noqa: E731
    dist.all_reduce = counted("all_reduce", dist.all_reduce, 0, lambda n: 2 * ring(n))
    # GradSync calls torch's reduce-scatter and all-gather through names it imported (output, input)
    data_parallel._reduce_scatter_single = counted("reduce_scatter", data_parallel._reduce_scatter_single, 1, ring)
    data_parallel._all_gather_single = counted("all_gather", data_parallel._all_gather_single, 0, ring)
    # FSDP2 (ZeRO-3) calls them through torch.distributed (output, input: by keyword for the reduce-scatter)
    dist.reduce_scatter_single = counted("reduce_scatter", dist.reduce_scatter_single, 1, ring, "input")
    dist.all_gather_single = counted("all_gather", dist.all_gather_single, 0, ring)


def main(cases_file: str, out_dir: str) -> None:
    env = RankEnv.from_env()
    torch.set_num_threads(1)
    device = start_process_group(env, gpu=False)
    observe()
    for case in json.loads(Path(cases_file).read_text()):
        spec = validate_spec(case["spec"])
        par = parallel_groups(Layout.from_spec(spec), env, device)
        assert par is not None
        paths = RunPaths(Path(out_dir) / case["id"])
        paths.root.mkdir(parents=True, exist_ok=True)
        trainer = Trainer(spec, par, paths)
        trainer.flops = metrics.FlopsModel.from_spec(spec, par.world_size, 1e12, "dp-bytes")
        DP_GROUP[0] = par.dp_group
        SENT.clear()
        CALLS.clear()
        for step in range(spec.train.steps):
            trainer.train_step(step)
        DP_GROUP[0] = None
        steps = spec.train.steps
        if env.rank == 0:
            buckets = getattr(trainer.sync, "buckets", [])  # none under ZeRO-3: FSDP2 holds the shards
            named = [(n, p) for m in trainer.modules for n, p in m.named_parameters()]
            out = {"sent": {k: v / steps for k, v in SENT.items()}, "calls": {k: v / steps for k, v in CALLS.items()},
                   "buckets": len(buckets), "bucket_numel": sum(b.numel for b in buckets),
                   "params": sum(p.numel() for _, p in named),
                   "head_params": sum(p.numel() for n, p in named if n.startswith(("final_norm.", "head.")))}
            (Path(out_dir) / f"{case['id']}.json").write_text(json.dumps(out))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Train many configurations inside one process group, one after another.

    python tests/fork_ranks.py W tests/dist/matrix_worker.py CASES.json OUT_DIR   (or torchrun)

CASES.json is a list of {"id": str, "spec": {...a whole run spec...}}. A case whose layout has one rank is a
reference: the ranks share the references out round-robin and train them side by side, each alone. The
other cases run one after another on global ranks [0, world) of the layout (ranks beyond it wait); their
groups come from the same code the trainer uses (trainctl.runtime.parallel.process_groups.parallel_groups), made once
per distinct rank list. Each case writes OUT_DIR/<id>/metrics.jsonl (loss and grad norm per step, from
the trainer) and OUT_DIR/<id>/final_weights/ (trainer.dump_weights). Starting torch once for the whole
matrix is what makes a covering design of ~100 configurations affordable on two cores.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from trainctl.plan.placement import Layout
from trainctl.rundir.paths import RunPaths
from trainctl.runtime.observe import metrics
from trainctl.runtime.parallel.process_groups import Parallel, RankEnv, exit_now, parallel_groups, start_process_group
from trainctl.runtime.train.trainer import Trainer
from trainctl.spec.loader import validate_spec


def alone(layout: Layout, device: torch.device) -> Parallel:
    """A one-rank layout on this rank, outside every group (a reference run)."""
    return Parallel(env=RankEnv(0, 0, 1), layout=layout, device=device, tp_rank=0, dp_rank=0, pp_rank=0,
                    tp_group=None, dp_group=None, pp_group=None, embedding_group=None,
                    ranks={"tp": [0], "dp": [0], "pp": [0], "embedding": [0]})


def train(case: dict, par: Parallel, out: Path) -> None:
    spec = validate_spec(case["spec"])
    paths = RunPaths(out / case["id"])
    paths.root.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(spec, par, paths)
    # any positive peak: the matrix compares losses and weights, not MFU
    trainer.flops = metrics.FlopsModel.from_spec(spec, par.world_size, 1e12, "matrix")
    for step in range(spec.train.steps):
        trainer.train_step(step)
    trainer.dump_weights(paths.root / "final_weights")


def main(cases_file: str, out_dir: str) -> None:
    env = RankEnv.from_env()
    torch.set_num_threads(1)
    device = start_process_group(env, gpu=False)  # the matrix compares CPU runs
    out = Path(out_dir)
    cases = json.loads(Path(cases_file).read_text())
    refs = [c for c in cases if Layout.from_spec(validate_spec(c["spec"])).world_size == 1]
    for i, case in enumerate(refs):
        if i % env.world_size == env.rank:
            train(case, alone(Layout.from_spec(validate_spec(case["spec"])), device), out)
    for case in cases:
        if case in refs:
            continue
        start = time.perf_counter()
        par = parallel_groups(Layout.from_spec(validate_spec(case["spec"])), env, device)
        if par is not None:
            train(case, par, out)
        if env.rank == 0:  # where a slow matrix spends its time
            print(f"case {case['id']} {time.perf_counter() - start:.2f}s", flush=True)
    dist.barrier()


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    except BaseException:
        traceback.print_exc()
        exit_now(1, barrier=False)
    exit_now(0, barrier=True)

"""One PowerSGD round of runtime/parallel/powersgd.py against torch's DDP powerSGD_hook on the same inputs (2 ranks,
gloo).

    python tests/fork_ranks.py 2 tests/dist/powersgd_ref_worker.py OUT_DIR

DDP trains a bias-free Linear whose per-rank gradient is set by the loss (W * G).sum(); the hook's rounds 1-2
are uncompressed (start_powerSGD_iter 2), rounds 3 and 4 compressed. Our compressor starts round 4 from the
hook's state after round 3 (its warm-start Q and this rank's error feedback) and must give the hook's round 4:
the decompressed gradient, the new Q and the new error. Writes OUT_DIR/rank<r>.pt with the comparisons.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph
from torch.nn.parallel import DistributedDataParallel

from trainctl.runtime.parallel.powersgd import PowerSGD
from trainctl.runtime.parallel.process_groups import exit_now

N, M, RANK = 24, 32, 4


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    torch.manual_seed(0)
    lin = nn.Linear(M, N, bias=False)
    ddp = DistributedDataParallel(lin)
    state = ph.PowerSGDState(process_group=None, matrix_approximation_rank=RANK, start_powerSGD_iter=2,
                             use_error_feedback=True, warm_start=True, random_seed=0)
    ddp.register_comm_hook(state, ph.powerSGD_hook)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own gradients
    grads = [torch.randn(N, M, generator=gen) for _ in range(4)]
    hook_q = hook_e = None
    for k, g in enumerate(grads):
        lin.weight.grad = None
        (ddp(torch.eye(M)).T * g).sum().backward()  # the forward's output is W^T, so the gradient is g
        if k == 2:  # after round 3: the state round 4 starts from
            hook_q, hook_e = state.q_memory_dict[0].clone(), state.error_dict[0].clone()
    assert hook_q is not None and hook_e is not None
    hook_out = lin.weight.grad.clone()
    hook_q4, hook_e4 = state.q_memory_dict[0].clone(), state.error_dict[0].clone()

    # ours, on the same inputs: a bucket of the matrix and a 1-D tensor (uncompressed: the plain DP mean)
    flat = torch.cat([grads[3].reshape(-1), torch.full((5,), float(rank + 1))])
    psgd = PowerSGD(RANK, 1, 0, None, world)
    bucket = psgd.bucket([("w", flat[:N * M], (N, M)), ("b", flat[N * M:], (5,))])
    mx = psgd.matrices["w"]
    mx.q.copy_(hook_q.view(M, RANK))
    mx.e.copy_(hook_e.view(N, M))
    bucket.launch()
    bucket.finish_p()
    bucket.land()
    ours = flat[:N * M].view(N, M).clone()
    peers = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(peers, flat)
    torch.save({"hook": hook_out, "ours": ours, "hook_q": hook_q4.view(M, RANK), "ours_q": mx.q.clone(),
                "hook_e": hook_e4.view(N, M), "ours_e": mx.e.clone(), "rest": flat[N * M:].clone(),
                "peers_equal": all(torch.equal(p, flat) for p in peers)},
               out / f"rank{rank}.pt")
    # Leave from inside main: returning tears down DDP's reducer and the gloo group in their destructors,
    # which hung 1 run in 10 here (docs/design/checked-facts.md, "Checked facts: PyTorch distributed on CPU/gloo").
    exit_now(0, barrier=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""PowerSGD (Vogels et al., NeurIPS 2019) for the once-per-step DP all-reduce of plain DP and ZeRO-1.

Per 2-D gradient matrix M (n x m) of this rank, worth compressing by plan/powersgd.py `compressed` (the rule
of torch's powerSGD_hook: (n + m) * r * 2 < n * m, r = min(n, m, rank)):

    M += e                      error feedback, in this rank's own (local) gradient units
    Q = orth(Q)                 warm start: last step's Q (drawn once from N(0, 1) per parameter name)
    P = M Q;   all-reduce P     (sum: only its span matters)
    P = orth(P)
    Q = M^T P; all-reduce Q; Q /= dp    (the mean over DP)
    M = P Q^T                   the approximation of the DP mean of M + e, identical on every DP rank
    e = (M + e) - P Q^T

Every other gradient of the bucket (biases, norms, small matrices) is pre-divided by dp and all-reduced
uncompressed, as without compression. Each matrix is handled on its own and its Q is seeded by its name, so the
result does not depend on the bucket layout. Under TP/PP each rank compresses its local shard of each weight
(its own M, e and Q): the DP group of a rank holds the same shard.

The collectives of a bucket are issued in bucket order on every DP rank: `launch` (the uncompressed part and
P, when the bucket's gradients are complete), then `finish_p` (Q) and `land` for all buckets at the step's end.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from trainctl.plan.powersgd import compressed


def orthogonalise(x: Tensor) -> Tensor:
    """Orthonormal columns spanning x's (n x r, r <= n): Householder QR, which (unlike Gram-Schmidt without an
    epsilon) stays finite for a zero column (a matrix whose gradient is zero)."""
    return torch.linalg.qr(x, mode="reduced").Q


@dataclass
class Matrix:
    """One compressed gradient matrix: its view in the bucket's buffer and its state."""

    name: str
    grad: Tensor  # n x m view of the bucket's fp32 gradient buffer
    q: Tensor  # m x r: the warm start (the last step's all-reduced Q)
    e: Tensor  # n x m: error feedback, local units
    p: Tensor | None = None  # n x r view of the bucket's P buffer (set by BucketCompression)


class BucketCompression:
    """One bucket's compressed matrices and uncompressed rest, with the buffers its collectives run on."""

    def __init__(self, matrices: list[Matrix], rest: list[Tensor], group: dist.ProcessGroup | None, dp: int):
        self.matrices, self.rest, self.group, self.dp = matrices, rest, group, dp
        dev = (matrices[0].grad if matrices else rest[0]).device
        self.p_flat = torch.zeros(sum(mx.grad.shape[0] * mx.q.shape[1] for mx in matrices), device=dev)
        self.q_flat = torch.zeros(sum(mx.q.numel() for mx in matrices), device=dev)
        self.rest_flat = torch.zeros(sum(t.numel() for t in rest), device=dev)
        off = 0
        for mx in matrices:
            n, r = mx.grad.shape[0], mx.q.shape[1]
            mx.p = self.p_flat[off:off + n * r].view(n, r)
            off += n * r
        self._works: list[dist.Work] = []

    def buffers(self) -> list[Tensor]:
        return [self.p_flat, self.q_flat, self.rest_flat]

    def launch(self) -> None:
        """The bucket's gradients are complete: all-reduce the rest (pre-divided) and P."""
        off = 0
        for t in self.rest:
            self.rest_flat[off:off + t.numel()].copy_(t.reshape(-1))
            off += t.numel()
        self.rest_flat.div_(self.dp)  # gloo has no AVG
        works = [dist.all_reduce(self.rest_flat, group=self.group, async_op=True)] if self.rest else []
        for mx in self.matrices:
            assert mx.p is not None
            mx.grad.add_(mx.e)
            mx.q.copy_(orthogonalise(mx.q))
            torch.matmul(mx.grad, mx.q, out=mx.p)
        if self.matrices:
            works.append(dist.all_reduce(self.p_flat, group=self.group, async_op=True))
        self._works = works

    def finish_p(self) -> None:
        """P is reduced: orthogonalise it, compute Q and all-reduce it."""
        if not self.matrices:
            return
        self._works.pop().wait()
        off = 0
        for mx in self.matrices:
            assert mx.p is not None
            mx.p.copy_(orthogonalise(mx.p))
            q = self.q_flat[off:off + mx.q.numel()].view_as(mx.q)
            torch.matmul(mx.grad.T, mx.p, out=q)
            off += mx.q.numel()
        self._works.append(dist.all_reduce(self.q_flat, group=self.group, async_op=True))

    def land(self) -> None:
        """Write the reduced rest and the approximations into the bucket; keep the error and Q."""
        if self.matrices:
            self._works.pop().wait()
            self.q_flat.div_(self.dp)  # the DP mean
            off = 0
            for mx in self.matrices:
                assert mx.p is not None
                mx.q.copy_(self.q_flat[off:off + mx.q.numel()].view_as(mx.q))
                off += mx.q.numel()
                mx.e.copy_(mx.grad)
                torch.matmul(mx.p, mx.q.T, out=mx.grad)
                mx.e.sub_(mx.grad)
        if self._works:
            self._works.pop().wait()
            off = 0
            for t in self.rest:
                t.copy_(self.rest_flat[off:off + t.numel()].view_as(t))
                off += t.numel()


class PowerSGD:
    """The compressor of one GradSync: the per-matrix state (by parameter name) and the step it starts at."""

    def __init__(self, rank: int, start_step: int, seed: int, group: dist.ProcessGroup | None, dp: int):
        self.rank, self.start_step, self.seed, self.group, self.dp = rank, start_step, seed, group, dp
        self.matrices: dict[str, Matrix] = {}

    def bucket(self, grads: list[tuple[str, Tensor, tuple[int, ...]]]) -> BucketCompression:
        """Split a bucket's gradients ((name, flat view, parameter shape)) into compressed matrices and the rest."""
        matrices, rest = [], []
        for name, flat, shape in grads:
            if len(shape) == 2 and compressed(shape[0], shape[1], self.rank):
                n, m = shape
                mx = Matrix(name, flat.view(n, m), self._first_q(name, m, min(n, m, self.rank)).to(flat.device),
                            torch.zeros(n, m, device=flat.device))
                self.matrices[name] = mx
                matrices.append(mx)
            else:
                rest.append(flat)
        return BucketCompression(matrices, rest, self.group, self.dp)

    def _first_q(self, name: str, m: int, r: int) -> Tensor:
        gen = torch.Generator().manual_seed(self.seed + zlib.crc32(name.encode()))  # the same on every DP rank
        return torch.randn(m, r, generator=gen)

    def reset(self) -> None:
        """Back to the first step's state (e = 0, the first Q): after a non-finite step, whose NaN/inf would
        otherwise stay in the error feedback and the warm start of every later step."""
        for mx in self.matrices.values():
            mx.e.zero_()
            mx.q.copy_(self._first_q(mx.name, *mx.q.shape))

    def active(self, step: int) -> bool:
        return step >= self.start_step

    def buffers(self) -> list[Tensor]:
        """What compression keeps besides the gradients (the memory meter counts them as gradients)."""
        return [t for mx in self.matrices.values() for t in (mx.q, mx.e)]

    def state_dict(self) -> dict:
        """Q and e of every matrix (e differs between DP ranks: saved per rank, beside DCP)."""
        return {"rank": self.rank, "matrices": {k: {"q": mx.q.cpu().clone(), "e": mx.e.cpu().clone()}
                                                for k, mx in self.matrices.items()}}

    def load_state_dict(self, state: dict) -> bool:
        """Restore Q and e; False (nothing changed) when the saved state is of other matrices or another rank."""
        saved = state.get("matrices", {})
        if state.get("rank") != self.rank or set(saved) != set(self.matrices) or any(
                saved[k]["e"].shape != mx.e.shape or saved[k]["q"].shape != mx.q.shape
                for k, mx in self.matrices.items()):
            return False
        for k, mx in self.matrices.items():
            mx.q.copy_(saved[k]["q"])
            mx.e.copy_(saved[k]["e"])
        return True

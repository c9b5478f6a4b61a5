"""Least-squares fits of calibration measurements. Plain Python: the planner imports the results.

Collectives, one fit per link class and kind (all-reduce, all-gather, reduce-scatter, all-to-all,
send/recv), over every group size and message size measured:
    time = latency + step_latency x steps(kind, n) + bus_bytes / bandwidth
the alpha-beta model (Hockney 1994) with the latency split into what every call pays (dispatch, and the
wait for a busy peer: `load_excess_s`, profile.build) and what each step of the algorithm pays. Bus bytes
are what a ring sends per rank (trainctl.plan.comm: all-reduce 2(n-1)/n of the message, the others
(n-1)/n), the quantity the planner prices; `ring_steps` counts a ring's steps: all-reduce 2(n-1), all-gather,
reduce-scatter and all-to-all n-1, send/recv 1. So the bandwidth term follows the ring through the bus bytes
and the latency grows linearly in n, which is what the plan at a group larger than measured follows.

What the libraries run: NCCL's all-gather and reduce-scatter are rings; its all-reduce is a ring, or a tree
(latency log n) that it picks for small messages at scale, so the ring is the pessimistic bound there; its
all-to-all posts n-1 send/recv pairs at once (per-call cost linear in n). gloo as torch 2.13's CPU wheel
carries it: its all-reduce is gloo's ring (the only all-reduce algorithm in the binary, no bcube), its
all-gather a ring, its all-to-all an exchange with each of the n-1 peers; the binary has no reduce-scatter
algorithm of gloo's, and a 4 MiB reduce-scatter among 4 ranks took twice the all-reduce's time on the 2-core
machine, so torch's gloo reduce-scatter is no ring and moves more than the ring's bytes: its fitted bandwidth
is lower than the all-reduce's, which is what the planner should charge for it. The fit keeps that honest: with
two or more group sizes measured the per-call and per-step latencies are fitted separately and the
residuals (`rms_rel_error`, `max_rel_error`, relative to the measured times) say how well the ring's shape
holds; with one group size the two cannot be told apart and all the latency is charged per step (the ring's
growth, pessimistic).

Weighted by 1/time^2, i.e. least squares of the *relative* error: the sizes span three orders of magnitude
and plain least squares would let the largest message decide the latency too. Coefficients are kept >= 0
(the best fit over the subsets of terms with non-negative coefficients, a three-term NNLS).
Compute: time = FLOPs / rate through the origin, weighted the same way.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


def median_of(per_rank: Sequence[float]) -> float:
    """A figure over ranks: their median (one rank caught off its core does not move it)."""
    return float(statistics.median(per_rank))


def ring_steps(op: str, n: int) -> int:
    """Steps of a ring collective `op` among n ranks, each paying the link's latency once (module docstring)."""
    if op == "send_recv":
        return 1
    if n < 2:
        return 0
    return 2 * (n - 1) if op == "all_reduce" else n - 1


# A fit whose worst measured point is off by more than this is a poor fit: the ring's shape misses how the library
# behaves on this link (or the measurements were disturbed), so the times it prices are rough.
POOR_FIT = 0.25


def fit_quality(max_rel_error: float) -> str:
    """A fit's error said plainly: how far off its worst measured point is, flagged when that is a poor fit."""
    said = f"worst measured point off by {max_rel_error:.0%}"
    return said + (" - a poor fit: the times priced from it are rough" if max_rel_error > POOR_FIT else "")


@dataclass(frozen=True)
class LinkFit:
    latency_s: float  # per call, whatever the group: dispatch, and the wait for a busy peer (load_excess_s)
    bytes_per_s: float  # bus bandwidth per rank
    points: int
    rms_rel_error: float  # of the fitted model against the measurements (relative to the measured time)
    group_size: int = 0  # the largest group the points were measured in (0: not recorded)
    load_excess_s: float = 0.0  # the part of latency_s that is waiting for a busy peer (profile.build)
    step_latency_s: float = 0.0  # per step of the ring (ring_steps)
    op: str = "all_reduce"  # the kind, which counts the steps
    max_rel_error: float = 0.0  # the worst measured point's
    groups: tuple[int, ...] = ()  # the group sizes measured

    def latency_at(self, group: int) -> float:
        """Per-call latency in a group of `group` ranks (0: the largest measured): the per-call part and the
        ring's steps at that size (module docstring)."""
        return self.latency_s + self.step_latency_s * ring_steps(self.op, group or self.group_size)

    def seconds(self, bus_bytes: float, calls: float, group: int = 0) -> float:
        return calls * self.latency_at(group) + bus_bytes / self.bytes_per_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "groups": list(self.groups)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinkFit:
        return cls(latency_s=float(d["latency_s"]), bytes_per_s=float(d["bytes_per_s"]), points=int(d["points"]),
                   rms_rel_error=float(d["rms_rel_error"]), group_size=int(d.get("group_size") or 0),
                   load_excess_s=float(d.get("load_excess_s", 0.0)), step_latency_s=float(d["step_latency_s"]),
                   op=str(d["op"]), max_rel_error=float(d.get("max_rel_error", 0.0)),
                   groups=tuple(int(n) for n in d.get("groups", ())))


def _rel_errors(points: Sequence[tuple[float, float]], predict: Any) -> list[float]:
    return [(predict(x) - t) / t for x, t in points]


def _rms(errors: Sequence[float]) -> float:
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a singular system."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


def _nnls(rows: Sequence[Sequence[float]], t: Sequence[float], required: int) -> list[float] | None:
    """Non-negative weighted (1/t^2) least squares of t ~ rows . coef over every subset of the columns that
    holds column `required` (a handful of columns): the feasible subset with the least residual; None if
    none is feasible with coef[required] > 0."""
    cols = len(rows[0])
    best: tuple[float, list[float]] | None = None
    for size in range(1, cols + 1):
        for subset in itertools.combinations(range(cols), size):
            if required not in subset:
                continue
            a = [[sum(r[i] * r[j] / ti**2 for r, ti in zip(rows, t, strict=True)) for j in subset] for i in subset]
            b = [sum(r[i] / ti for r, ti in zip(rows, t, strict=True)) for i in subset]  # r.t/t^2
            x = _solve(a, b)
            if x is None or min(x) < 0 or x[subset.index(required)] <= 0:
                continue
            coef = [0.0] * cols
            for i, v in zip(subset, x, strict=True):
                coef[i] = v
            sse = sum((sum(c * v for c, v in zip(coef, r, strict=True)) / ti - 1) ** 2
                      for r, ti in zip(rows, t, strict=True))
            if best is None or sse < best[0] - 1e-15:
                best = (sse, coef)
    return None if best is None else best[1]


def fit_collective(op: str, points: Sequence[tuple[int, float, float]]) -> LinkFit:
    """Fit t = latency + step_latency x ring_steps(op, n) + x / bandwidth to (group size n, bus bytes x,
    seconds t) points, t > 0, every coefficient >= 0 and the bandwidth finite.

    One number of steps among the points (one group size, or send/recv): the latency cannot be split and is
    all charged per step. A flat or falling line (every size took as long: latency-bound, or noise) keeps the
    smallest time as latency and charges the rest of the largest message's time to its bytes, so the
    bandwidth stays finite and positive."""
    pts = [(int(n), float(x), float(t)) for n, x, t in points if t > 0 and x >= 0]
    if not pts:
        raise ValueError("no positive timings to fit")
    steps = [max(ring_steps(op, n), 1) for n, _, _ in pts]
    t = [p[2] for p in pts]
    if len(set(steps)) > 1:
        rows = [[1.0, float(s), x] for s, (_, x, _) in zip(steps, pts, strict=True)]
        coef = _nnls(rows, t, required=2)
        per_call, per_step, slope = coef if coef else (0.0, 0.0, 0.0)
    else:
        rows = [[float(s), x] for s, (_, x, _) in zip(steps, pts, strict=True)]
        coef = _nnls(rows, t, required=1)
        per_call, (per_step, slope) = 0.0, (coef if coef else (0.0, 0.0))
    if slope <= 0:  # flat or falling: latency-bound
        x_max, t_max = max((x, tt) for _, x, tt in pts)
        n_min, _, t_min = min(pts, key=lambda p: p[2])
        per_call, per_step = 0.0, t_min / max(ring_steps(op, n_min), 1)
        slope = max(t_max - t_min, 1e-3 * t_max) / max(x_max, 1.0)
    groups = tuple(sorted({n for n, _, _ in pts}))
    fit = LinkFit(latency_s=per_call, bytes_per_s=1.0 / slope, points=len(pts), rms_rel_error=0.0,
                  group_size=groups[-1], step_latency_s=per_step, op=op, groups=groups)
    errors = [(fit.seconds(x, 1, n) - tt) / tt for n, x, tt in pts]
    return LinkFit(**{**asdict(fit), "rms_rel_error": _rms(errors), "max_rel_error": max(map(abs, errors))})


def fit_latency_bandwidth(points: Sequence[tuple[float, float]]) -> LinkFit:
    """Fit a line t = a + x/b to (x, seconds t) points, a >= 0, b > 0: one call of one step (`fit_collective`'s
    rules; `latency_s` holds a)."""
    fit = fit_collective("send_recv", [(2, x, t) for x, t in points])
    return LinkFit(**{**asdict(fit), "latency_s": fit.step_latency_s, "step_latency_s": 0.0})


def fit_rate(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(rate, rms relative error) of t = work / rate fitted to (work, seconds) points."""
    pts = [(float(f), float(t)) for f, t in points if f > 0 and t > 0]
    if not pts:
        raise ValueError("no positive timings to fit")
    inv = sum(f / t for f, t in pts) / sum((f / t) ** 2 for f, t in pts)  # weights 1/t^2
    return 1.0 / inv, _rms(_rel_errors(pts, lambda f: f * inv))

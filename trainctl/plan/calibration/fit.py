"""Least-squares fits of calibration measurements. Plain Python: the planner imports the results.

Collectives: time = latency + bus_bytes / bandwidth (the alpha-beta model, Hockney 1994), bus bytes being
what the ring algorithm sends per rank (trainctl.plan.comm), the same quantity the planner prices. Weighted
by 1/time^2, i.e. least squares of the *relative* error: the sizes span three orders of magnitude and plain
least squares would let the largest message decide the latency too.
Compute: time = FLOPs / rate through the origin, weighted the same way.

Another group size than measured (`LinkFit.latency_at`): a ring all-reduce takes 2(n-1) steps and a ring
all-gather, reduce-scatter or NCCL's all-to-all (n-1 concurrent send/recv pairs) n-1, each paying the link's
latency once, so the per-call latency grows as (n-1)/(n0-1) from the largest group n0 fitted; the bandwidth
term needs no factor, the bus bytes already carry (n-1)/n. This is gloo's ring and NCCL's ring; NCCL's
tree all-reduce (chosen at scale for small messages) grows as log n instead, so the ring rule is the
pessimistic bound. The wait for a busy peer (`load_excess_s`, profile.build) is kept as measured.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


def median_of(per_rank: Sequence[float]) -> float:
    """A figure over ranks: their median (one rank caught off its core does not move it)."""
    return float(statistics.median(per_rank))


@dataclass(frozen=True)
class LinkFit:
    latency_s: float  # per call
    bytes_per_s: float  # bus bandwidth per rank
    points: int
    rms_rel_error: float  # of the fitted line against the measurements
    group_size: int = 0  # the largest group the points were measured in (0: not recorded)
    load_excess_s: float = 0.0  # the part of latency_s that is waiting for a busy peer (profile.build)

    def latency_at(self, group: int) -> float:
        """Per-call latency in a group of `group` ranks: as fitted up to the largest group measured, the
        ring's (n-1)/(n0-1) beyond it (module docstring); `group` 0: as fitted."""
        n0 = self.group_size
        if n0 < 2 or group <= n0:
            return self.latency_s
        return (self.latency_s - self.load_excess_s) * (group - 1) / (n0 - 1) + self.load_excess_s

    def seconds(self, bus_bytes: float, calls: float, group: int = 0) -> float:
        return calls * self.latency_at(group) + bus_bytes / self.bytes_per_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rms_rel(points: Sequence[tuple[float, float]], predict: Any) -> float:
    return math.sqrt(sum(((predict(x) - t) / t) ** 2 for x, t in points) / len(points))


def fit_latency_bandwidth(points: Sequence[tuple[float, float]]) -> LinkFit:
    """Fit t = a + x/b to (bus bytes x, seconds t) points, t > 0, with a >= 0 and b > 0.

    A negative intercept (noise at small sizes) refits through the origin; a flat or falling line (every
    size took as long: latency-bound, or noise) keeps the smallest time as latency and charges the rest of
    the largest message's time to its bytes, so the bandwidth stays finite and positive."""
    pts = [(float(x), float(t)) for x, t in points if t > 0 and x >= 0]
    if not pts:
        raise ValueError("no positive timings to fit")
    w = [1.0 / t**2 for _, t in pts]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, pts, strict=True)) / sw
    mt = sum(wi * t for wi, (_, t) in zip(w, pts, strict=True)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, pts, strict=True))
    sxt = sum(wi * (x - mx) * (t - mt) for wi, (x, t) in zip(w, pts, strict=True))
    slope = sxt / sxx if sxx > 0 else 0.0
    a = mt - slope * mx
    if slope > 0 and a < 0:  # through the origin
        slope = sum(wi * x * t for wi, (x, t) in zip(w, pts, strict=True)) / sum(
            wi * x * x for wi, (x, _) in zip(w, pts, strict=True))
        a = 0.0
    if slope <= 0:
        x_max, t_max = max(pts)
        a = min(t for _, t in pts)
        slope = max(t_max - a, 1e-3 * t_max) / max(x_max, 1.0)
    fit = LinkFit(latency_s=a, bytes_per_s=1.0 / slope, points=len(pts), rms_rel_error=0.0)
    return LinkFit(a, fit.bytes_per_s, len(pts), _rms_rel(pts, lambda x: fit.seconds(x, 1)))


def fit_rate(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(rate, rms relative error) of t = work / rate fitted to (work, seconds) points."""
    pts = [(float(f), float(t)) for f, t in points if f > 0 and t > 0]
    if not pts:
        raise ValueError("no positive timings to fit")
    inv = sum(f / t for f, t in pts) / sum((f / t) ** 2 for f, t in pts)  # weights 1/t^2
    return 1.0 / inv, _rms_rel(pts, lambda f: f * inv)

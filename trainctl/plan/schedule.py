"""Pipeline schedules: the bubble, and how many micro-batches each pipeline rank keeps in flight.

Notation: p pipeline ranks, v model chunks per rank (virtual stages; 1 unless interleaved), m
micro-batches per optimizer step per data-parallel replica.
"""

from __future__ import annotations

BUBBLE_DEFINITION = (
    "bubble_fraction = idle share of the pipelined part of the step = (p-1)/(v*m + p-1); "
    "Narayanan et al. 2021 quote the same bubble relative to the ideal compute time: "
    "bubble_over_ideal = (p-1)/(v*m)"
)


# Zero-bubble (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 3.1): splitting the backward
# into input-gradient (B) and weight-gradient (W) passes and filling the warm-up/cool-down with W leaves
# (p-1)(T_F + T_B - T_W) idle per rank instead of 1F1B's (p-1)(T_F + T_B + T_W): a third when the three
# passes cost the same, which is the paper's working assumption.
ZERO_BUBBLE_SHARE = 1 / 3


def _bubble_slots(pp: int, schedule: str) -> float:
    return (pp - 1) * (ZERO_BUBBLE_SHARE if schedule == "zero-bubble" else 1.0)


def bubble_slots(pp: int, v: int = 1, schedule: str = "1f1b") -> float:
    """The bubble in slots (one micro-batch's forward and backward through a rank's v chunks): (p-1)/v, a third
    of it zero-bubble. The step's pipelined part is slot * (m + bubble_slots)."""
    return _bubble_slots(pp, schedule) / v if pp > 1 else 0.0


def bubble_fraction(pp: int, m: int, v: int = 1, schedule: str = "1f1b") -> float:
    """Idle fraction of the pipeline's time: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved,
    ((p-1)/3)/(v*m+(p-1)/3) zero-bubble.

    Narayanan et al. 2021, Sec. 2.2: the bubble lasts (p-1) forward+backward slots of one stage
    (1F1B and GPipe alike), or (p-1)/v slots with v interleaved chunks, against m slots of work."""
    if pp <= 1:
        return 0.0
    idle = _bubble_slots(pp, schedule)
    return idle / (v * m + idle)


def bubble_over_ideal(pp: int, m: int, v: int = 1, schedule: str = "1f1b") -> float:
    """Narayanan et al. 2021's "bubble time fraction": t_bubble / t_ideal = (p-1)/(v*m)."""
    if pp <= 1:
        return 0.0
    return _bubble_slots(pp, schedule) / (v * m)


def in_flight(schedule: str, pp: int, v: int, m: int, rank: int, weights: tuple[int, ...] | None = None) -> list[int]:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, per model chunk.

    - pp = 1: one micro-batch at a time (gradient accumulation frees each before the next).
    - gpipe: all m forward passes run before the first backward.
    - 1f1b (PipeDream-Flush): rank r runs p-r forwards before its first backward, so it holds
      min(p-r, m); the first stage holds p (Narayanan et al. 2021; Korthikanti et al. 2022, Sec. 4.2.3).
    - interleaved: torch's ScheduleInterleaved1F1B (the schedule the trainer runs; Megatron-LM's
      forward_backward_pipelining_with_interleaving differs only at m == p, where it runs every forward
      first) runs W = 2*(p-r-1) + (v-1)*p warm-up forwards (at most m*v), then alternates one forward
      (index W+k) and one backward (index k); forwards visit chunk (k // p) % v, backwards chunk
      v-1 - (k // p) % v. After the first steady forward the first rank holds W+1 = v*p + p - 1 chunk
      passes of L/(p*v) layers, L*(1 + (p-1)/(p*v)) layers' worth: Korthikanti et al.'s Sec. 4.2.3
      scaling. The total stays W+1 after every steady forward, but which chunks hold them rotates with
      period p*v; with unequal layers per chunk (`weights`) we scan one period and return the counts at
      the moment holding the most layers (the earliest such moment).
    """
    if pp <= 1:
        return [1] * v
    if schedule == "gpipe":
        return [m] * v
    # zero-bubble: counted as 1F1B (v = 1) or interleaved 1F1B. torch's warm-up is shorter, (p-r-1) +
    # (v-1)*p, but the weight passes it defers keep their inputs longer; not yet measured, so the plan keeps
    # the larger interleaved count (ZB-H1 is designed to have 1F1B's peak memory)
    if schedule not in ("interleaved", "zero-bubble") or v == 1:
        return [min(pp - rank, m)] + [0] * (v - 1)
    total = m * v
    warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, total)
    n = min(warmup + 1, total)  # forwards done at the first peak
    rounds, rem = divmod(n, pp * v)
    counts = [rounds * pp + min(pp, max(0, rem - c * pp)) for c in range(v)]
    if weights is None or n == total or len(set(weights)) == 1:
        return counts
    best, value, best_value = list(counts), 0, 0
    for k in range(min(pp * v, total - n)):  # one period of the steady state, or until forwards run out
        back = v - 1 - (k // pp) % v
        fwd = ((n + k) // pp) % v
        counts[back] -= 1
        counts[fwd] += 1
        value += weights[fwd] - weights[back]
        if value > best_value:
            best, best_value = list(counts), value
    return best

"""Pipeline schedules: the bubble, and how many micro-batches each pipeline rank keeps in flight.

Notation: p pipeline ranks, v model chunks per rank (virtual stages; 1 unless interleaved, 2 under ZBV), m
micro-batches per optimizer step per data-parallel replica.
"""

from __future__ import annotations

from functools import lru_cache

BUBBLE_DEFINITION = (
    "bubble_fraction = idle share of the pipelined part of the step = (p-1)/(v*m + p-1) (zero-bubble: (p-1)/3 "
    "in place of p-1; zbv: max(p-1, 2(2p-1-m))/3 with v = 2); "
    "Narayanan et al. 2021 quote the same bubble relative to the ideal compute time: "
    "bubble_over_ideal = (p-1)/(v*m)"
)


# Zero-bubble (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 3.1): splitting the backward
# into input-gradient (B) and weight-gradient (W) passes and filling the warm-up/cool-down with W leaves
# (p-1)(T_F + T_B - T_W) idle per rank instead of 1F1B's (p-1)(T_F + T_B + T_W): a third when the three
# passes cost the same, which is the paper's working assumption.
ZERO_BUBBLE_SHARE = 1 / 3


def zbv_idle_passes(pp: int, m: int) -> int:
    """Idle chunk passes per rank of torch's ScheduleZBVZeroBubble when F, B (input gradient) and W (weight
    gradient) of one chunk take the same time: max(p-1, 2*(2p-1-m)).

    ZB-V (Qi et al. 2023, Sec. 6) is designed to be bubble-free with equal F, B and W apart from the pipeline's
    fill; torch's order (read from its `_calculate_single_rank_operations`, rank r: 2(p-r)-1 forwards of chunk
    0, r pairs of chunk 1 and 0 forwards, then F-B-W) leaves rank r idle r passes at the start and p-1-r at the
    end once m >= 2p-1 (it pads its order to 2p-1 micro-batches and drops the padding, so each missing one
    adds 2 idle passes). Checked by simulating torch's own action lists (tests/unit/test_plan_pipeline.py)."""
    return max(pp - 1, 2 * (2 * pp - 1 - m))


def _bubble_slots(pp: int, schedule: str, m: int) -> float:
    """Idle time in chunk slots (one micro-batch's forward and backward through one chunk)."""
    if schedule == "zbv":
        return zbv_idle_passes(pp, m) / 3  # a chunk slot is F + B + W: three passes
    return (pp - 1) * (ZERO_BUBBLE_SHARE if schedule == "zero-bubble" else 1.0)


def bubble_slots(pp: int, v: int = 1, schedule: str = "1f1b", m: int = 0) -> float:
    """The bubble in slots (one micro-batch's forward and backward through a rank's v chunks): (p-1)/v, a third
    of it zero-bubble, zbv_idle_passes/6 under ZBV (v = 2; m micro-batches matter only there). The step's
    pipelined part is slot * (m + bubble_slots)."""
    return _bubble_slots(pp, schedule, m) / v if pp > 1 else 0.0


def drain_share(pp: int, v: int, schedule: str, m: int, backward_share: float) -> float:
    """The share of the bubble a pipeline rank waits out after its own last pass, averaged over the pipeline
    ranks: the drain, which a trainer sees in its step's final sync rather than in its pipeline receives.

    The last micro-batch's backward leaves the ranks one after the other, so the rank d stages from the first
    finishes d backward passes of a chunk before it; over the ranks that is (p-1)/2 such passes, of a bubble of
    (p-1) chunk slots: backward_share / 2 for GPipe, 1F1B and interleaved (`backward_share`: the backward's part
    of a forward + backward, about 2/3 without recompute). Under ZBV rank r ends p-1-r single passes (a third
    of a chunk slot) before the last: (p-1)/2 passes of zbv_idle_passes. Zero-bubble fills the tail with the
    deferred weight-gradient passes: no drain. Checked by replaying each schedule's order
    (tests/unit/test_plan_pipeline.py)."""
    if pp <= 1 or schedule == "zero-bubble":
        return 0.0
    if schedule == "zbv":
        return (pp - 1) / 2 / zbv_idle_passes(pp, m)
    return backward_share / 2


def reduce_exposed(reduce_s: float, pp: int, v: int, schedule: str, backward_s: float) -> float:
    """Seconds of a step's once-per-step gradient reduction (ZeRO 0/1) left after the last backward when the stack
    overlaps it as Megatron-Core's --overlap-grad-reduce does (megatron/core/pipeline_parallel/schedules.py,
    core_v0.8.0); `backward_s` is one micro-batch's backward through a pipeline rank's layers, all its chunks.

    - Without interleaving, the reduction of each gradient bucket starts as the last micro-batch's backward
      completes it (a later pipeline rank starts all of it after its last backward and runs it in the drain, which
      lasts as long): up to one micro-batch's backward hides it.
    - Interleaved, chunk c's reduction starts once chunk c's last micro-batch backward is done (grad_sync_func, the
      default --delay-grad-reduce, which aligns the starts across the pipeline ranks), not bucket by bucket within
      it. The backward finishes the chunks v-1, ..., 0, p micro-batches of each, and the reductions run one after
      another on the DP link: the j-th chunk from the end has j*p chunk backward passes (each backward_s/v) still
      to run at its start, so max over j of (j+1)*R/v - j*p*backward_s/v is left over, at least the last chunk's
      R/v."""
    if reduce_s <= 0:
        return 0.0
    if schedule != "interleaved" or v <= 1:
        return max(0.0, reduce_s - backward_s)
    per_chunk, chunk_pass = reduce_s / v, backward_s / v
    return max((j + 1) * per_chunk - j * pp * chunk_pass for j in range(v))


def bubble_fraction(pp: int, m: int, v: int = 1, schedule: str = "1f1b") -> float:
    """Idle fraction of the pipeline's time: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved,
    ((p-1)/3)/(v*m+(p-1)/3) zero-bubble, (i/3)/(2m+i/3) ZBV with i = zbv_idle_passes(p, m).

    Narayanan et al. 2021, Sec. 2.2: the bubble lasts (p-1) forward+backward slots of one stage
    (1F1B and GPipe alike), or (p-1)/v slots with v interleaved chunks, against m slots of work."""
    if pp <= 1:
        return 0.0
    idle = _bubble_slots(pp, schedule, m)
    return idle / (v * m + idle)


def bubble_over_ideal(pp: int, m: int, v: int = 1, schedule: str = "1f1b") -> float:
    """Narayanan et al. 2021's "bubble time fraction": t_bubble / t_ideal = (p-1)/(v*m)."""
    if pp <= 1:
        return 0.0
    return _bubble_slots(pp, schedule, m) / (v * m)


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
    - zbv: torch's ScheduleZBVZeroBubble, replayed (`zbv_order`); a micro-batch counts from its forward until
      its weight pass (the input-gradient pass frees part of it: an upper bound). Its steady state holds 2p
      chunk passes of L/(2p) layers on every rank, 1F1B's first-rank peak (Qi et al. 2023, Sec. 6), split
      (2p-r, r) or (2p-1-r, r+1) between chunk 0 (stage r) and chunk 1 (stage 2p-1-r); the moment holding the
      most layers is returned. It repeats every micro-batch, so replaying min(m, 2p) micro-batches suffices.
    """
    if pp <= 1:
        return [1] * v
    if schedule == "gpipe":
        return [m] * v
    if schedule == "zbv":
        return list(_zbv_in_flight(pp, min(m, 2 * pp), rank, weights or (1, 1)))
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


@lru_cache(maxsize=4096)
def _zbv_in_flight(pp: int, m: int, rank: int, weights: tuple[int, ...]) -> tuple[int, ...]:
    """in_flight's zbv replay, memoised: `plan --auto` asks the same (pp, m, rank, chunk layers) for every
    micro-batch size and node count that gives them."""
    return tuple(_peak(zbv_order(pp, m, rank), weights))


def zbv_order(pp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """Rank `rank`'s passes under torch's ScheduleZBVZeroBubble (`_calculate_single_rank_operations`, torch
    2.13), as (kind, chunk, micro-batch): F forward, B input gradient, W weight gradient; chunk 0 is stage
    rank, chunk 1 stage 2p-1-rank. torch pads the order to 2p-1 micro-batches and drops the padded passes.
    Checked against torch's own lists (tests/unit/test_plan_pipeline.py)."""
    n = max(2 * pp - 1, m)
    out: list[tuple[str, int, int]] = []
    f, b = [0, 0], [0, 0]

    def fwd(chunk: int) -> None:
        out.append(("F", chunk, f[chunk]))
        f[chunk] += 1

    def bw(chunk: int) -> None:  # input gradient then weight gradient of the same micro-batch
        out.extend((("B", chunk, b[chunk]), ("W", chunk, b[chunk])))
        b[chunk] += 1

    for _ in range(2 * (pp - rank) - 1):
        fwd(0)
    for _ in range(rank):
        fwd(1)
        fwd(0)
    for _ in range(pp - rank):
        fwd(1)
        bw(1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            fwd(0)
        bw(0)
        fwd(1)
        bw(1)
    w = list(b)  # cool-down: input gradients first, the weight gradients they defer after
    for _ in range(rank):
        out.extend((("B", 0, b[0]), ("B", 1, b[1])))
        b[0] += 1
        b[1] += 1
    for _ in range(pp - rank):
        out.extend((("B", 0, b[0]), ("W", 0, w[0])))
        b[0] += 1
        w[0] += 1
    out += [("W", 1, k) for k in range(w[1], b[1])] + [("W", 0, k) for k in range(w[0], b[0])]
    return [x for x in out if x[2] < m]


def _peak(order: list[tuple[str, int, int]], weights: tuple[int, ...]) -> list[int]:
    """Micro-batches held per chunk (forward done, weight pass not yet) at the moment holding the most layers,
    then the most micro-batches (a chunk of no layers still holds its embedding's or head's activations); the
    earliest such moment."""
    held, best = [0] * len(weights), [0] * len(weights)
    best_value: tuple[float, int] = (-1.0, -1)
    layers = passes = 0  # sum(held * weights), sum(held), kept as the passes go
    for kind, chunk, _ in order:
        step = 1 if kind == "F" else -1 if kind == "W" else 0
        held[chunk] += step
        layers += step * weights[chunk]
        passes += step
        if (layers, passes) > best_value:
            best, best_value = list(held), (layers, passes)
    return best

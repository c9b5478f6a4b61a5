"""`trainctl plan --auto --nodes LO..HI`: the best layout at each node count, the whole run's days, GPU-hours
and cost there, the Pareto front of days against GPU-hours, and the count an objective, deadline or budget picks.

Node counts: a geometric sweep of at most `counts` points from LO to HI (every count when the range holds no
more), each moved to a count nearer it than its neighbours where the spec rules leave a layout; LO and HI are
always searched, and HI is brought down to the most nodes any layout can use (auto.max_world). Why
geometric: the whole run's days and GPU-hours change with the ratio of node counts, not their difference, so
equal steps in log space show the front evenly; every count of 256..16384 would be 16,129 searches for a
front 64 show. A narrower range refines it. Each count's layout is auto.best_layout's (the same as `plan
--auto`'s first row there), with one shared Evaluator cache, so the parts of an evaluation that depend only on
the model and the layout's integers are computed once for the whole sweep.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainctl.errors import UsageError
from trainctl.plan.auto import Scored, best_layout, enumerate_shapes, max_world, search_context, zero_stages
from trainctl.plan.checkpoint_size import save_seconds
from trainctl.plan.estimate import Candidate, Evaluator
from trainctl.plan.plan import record_band, record_range, spec_mtbf, whole_run_plan
from trainctl.spec.models import RunSpec
from trainctl.units import figure

OBJECTIVES = ("time", "cost", "gpu-hours")
DEFAULT_COUNTS = 64
SNAP_TRIES = 4  # counts tried near each point of the geometric sweep before it is left out


@dataclass(frozen=True)
class Point:
    nodes: int
    best: Scored
    days: float  # expected wall clock of the whole run, failures and restarts included
    gpu_hours: float
    cost: float | None  # gpu_hours x cluster.gpu_hour_price; None without a price
    scored: int  # layouts scored in full (the rest skipped by the step floor)
    candidates: int

    @property
    def mfu(self) -> float:
        return self.best.mfu

    def as_dict(self) -> dict[str, Any]:
        c = self.best.cand
        return {"nodes": self.nodes, "gpus": c.tp * c.cp * c.pp * c.dp, "layout": c.describe(),
                "tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": c.dp, "ep": c.ep, "zero": c.zero,
                "offload": "optimizer" if c.offload else "none", "micro_batch": c.micro_batch,
                "schedule": c.schedule, "virtual_stages": c.virtual_stages, "sequence_parallel": c.sequence_parallel,
                "recompute": c.recompute,
                "step_time_s": self.best.est.step_time, "mfu": self.best.mfu, "days": self.days,
                "gpu_hours": self.gpu_hours, "cost": self.cost}


@dataclass(frozen=True)
class Sweep:
    name: str
    objective: str  # what picked the answer: an --objective, or "deadline" or "budget"
    node_range: tuple[int, int]
    points: list[Point]  # every count with a fitting layout, by node count
    empty: list[int]  # counts (or sweep points) where no layout exists or none fits
    front: list[Point]  # the Pareto front: no other point is both faster and cheaper
    answer: Point | None  # what the objective, deadline or budget picks
    why: str  # how the answer was picked
    priced: bool
    elapsed_s: float
    not_finishing: list[int]  # counts with a layout whose whole run is not expected to finish
    # the answer's whole run at the two ends of the published record's range on the GPU part (plan/record.py):
    # as plan's checkpoint.whole_run.record_range; None where the record does not apply
    record_range: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "objective": self.objective, "nodes": list(self.node_range),
                "why": self.why, "answer": self.answer.as_dict() if self.answer else None,
                "front": [p.as_dict() for p in self.front], "points": [p.as_dict() for p in self.points],
                "no_layout": self.empty, "not_finishing": self.not_finishing, "priced": self.priced,
                "candidates_scored": sum(p.scored for p in self.points),
                "candidates": sum(p.candidates for p in self.points), "elapsed_s": self.elapsed_s,
                "record_range": self.record_range}


def parse_nodes(text: str) -> tuple[int, int]:
    """`LO..HI` (or one count) -> (LO, HI); an empty or malformed range is a one-line usage error."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:\.\.\s*(\d+)\s*)?", text)
    if m is None:
        raise UsageError(f"--nodes {text!r}: expected LO..HI node counts, e.g. --nodes 16..512")
    lo, hi = int(m[1]), int(m[2] or m[1])
    if lo < 1 or hi < lo:
        raise UsageError(f"--nodes {text}: an empty range (LO must be >= 1 and <= HI), e.g. --nodes {min(lo, hi) or 1}"
                         f"..{max(lo, hi, 1)}")
    return lo, hi


def _amount(option: str, text: str, unit: str, example: str) -> tuple[float, str]:
    """`--OPTION` as a positive, finite number with an optional unit suffix -> (the number, the suffix as
    typed, lowercased; "" without one). One parser for --deadline and --budget: any float Python reads (1e6,
    5e+6, 2.5), never inf or nan."""
    m = re.fullmatch(rf"\s*(\S+?)\s*({unit})?\s*", text, re.IGNORECASE)
    try:
        value = float(m[1]) if m else math.nan
    except ValueError:
        value = math.nan
    if m is None or not math.isfinite(value) or value <= 0:
        raise UsageError(f"{option} {text!r}: expected a positive, finite amount, e.g. {example}")
    return value, (m[2] or "").lower()


def parse_deadline(text: str) -> float:
    """`30d`, `36h` or plain days -> days."""
    value, suffix = _amount("--deadline", text, "d|h", "30d or 36h")
    return value / (24.0 if suffix == "h" else 1.0)


def parse_budget(text: str, price: float | None) -> tuple[float, bool]:
    """`2e6gpuh` (GPU-hours) or a plain amount (currency, which needs cluster.gpu_hour_price) -> (amount, is
    GPU-hours)."""
    value, suffix = _amount("--budget", text, "gpuh", "GPU-hours as 2e6gpuh or money as 5e6")
    if not suffix and price is None:
        raise UsageError(f"--budget {text.strip()}: a money budget needs cluster.gpu_hour_price in the spec (--set "
                         f"cluster.gpu_hour_price=2.5), or give GPU-hours as {text.strip()}gpuh")
    return value, bool(suffix)


def node_counts(lo: int, hi: int, counts: int, has_layout: Callable[[int], bool]) -> tuple[list[int], list[int]]:
    """(The counts to search, those left out for want of a layout), each ascending. Every one of LO..HI when
    there are at most `counts`; else `counts` log-spaced points, each owning the counts nearer to it than to
    its neighbours (half the gap each side, so no two points share a count). LO and HI themselves are always
    searched (left out when they have no layout); in their window, or in any other point's, the SNAP_TRIES
    counts with the most factors of two, nearest the point first, are tried; none with a layout: the point is
    left out. No window is listed (see _most_even), so any range costs the same time and memory."""
    if hi - lo + 1 <= counts:
        every = [(n, has_layout(n)) for n in range(lo, hi + 1)]
        return [n for n, ok in every if ok], [n for n, ok in every if not ok]
    step = (math.log(hi) - math.log(lo)) / (counts - 1)
    xs = [lo * math.exp(i * step) for i in range(counts)]
    out: list[int] = []
    left_out: list[int] = []
    first = lo
    for i, x in enumerate(xs):
        last = hi if i == counts - 1 else min(hi, max(first - 1, math.floor((x + xs[i + 1]) / 2)))
        if first > last:  # a point closer to its neighbour than one count (the low end of a wide range)
            continue
        ends = [n for n in (lo, hi) if first <= n <= last]
        found = next((n for n in ends if has_layout(n)), None)
        left_out += [n for n in ends if n != found]
        if found is None:
            found = next((n for n in _most_even(first, last, x, SNAP_TRIES, skip=ends) if has_layout(n)), None)
            if found is None and not ends:
                left_out.append(min(max(round(x), first), last))
        if found is not None:
            out.append(found)
        first = last + 1
    return out, left_out


def _most_even(first: int, last: int, x: float, n: int, skip: list[int]) -> list[int]:
    """The n counts of first..last (but `skip`) with the most factors of two, nearest x first: they divide into
    the most layouts. For each power of two 2^k from the largest down, the odd multiples of 2^k nearest x (a
    handful around x / 2^k), so the cost grows with log2(last), never with the window's width."""
    out: list[int] = []
    for k in range(last.bit_length() - 1, -1, -1):
        size = 1 << k
        low, high = -(-first // size), last // size  # the multiples of 2^k in the window: low..high times 2^k
        if low > high:
            continue
        mid = min(max(round(x / size), low), high)
        odd = [m * size for m in range(max(low, mid - 2 * n - 1), min(high, mid + 2 * n + 1) + 1)
               if m % 2 and m * size not in skip]
        out += sorted(odd, key=lambda c: (abs(c - x), c))[:n - len(out)]
        if len(out) >= n:
            break
    return out


def _most_nodes(spec: RunSpec, nodes: tuple[int, int]) -> int:
    """The most nodes any layout of the spec's model and batch can use (auto.max_world): no count above has
    one, so the sweep spans LO..min(HI, this); a range wholly above it is a one-line UsageError."""
    world, why = max_world(spec)
    gpn = spec.cluster.gpus_per_node
    top = world // gpn
    if nodes[0] > top:
        fix = f"give --nodes 1..{top}" if top >= 1 else f"set cluster.gpus_per_node to {world} or fewer"
        raise UsageError(f"--nodes {nodes[0]}..{nodes[1]}: no layout exists above {top:,} nodes of {gpn} GPUs, as "
                         f"{why} ({world:,} GPUs at most); {fix}")
    return top


def spec_at(spec: RunSpec, nodes: int) -> RunSpec:
    """The spec on `nodes` nodes (no validation: the search enumerates layouts by the rules itself)."""
    return spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"nodes": nodes})})


def _whole_run(spec: RunSpec, c: Candidate, step: float) -> dict[str, Any]:
    """plan's whole-run block for the layout `c` of `spec` (checkpoint size follows its tp)."""
    laid = spec.model_copy(update={"parallel": spec.parallel.model_copy(update={"tp": c.tp})})
    blocking, total = save_seconds(laid)
    mtbf, _ = spec_mtbf(laid)
    run = whole_run_plan(laid, step_time=step, blocking_s=blocking, save_s=total, mtbf_s=mtbf)
    assert run is not None  # a step time was given
    return run


def pareto(points: list[Point]) -> list[Point]:
    """The points no other point beats on both days and GPU-hours (cost is GPU-hours x one price)."""
    front, cheapest = [], math.inf
    for p in sorted(points, key=lambda p: (p.days, p.gpu_hours)):
        if p.gpu_hours < cheapest:
            front.append(p)
            cheapest = p.gpu_hours
    return front


def sweep(spec: RunSpec, *, nodes: tuple[int, int], counts: int = DEFAULT_COUNTS, objective: str = "time",
          deadline_days: float | None = None, budget: tuple[float, bool] | None = None,
          progress: Callable[[int, int, int], None] | None = None) -> Sweep:
    """Search each node count (module docstring); `progress(done, total, nodes)` after each."""
    t0 = time.perf_counter()
    lo, hi = nodes
    price = spec.cluster.gpu_hour_price
    if objective not in OBJECTIVES:
        raise UsageError(f"--objective {objective}: expected one of {', '.join(OBJECTIVES)}")
    if objective == "cost" and price is None:
        raise UsageError("--objective cost needs cluster.gpu_hour_price in the spec (--set "
                         "cluster.gpu_hour_price=2.5), or use --objective gpu-hours")
    _refuse_unusable(spec, nodes)
    shapes: dict[int, list[Candidate]] = {}  # per node count: its layouts, without ZeRO/offload variants

    def has_layout(n: int) -> bool:
        if n not in shapes:
            shapes[n] = enumerate_shapes(spec_at(spec, n), {})
        return bool(shapes[n])

    top = _most_nodes(spec, nodes)
    chosen, empty = node_counts(lo, min(hi, top), counts, has_layout)
    if hi > top:
        empty.append(hi)  # the range's end, past every layout (_most_nodes)
    shared: Evaluator | None = None
    points: list[Point] = []
    never: dict[int, str] = {}  # counts whose whole run is not expected to finish: why
    for i, n in enumerate(chosen):
        at = spec_at(spec, n)
        ctx, _ = search_context(at)
        ev = Evaluator(ctx) if shared is None else shared.for_context(ctx)
        shared = shared or ev
        best, scored = best_layout(at, ev, shapes[n])
        if best is None or not best.est.step_time:
            empty.append(n)
        else:
            run = _whole_run(at, best.cand, best.est.step_time)
            if not run["finishes"]:  # no days or GPU-hours to rank it by
                never[n] = run["not_finishing"]
            else:
                points.append(Point(nodes=n, best=best, days=run["wall_days"]["mean"], gpu_hours=run["gpu_hours"],
                                    cost=run["cost"], scored=scored,
                                    candidates=sum(len(zero_stages(shape)) for shape in shapes[n])))
        if progress is not None:
            progress(i + 1, len(chosen), n)
    if not points and never:
        largest = max(never)
        raise UsageError(f"--nodes {lo}..{hi}: no node count is expected to finish the run; at {largest:,} nodes "
                         f"{never[largest]}")
    answer, why = _pick(points, objective, deadline_days, budget, price, nodes)
    picked_by = "deadline" if deadline_days is not None else "budget" if budget is not None else objective
    return Sweep(name=spec.name, objective=picked_by, node_range=nodes, points=points, empty=sorted(empty),
                 front=pareto(points), answer=answer, why=why, priced=price is not None,
                 elapsed_s=time.perf_counter() - t0, not_finishing=sorted(never),
                 record_range=_record_range(spec, answer))


def _record_range(spec: RunSpec, answer: Point | None) -> dict[str, Any] | None:
    """The answer's whole run again at the step times the record's lowest and highest ratio (plan.record_band)."""
    band = record_band(spec)
    if band is None or answer is None:
        return None
    at, step = spec_at(spec, answer.nodes), answer.best.est.step_time
    return record_range(band, lambda ratio: _whole_run(at, answer.best.cand, step * ratio))


def _refuse_unusable(spec: RunSpec, nodes: tuple[int, int]) -> None:
    """Node counts the spec cannot run on, or cannot price, are not swept: one line with the fix. The local
    backend runs on one node; a staged run changes shape; a peak unknown to the catalog (a CPU) gives no step
    time in seconds, only a rank (plan --auto's nominal 1 TFLOP/s), so days and GPU-hours would be invented."""
    lo, hi = nodes
    if spec.train.stages:  # the sweep's whole run prices one shape; a staged run's would be another run's
        raise UsageError(f"--nodes {lo}..{hi}: the node sweep prices one shape, not train.stages' "
                         f"{len(spec.train.stages)}; plan the staged run at each node count (--set cluster.nodes=N, "
                         "with each stage's dp), or sweep one stage's spec")
    if spec.launcher.backend == "local" and hi > 1:
        raise UsageError(f"--nodes {lo}..{hi}: launcher.backend local runs on one node; sweep node counts of a "
                         "Slurm run (--set launcher.backend=slurm), or use --nodes 1")
    if not search_context(spec)[1]:
        raise UsageError(f"--nodes {lo}..{hi}: no step time in seconds for {spec.cluster.gpu} (its peak FLOP/s is not "
                         "in the catalog), so no days or GPU-hours: price it with --calibration PROFILE (trainctl "
                         "calibrate SPEC) or --set cluster.peak_tflops=N")


def _pick(points: list[Point], objective: str, deadline_days: float | None, budget: tuple[float, bool] | None,
          price: float | None, nodes: tuple[int, int]) -> tuple[Point | None, str]:
    """The answer: with a deadline the cheapest count that meets it, with a budget the fastest within it, else
    the objective's best. A deadline or budget no count meets is a UsageError saying by how much."""
    span = f"{nodes[0]}..{nodes[1]}"
    if not points:
        raise UsageError(f"--nodes {span}: no node count in the range has a layout that fits; widen --nodes")
    fastest = min(points, key=lambda p: (p.days, p.gpu_hours))
    cheapest = min(points, key=lambda p: (p.gpu_hours, p.days))
    if deadline_days is not None:
        meets = [p for p in points if p.days <= deadline_days]
        if not meets:
            raise UsageError(f"--deadline {figure(deadline_days)}d: no node count in {span} meets it; the fastest, "
                             f"{fastest.nodes} nodes, takes {figure(fastest.days)} days "
                             f"({figure(fastest.days - deadline_days)} over): raise --nodes' upper end or the deadline")
        best = min(meets, key=lambda p: (p.gpu_hours, p.days))
        return best, f"the cheapest count that finishes within {figure(deadline_days)} days"
    if budget is not None:
        amount, in_gpu_hours = budget
        spend = (lambda p: p.gpu_hours) if in_gpu_hours else (lambda p: p.cost or 0.0)
        unit = "GPU-hours" if in_gpu_hours else "(cost)"
        within = [p for p in points if spend(p) <= amount]
        if not within:
            low = spend(cheapest)
            raise UsageError(f"--budget {figure(amount)} {unit}: no node count in {span} fits it; the cheapest, "
                             f"{cheapest.nodes} nodes, needs {figure(low)} {unit} ({figure(low - amount)} over): raise "
                             "the budget or lower --nodes' lower end")
        return min(within, key=lambda p: (p.days, p.gpu_hours)), f"the fastest count within {figure(amount)} {unit}"
    if objective == "time":
        return fastest, "objective time: the fewest days"
    return cheapest, f"objective {objective}: the fewest GPU-hours" + (" (cost = GPU-hours x price)"
                                                                        if objective == "cost" else "")

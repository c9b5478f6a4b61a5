"""`mfu-report SWEEP` over model size and tokens: the final loss against training compute, fitted as a power law.
No torch, no numpy: a two-parameter least squares has a closed form.

    L(C) = a * C^(-b)            fitted by least squares of log L on log C (a straight line in log space)
    L(C) = E + a * C^(-b)        with an irreducible loss E, only from MIN_POINTS_IRREDUCIBLE points on: for
                                 each E in (0, min L) the line through log(L - E) is closed-form; E is the one
                                 whose line leaves the least squared log residual (a golden-section search)

C is each run's training compute by its own FLOP count (metrics.jsonl's model_flops_per_step, the MFU
convention 6N + 12*L*h*s per token, times the steps it completed), L its final loss (its last step's). A sweep
qualifies when its grid varies the model or the tokens trained (SIZE_KEYS, TOKEN_KEYS) and at least
MIN_POINTS runs at MIN_DISTINCT different computes have both figures. The fit says which form it used and
every point it used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

SIZE_PREFIX = "model."  # any model field: preset, layers, hidden...
TOKEN_KEYS = ("train.steps", "train.tokens", "train.global_batch", "model.seq_len")
MIN_POINTS = 3  # a line through two points fits them exactly: no check of the law at all
MIN_DISTINCT = 2
MIN_POINTS_IRREDUCIBLE = 5  # three parameters: at least two points left over to test them
AT_ZERO = 1e-6  # an irreducible loss below this fraction of the lowest loss is the search's lower bound: none


def qualifies(grid: dict[str, Any]) -> bool:
    return any(k.startswith(SIZE_PREFIX) or k in TOKEN_KEYS for k in grid)


def line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares y = c0 + c1*x: (c0, c1, sum of squared residuals). Needs two distinct xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    c1 = sxy / sxx
    c0 = my - c1 * mx
    return c0, c1, sum((y - c0 - c1 * x) ** 2 for x, y in zip(xs, ys, strict=True))


def power_law(compute: Sequence[float], loss: Sequence[float]) -> dict[str, float]:
    """L = a*C^-b: {a, b, sse (of log L)}."""
    c0, c1, sse = line([math.log(c) for c in compute], [math.log(v) for v in loss])
    return {"a": math.exp(c0), "b": -c1, "irreducible": 0.0, "sse": sse}


def with_irreducible(compute: Sequence[float], loss: Sequence[float]) -> dict[str, float]:
    """L = E + a*C^-b: E in (0, min L) by golden-section search on the log residual of the line through
    log(L - E) (unimodal in practice for loss curves that flatten); {a, b, irreducible, sse}."""
    xs = [math.log(c) for c in compute]

    def sse(e: float) -> float:
        return line(xs, [math.log(v - e) for v in loss])[2]

    lo, hi = 0.0, min(loss) * (1 - 1e-9)
    g = (math.sqrt(5) - 1) / 2
    x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
    f1, f2 = sse(x1), sse(x2)
    for _ in range(200):
        if f1 < f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - g * (hi - lo)
            f1 = sse(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + g * (hi - lo)
            f2 = sse(x2)
    e = (lo + hi) / 2
    c0, c1, s = line(xs, [math.log(v - e) for v in loss])
    return {"a": math.exp(c0), "b": -c1, "irreducible": e, "sse": s}


def fit(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fit of `points` ({dir, compute, loss}); None (with the reason in "note") when there are too few."""
    used = [p for p in points if p.get("compute") and p.get("loss") and p["loss"] > 0 and p["compute"] > 0]
    if len(used) < MIN_POINTS or len({p["compute"] for p in used}) < MIN_DISTINCT:
        return {"fitted": False, "points": used,
                "note": f"no fit: {len(used)} runs with a final loss and a compute (at least {MIN_POINTS} at "
                        f"{MIN_DISTINCT} computes are needed)"}
    compute, loss = [p["compute"] for p in used], [p["loss"] for p in used]
    tried = len(used) >= MIN_POINTS_IRREDUCIBLE
    f = with_irreducible(compute, loss) if tried else power_law(compute, loss)
    at_bound = tried and f["irreducible"] < AT_ZERO * min(loss)  # the points show no floor: the plain law
    if at_bound:
        f = power_law(compute, loss)
    irreducible = tried and not at_bound
    form = "L = E + a*C^-b" if irreducible else "L = a*C^-b"
    for p in used:
        p["fitted_loss"] = f["irreducible"] + f["a"] * p["compute"] ** -f["b"]
    text = (f"{f['irreducible']:.4g} + " if irreducible else "") + f"{f['a']:.4g} * C^-{f['b']:.4g}"
    why = (f"with an irreducible term ({len(used)} points)" if irreducible else
           "without an irreducible term (tried: its best value is 0, the points show no floor)" if at_bound else
           f"without an irreducible term (it needs {MIN_POINTS_IRREDUCIBLE} points, {len(used)} here)")
    return {"fitted": True, "form": form, **f, "points": used,
            "line": f"final loss against training compute C (FLOPs): L = {text}, {why}; least squares in log "
                    f"space over {len(used)} runs"}


def points_of(comparison: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A sweep's comparison rows (report/sweep.py) as fit points: compute = model FLOPs per step x steps."""
    return [{"dir": r["dir"], "values": r["values"], "loss": r["final_loss"],
             "compute": (r["model_flops_per_step"] * r["steps"]) if r.get("model_flops_per_step") else None}
            for r in comparison]

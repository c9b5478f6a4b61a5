"""Skipped steps, rollbacks, divergence and loss spikes of a run, for `mfu-report` (the trainer's divergence
guard is trainctl/runtime/train/divergence.py). Pure functions over RunData."""

from __future__ import annotations

import math
import statistics
from typing import Any

from trainctl.report.load import RunData

SPIKE_SIGMA = 4.0  # a loss this many standard deviations above the running mean is a spike
SPIKE_WINDOW = 20  # of the previous finite, applied steps
SPIKE_MIN_HISTORY = 5  # fewer previous steps: too little to judge
SPIKE_RULE = (f"loss > mean + {SPIKE_SIGMA:g} sigma of the previous {SPIKE_WINDOW} applied steps "
              f"(at least {SPIKE_MIN_HISTORY})")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def loss_spikes(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Steps whose loss jumps above the running mean by SPIKE_SIGMA standard deviations (records in step
    order; skipped and non-finite steps are neither judged nor part of the history)."""
    history: list[float] = []
    out = []
    for r in records:
        loss = r.get("loss")
        if r.get("skipped") or not _finite(loss):
            continue
        window = history[-SPIKE_WINDOW:]
        if len(window) >= SPIKE_MIN_HISTORY:
            mean, sd = statistics.fmean(window), statistics.pstdev(window)
            if sd > 0 and loss > mean + SPIKE_SIGMA * sd:
                out.append({"step": r["step"], "loss": loss, "running_mean": mean, "sigma": sd,
                            "sigmas_above": (loss - mean) / sd})
        history.append(float(loss))
    return out


def divergence(run: RunData, final: list[dict[str, Any]]) -> dict[str, Any]:
    """What the divergence guard did (skips, rollbacks, the stop) and the loss spikes of the final curve."""
    skipped = {r["step"] for r in run.metrics if r.get("skipped")}
    skipped |= {e["step"] for e in run.events_of("step_skipped") if isinstance(e.get("step"), int)}
    # a trainer without the guard logs a non-finite step as if applied: still a step to mark
    non_finite = sorted({r["step"] for r in final if not r.get("skipped") and not _finite(r.get("loss"))})
    diverged = run.events_of("diverged")
    last = diverged[-1] if diverged else None
    return {
        "skipped_steps": sorted(skipped),
        "non_finite_steps": non_finite,
        "rollbacks": [{k: e.get(k) for k in ("step", "to_step", "batches", "skipped_batches")}
                      for e in run.events_of("rollback")],
        "diverged": None if last is None else {
            "step": last.get("step"), "first_skipped_step": last.get("first_skipped_step"),
            "skipped_in_row": last.get("skipped_in_row"),
            "last_finite_checkpoint": last.get("last_finite_checkpoint")},
        "loss_spikes": loss_spikes(final),
        "spike_rule": SPIKE_RULE,
    }


def _steps(xs: list[int], limit: int = 12) -> str:
    return ", ".join(map(str, xs[:limit])) + (f", ... ({len(xs)} in all)" if len(xs) > limit else "")


def warnings(d: dict[str, Any]) -> list[str]:
    out = []
    if d["diverged"]:
        x = d["diverged"]
        kept = x.get("last_finite_checkpoint")
        out.append(f"diverged at step {x['step']}: the loss or gradient norm was NaN/inf for {x['skipped_in_row']} "
                   f"steps in a row (since step {x['first_skipped_step']}); last finite checkpoint "
                   f"{f'step {kept}' if kept else 'none'}")
    if d["skipped_steps"]:
        out.append(f"{len(d['skipped_steps'])} step(s) skipped for a non-finite loss or gradient norm (no optimizer "
                   f"update): {_steps(d['skipped_steps'])}")
    if d["non_finite_steps"]:
        out.append(f"non-finite loss logged as an applied step (a trainer without the divergence guard): "
                   f"{_steps(d['non_finite_steps'])}")
    for r in d["rollbacks"]:
        b = r.get("batches") or [None, None]
        out.append(f"rolled back at step {r['step']} to checkpoint step {r['to_step']}, skipping data batches "
                   f"{b[0]}-{b[1]}")
    if d["loss_spikes"]:
        out.append(f"loss spikes ({d['spike_rule']}) at steps {_steps([s['step'] for s in d['loss_spikes']])}")
    return out


def cell(d: dict[str, Any]) -> str:
    """The summary table's cell: skipped steps / loss spikes (/ rollbacks, diverged)."""
    text = f"{len(d['skipped_steps'])} / {len(d['loss_spikes'])}"
    if d["rollbacks"]:
        text += f", {len(d['rollbacks'])} rollback(s)"
    if d["diverged"]:
        text += f", DIVERGED at step {d['diverged']['step']}"
    return text

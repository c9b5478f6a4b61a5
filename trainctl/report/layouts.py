"""Which attempts ran under which spec and plan. A `resume --set` that changes the layout (tp, dp, the GPU
count) starts attempts that the launch's plan does not describe: each group of attempts is held against its
own plan, and every figure derived from steps says which attempts it covers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainctl.report.attempts import Attempt
from trainctl.report.load import Layout, RunData
from trainctl.rundir.steptimes import RankSteps


@dataclass
class Segment:
    """Consecutive attempts that ran under one layout."""

    layout: Layout
    attempts: list[Attempt]
    indices: set[int] = dataclasses.field(default_factory=set)  # of run.layouts: changes that left the plan as it was

    @property
    def label(self) -> str:
        first, last = self.attempts[0].index, self.attempts[-1].index
        return f"attempt {first}" if first == last else f"attempts {first}-{last}"

    def describe(self) -> str:
        """'tp=1 pp=1 dp=2' from the plan (the spec's parallel section without one)."""
        shape = (self.layout.plan or {}).get("layout") or ((self.layout.spec or {}).get("parallel") or {})
        shown = [k for k in ("tp", "pp", "cp", "ep", "dp") if k in ("tp", "pp", "dp") or (shape.get(k) or 1) > 1]
        return " ".join(f"{k}={shape[k]}" for k in shown if shape.get(k) is not None)


def _layout_at(run: RunData, t: float | None) -> int:
    """The index of the layout in effect at time t (the newest without a time)."""
    if t is None or not run.layouts:
        return max(0, len(run.layouts) - 1)
    return max((i for i, x in enumerate(run.layouts) if x.since <= t), default=0)


def _per_step(plan: dict[str, Any] | None) -> dict[str, Any] | None:
    """A plan without its whole-run figures, which change with train.steps alone (plan/whole_run.py): what a
    step runs under."""
    if not plan or "whole_run" not in (plan.get("checkpoint") or {}):
        return plan
    return {**plan, "checkpoint": {k: v for k, v in plan["checkpoint"].items() if k != "whole_run"}}


def segments(run: RunData, attempts: list[Attempt]) -> list[Segment]:
    """The attempts grouped by the layout they ran under, in order; layouts no attempt ran are left out."""
    if not run.layouts:
        return [Segment(Layout(float("-inf"), run.spec, run.plan, "spec.yaml"), list(attempts))]
    out: list[Segment] = []
    for a in attempts:
        i = _layout_at(run, a.start_t if a.start_t is not None else a.begin_t)
        same = out and (i in out[-1].indices or (run.layouts[i].plan is not None
                                                  and _per_step(run.layouts[i].plan) == _per_step(out[-1].layout.plan)))
        if not same:  # a change the plan does not see (train.steps, a data path) goes on in the same segment
            out.append(Segment(run.layouts[i], []))
        out[-1].indices.add(i)
        out[-1].attempts.append(a)
    return out


def _steps_of(run: RunData, seg: Segment) -> dict[int, RankSteps]:
    """Each rank's step times from the starts under one segment's layouts (a start's header records its time)."""
    out = {}
    for rank, rs in run.steptimes.items():
        keep = {i for i, h in enumerate(rs.headers) if _layout_at(run, h.get("time")) in seg.indices}
        rows = [r for r in rs.rows if r["attempt"] in keep]
        if rows:
            out[rank] = dataclasses.replace(rs, rows=rows)
    return out


def view(run: RunData, seg: Segment) -> RunData:
    """The run as far as one segment goes: its steps, its per-rank step times, its spec and plan."""
    if len(run.layouts) < 2:
        return run
    latest = run.layouts[max(seg.indices)]  # its spec: train.steps as last set
    return dataclasses.replace(run, metrics=[r for a in seg.attempts for r in a.records], plan=seg.layout.plan,
                               spec=latest.spec, steptimes=_steps_of(run, seg))


def kept_in(seg: Segment, final: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps whose last run was in this segment."""
    mine = {id(r) for a in seg.attempts for r in a.records}
    return [r for r in final if id(r) in mine]

"""Read everything a run directory holds that the report needs. No torch: plain JSON/YAML files."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainctl import steptimes
from trainctl.errors import UsageError
from trainctl.rundir import RunPaths, load_jsonl
from trainctl.steptimes import RankSteps


@dataclass
class RunData:
    root: Path
    name: str
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]]
    plan: dict[str, Any] | None
    job: dict[str, Any] | None
    spec: dict[str, Any] | None
    steptimes: dict[int, RankSteps]
    placement: list[dict[str, Any]]  # rank -> node/GPU, from RUN/placement.json or the plan
    skipped: list[str] = field(default_factory=list)  # 'metrics.jsonl: skipped N unreadable lines (...)'

    def events_of(self, *kinds: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") in kinds]


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _placement(paths: RunPaths, plan: dict[str, Any] | None) -> list[dict[str, Any]]:
    data = _json(paths.placement)
    if isinstance(data, dict):  # {"ranks": [...]} or {"placement": [...]}
        data = data.get("ranks") or data.get("placement")
    if isinstance(data, list) and all(isinstance(x, dict) and "rank" in x for x in data):
        return data
    if plan and isinstance(plan.get("placement"), list):
        return plan["placement"]
    return []


def repriced_plan(paths: RunPaths, profile: Path) -> dict[str, Any]:
    """The run's plan priced again with a calibration profile (`mfu-report --calibration`): a run launched
    before its cluster was calibrated is held against the measured rates. A profile for other hardware or
    another rank count is refused as `plan` refuses it."""
    from trainctl.launch.create import build_plan_json
    from trainctl.spec import load_spec

    return json.loads(build_plan_json(load_spec(paths.spec).with_calibration(profile)))


def load_run(root: Path, calibration: Path | None = None) -> RunData:
    if not root.is_dir():
        raise UsageError(f"{root}: no such run directory", hint="give the directory `trainctl launch` created")
    paths = RunPaths(root)
    metrics_read, events_read = load_jsonl(paths.metrics), load_jsonl(paths.events)
    metrics = [m for m in metrics_read.records if isinstance(m.get("step"), int)]
    events = sorted(events_read.records, key=lambda e: e.get("time", 0.0))
    skipped = [n for n in (metrics_read.skipped_note(paths.metrics), events_read.skipped_note(paths.events)) if n]
    if not metrics and not events:
        raise UsageError(f"{root}: no {paths.metrics.name} or {paths.events.name}: not a run directory, or the run "
                         "never started",
                         hint=f"`trainctl launch` writes them; check RUN/{paths.logs.name}/ for why the job did not "
                              "start")
    spec = None
    with contextlib.suppress(OSError, yaml.YAMLError):
        spec = yaml.safe_load(paths.spec.read_text(encoding="utf-8"))
    plan = _json(paths.plan) if calibration is None else repriced_plan(paths, calibration)
    name = (spec or {}).get("name") or root.name
    return RunData(root=root, name=str(name), metrics=metrics, events=events, plan=plan, job=_json(paths.job),
                   spec=spec if isinstance(spec, dict) else None, steptimes=steptimes.read(paths),
                   placement=_placement(paths, plan), skipped=skipped)

"""Read everything a run directory holds that the report needs. No torch: plain JSON/YAML files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainctl.errors import RunError, UsageError
from trainctl.rundir import steptimes
from trainctl.rundir.paths import RunPaths, load_jsonl, read_yaml
from trainctl.rundir.runstate import attempt_begin, in_time_order, outcome, since
from trainctl.rundir.steptimes import RankSteps


@dataclass
class Layout:
    """A spec and its plan that attempts of the run ran under: the launch's, then one per `resume --set`
    (trainctl/launch/resume.py keeps the replaced ones as spec.prev-<n>.yaml and plan.prev-<n>.json)."""

    since: float  # from this time on (the spec_changed event's; -inf for the launch's)
    spec: dict[str, Any] | None
    plan: dict[str, Any] | None
    spec_file: str
    overrides: list[str] = field(default_factory=list)  # the `--set`s that began it


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
    layouts: list[Layout] = field(default_factory=list)  # in time order; spec and plan are the last one's

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


def repriced_plan(spec_file: Path, profile: Path) -> dict[str, Any]:
    """The run's plan priced again with a calibration profile (`mfu-report --calibration`): a run launched
    before its cluster was calibrated is held against the measured rates. A profile for other hardware or
    another rank count is refused as `plan` refuses it."""
    from trainctl.launch.create import build_plan_json
    from trainctl.spec import load_spec

    return json.loads(build_plan_json(load_spec(spec_file).with_calibration(profile)))


def _layouts(paths: RunPaths, events: list[dict[str, Any]], calibration: Path | None) -> list[Layout]:
    """The launch's spec and plan, then each `resume --set`'s. A change recorded without its previous plan
    (an older trainctl rewrote only spec.yaml) leaves plan.json to the launch's layout and none to the later."""
    changes = [e for e in events if e.get("event") == "spec_changed" and e.get("previous")]

    def plan_of(spec_file: str, plan_file: str | None, latest: bool) -> dict[str, Any] | None:
        if plan_file is None:
            return None
        if calibration is not None:
            try:
                return repriced_plan(paths.root / spec_file, calibration)
            except UsageError:
                if latest:  # the profile does not fit the run as it is now: refused, as `plan` refuses it
                    raise
                # an earlier layout the profile was not measured for (another rank count): its own plan, which
                # says how it was priced (step_vs_plan's "times priced with")
        return _json(paths.root / plan_file)

    moved = [e.get("previous_plan") for e in changes]
    files = [(str(e["previous"]), m if m or "previous_plan" in e else (paths.plan.name if i == 0 else None))
             for i, (e, m) in enumerate(zip(changes, moved, strict=True))]
    files.append((paths.spec.name, paths.plan.name if not changes or "previous_plan" in changes[-1] else None))
    since = [float("-inf"), *(float(e.get("time", 0.0)) for e in changes)]
    sets = [[], *([str(x) for x in e.get("overrides") or []] for e in changes)]
    return [Layout(since=t, spec=read_yaml(paths.root / spec_file),
                   plan=plan_of(spec_file, plan_file, latest=i == len(files) - 1), spec_file=spec_file, overrides=o)
            for i, (t, (spec_file, plan_file), o) in enumerate(zip(since, files, sets, strict=True))]


def why_no_step(events: list[dict[str, Any]]) -> str:
    """Why a run has no step to report: its latest attempt's outcome in runstate's words."""
    ended = outcome(since(events, attempt_begin(events)))
    if ended is not None:
        return ended.reason
    if any(e.get("event") == "start" for e in events):
        return "the trainer started but logged no step yet (still in its first step, or killed in it)"
    return "the trainer has not started (still starting, or killed before it began)"


def load_run(root: Path, calibration: Path | None = None) -> RunData:
    if not root.is_dir():
        raise UsageError(f"{root}: no such run directory", hint="give the directory `trainctl launch` created")
    paths = RunPaths(root)
    metrics_read, events_read = load_jsonl(paths.metrics), load_jsonl(paths.events)
    metrics = [m for m in metrics_read.records if isinstance(m.get("step"), int)]
    events = in_time_order(events_read.records)
    skipped = [n for n in (metrics_read.skipped_note(paths.metrics), events_read.skipped_note(paths.events)) if n]
    if not metrics and not events:
        raise UsageError(f"{root}: no {paths.metrics.name} or {paths.events.name}: not a run directory, or the run "
                         "never started",
                         hint=f"`trainctl launch` writes them; check RUN/{paths.logs.name}/ for why the job did not "
                              "start")
    if not metrics:
        raise RunError(f"{root}: no step ran, nothing to report: {why_no_step(events)}",
                       hint=f"`trainctl status {root}` and the logs under RUN/{paths.logs.name}/ say more")
    layouts = _layouts(paths, events, calibration)
    spec, plan = layouts[-1].spec, layouts[-1].plan
    name = (spec or {}).get("name") or root.name
    return RunData(root=root, name=str(name), metrics=metrics, events=events, plan=plan, job=_json(paths.job),
                   spec=spec, steptimes=steptimes.read(paths), placement=_placement(paths, plan), skipped=skipped,
                   layouts=layouts)

"""`trainctl sweep`: one spec over a grid of overrides -> ordinary run directories under one sweep directory.
No torch.

Every run of a sweep is a run like a `launch`ed one: the same backend prepares it (every check of a launch),
creates its directory and starts it, so `status`, `cancel`, `resume` and `mfu-report` take each run on its
own. The sweep adds its record (trainctl/rundir/sweep_record.py) and, on Slurm, one job array whose element
i runs run-i's own batch script (trainctl/launch/slurm/array.py), so each element keeps the run's
preemption/requeue chain. Locally the runs go one after another.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from trainctl.errors import EXIT_DIVERGED, EXIT_OK, EXIT_RUN_FAILED, EXIT_STOPPED, SpecError, UsageError
from trainctl.fileio import require_writable
from trainctl.launch.backend import Say, backend_for, note
from trainctl.launch.create import check_run_dir, now_iso
from trainctl.rundir import sweep_record as rec
from trainctl.rundir.paths import append_jsonl, read_jsonl

if TYPE_CHECKING:
    from trainctl.spec import RunSpec

CANCEL_REQUESTED = "cancel_requested"  # SWEEP/events.jsonl: no further run of a local sweep starts
STARTED = "sweep_start"  # a `sweep` or `resume SWEEP` began working through the runs


@dataclass(frozen=True)
class SweepPoint:
    index: int
    values: dict[str, str]  # grid key -> value, as given
    spec: RunSpec

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.values.items()]


def parse_grid(items: Sequence[str], sweep_file: Path | None) -> tuple[dict[str, list[str]], list[str]]:
    """--grid KEY=V1,V2 items and a sweep file's `grid:` mapping -> ({key: values}, the problems: every
    malformed item, duplicate key and empty value list; `expand` reports them with the values' own)."""
    problems: list[str] = []
    grid: dict[str, list[str]] = {}

    def add(key: str, values: list[str], where: str) -> None:
        if key in grid:
            problems.append(f"{where}: {key} is given twice. Fix: give each key once, with all its values")
        elif not values or any(v == "" for v in values):
            problems.append(f"{where}: {key} has an empty value (the grid would be empty or hold a blank). "
                            f"Fix: give values separated by commas, e.g. {key}=1,2")
        else:
            grid[key] = values

    if sweep_file is not None:
        for key, values in _read_sweep_file(sweep_file).items():
            add(key, values, f"{sweep_file}")
    for item in items:
        key, eq, values = item.partition("=")
        if not eq or not key.strip():
            problems.append(f"--grid {item!r}: expected KEY=V1,V2,..., e.g. --grid train.lr=1e-4,3e-4")
            continue
        add(key.strip(), [v.strip() for v in values.split(",")], f"--grid {item}")
    if not grid and not problems:
        problems.append("no grid: a sweep needs at least one --grid KEY=V1,V2 (or --sweep-file). Fix: add one")
    return grid, problems


def _read_sweep_file(path: Path) -> dict[str, list[str]]:
    """A sweep file: YAML `grid: {KEY: [V1, V2], ...}`; each value as `--set` would read it."""
    from trainctl.spec.loader import read_spec_text, safe_load

    data = safe_load(read_spec_text(path))
    grid = data.get("grid") if isinstance(data, dict) else None
    if not isinstance(grid, dict) or set(data) != {"grid"}:
        raise SpecError(["a sweep file is one mapping `grid:` of KEY: [values]. Fix: e.g. grid: {train.lr: "
                         "[1.0e-4, 3.0e-4]}"], str(path))
    out: dict[str, list[str]] = {}
    for key, values in grid.items():
        values = values if isinstance(values, list) else [values]
        out[str(key)] = [v if isinstance(v, str) else yaml.safe_dump(v, default_flow_style=True).strip()
                         .removesuffix("...").strip() for v in values]
    return out


def expand(spec_path: Path, sets: Sequence[str], grid: dict[str, list[str]],
           problems: Sequence[str] = ()) -> list[SweepPoint]:
    """The grid's points in order (the last key varies fastest), each a validated spec. `problems` (the grid's
    own, from parse_grid) and every value the spec refuses are named together, one line each, before any
    point is built; then every point the spec refuses."""
    from trainctl.spec import load_spec

    load_spec(spec_path, list(sets))  # the spec itself first: its own mistakes are not the grid's
    problems = list(problems)
    for key, values in grid.items():
        for value in values:
            problems += _refusals(spec_path, [*sets, f"{key}={value}"], f"--grid {key}={value}")
    if problems:
        raise SpecError(list(dict.fromkeys(problems)), str(spec_path))
    points: list[SweepPoint] = []
    for i, combo in enumerate(itertools.product(*grid.values())):
        values = dict(zip(grid, combo, strict=True))
        overrides = [f"{k}={v}" for k, v in values.items()]
        try:
            points.append(SweepPoint(i, values, load_spec(spec_path, [*sets, *overrides])))
        except SpecError as e:
            problems += [f"grid point {i} ({', '.join(overrides)}): {p}" for p in e.problems]
    if problems:
        raise SpecError(problems, str(spec_path))
    return points


def _refusals(spec_path: Path, overrides: list[str], where: str) -> list[str]:
    from trainctl.spec import load_spec

    try:
        load_spec(spec_path, overrides)
    except SpecError as e:
        return [f"{where}: {p}" for p in e.problems]
    return []


@dataclass
class PreparedSweep:
    root: Path
    record: rec.SweepRecord
    points: list[SweepPoint]
    launches: list[Any]  # each point's prepared launch (the backend's own type)


def prepare(spec_path: Path, sets: Sequence[str], items: Sequence[str], sweep_file: Path | None, root: Path, *,
            concurrency: int | None, dry_run: bool = False) -> PreparedSweep:
    """Check the grid (--grid items, a sweep file) and everything a launch of every point checks, before
    anything is created."""
    grid, problems = parse_grid(items, sweep_file)
    points = expand(spec_path, sets, grid, problems)
    return prepare_points(spec_path, sets, grid, points, root, concurrency=concurrency, dry_run=dry_run)


def prepare_points(spec_path: Path, sets: Sequence[str], grid: dict[str, list[str]], points: list[SweepPoint],
                   root: Path, *, concurrency: int | None, dry_run: bool = False) -> PreparedSweep:
    """N validated specs (`points`) as N runs under `root`: everything a launch of each checks, before anything
    is created. `grid` names the keys that tell the runs apart (their columns in `status SWEEP`). A grid's
    points come from `expand`; a tune's from the layouts `plan --auto` ranks (launch/tune.py)."""
    root = root.absolute()
    check_run_dir(root)
    if not dry_run:
        require_writable(root, f"sweep directory {root}")
    backends = {p.spec.backend for p in points}
    if len(backends) != 1:
        raise UsageError(f"the grid mixes launch backends ({', '.join(sorted(backends))})",
                         hint="a sweep runs on one backend: keep launcher.backend out of the grid")
    backend = backend_for(points[0].spec)
    if concurrency is not None and concurrency < 1:
        raise UsageError(f"--max-parallel {concurrency}: must be at least 1", hint="e.g. --max-parallel 2")
    launches = [backend.prepare(p.spec, root / rec.run_dir_name(p.index), grace_s=p.spec.launcher.grace_s,
                                dry_run=dry_run) for p in points]
    if backend.name == "slurm":
        from trainctl.launch.slurm import array

        array.check_shared_request(launches, [p.overrides for p in points])
    record = rec.SweepRecord(spec=str(spec_path.absolute()), sets=list(sets), grid=grid, backend=backend.name,
                             runs=[rec.SweepRun(index=p.index, dir=rec.run_dir_name(p.index), values=p.values)
                                   for p in points], created=now_iso(), concurrency=concurrency)
    return PreparedSweep(root=root, record=record, points=points, launches=launches)


def create(prepared: PreparedSweep) -> None:
    """The sweep directory, its record, and every run directory (the backend's own creation of a run)."""
    prepared.root.mkdir(parents=True, exist_ok=True)
    rec.write_record(prepared.root, prepared.record)
    backend = backend_for(prepared.record.backend)
    for launch in prepared.launches:
        backend.create(launch)


def run_local(prepared: PreparedSweep, say: Say, *, verbose: bool = False) -> int:
    """Run the created sweep's runs here one after another, each as `launch` runs it; none starts once the
    sweep is cancelled. The sweep's exit code (`sweep_exit`)."""
    backend = backend_for(prepared.record.backend)
    record_start(prepared.root, "sweep")
    codes: list[int] = []
    for point, launch in zip(prepared.points, prepared.launches, strict=True):
        name = rec.run_dir_name(point.index)
        if cancelled(prepared.root):
            say(note(("not started", "yellow"), f" {name}: the sweep was cancelled (`trainctl resume "
                     f"{prepared.root}` runs it)"))
            codes.append(EXIT_STOPPED)
            continue
        say(note(("run", "bold"), f" {name} ({', '.join(point.overrides)})"))
        began = time.time()
        codes.append(backend.start_created(launch, say, verbose=verbose))
        stop_all_after(prepared.root, prepared.root / name, codes[-1], began)
    return sweep_exit(codes)


def stop_all_after(root: Path, run_dir: Path, code: int, began: float) -> None:
    """A run of a local sweep that stopped by a signal to this process (Ctrl-C, SIGTERM, SIGHUP), not by
    `trainctl cancel RUN` of that run alone, stops the sweep: none of its other runs starts after it, as after
    `trainctl cancel SWEEP` (`trainctl resume SWEEP` runs them)."""
    from trainctl.rundir.paths import RunPaths

    if code != EXIT_STOPPED:
        return
    alone = any(e.get("event") == "cancel_requested" and e.get("time", 0) >= began
                for e in read_jsonl(RunPaths(run_dir).events))
    if not alone:
        request_cancel(root, by="signal")


def sweep_exit(codes: Sequence[int]) -> int:
    """One exit code for many runs: the worst of theirs (a failure, then a divergence, then a stop)."""
    for code in (EXIT_RUN_FAILED, EXIT_DIVERGED, EXIT_STOPPED):
        if code in codes:
            return code
    return next((c for c in codes if c != EXIT_OK), EXIT_OK)


def request_cancel(root: Path, by: str = "cancel") -> None:
    append_jsonl(root / rec.EVENTS, {"time": time.time(), "event": CANCEL_REQUESTED, "by": by})


def record_start(root: Path, kind: str) -> None:
    append_jsonl(root / rec.EVENTS, {"time": time.time(), "event": STARTED, "kind": kind})


def cancelled(root: Path) -> bool:
    """A cancel of the whole sweep came after the latest start of its runs (`sweep`, `resume SWEEP`)."""
    last: str | None = None
    for e in read_jsonl(root / rec.EVENTS):
        if e.get("event") in (STARTED, CANCEL_REQUESTED):
            last = e["event"]
    return last == CANCEL_REQUESTED


def open_sweep(path: Path) -> rec.SweepRecord:
    if not rec.is_sweep_dir(path):
        raise UsageError(f"{path} is not a sweep directory (no {rec.RECORD})",
                         hint="give the directory `trainctl sweep` printed")
    return rec.read_record(path)


def say_plan(prepared: PreparedSweep, say: Say) -> None:
    say(note(("sweep", "bold"), f" {prepared.root}: {len(prepared.points)} runs ({prepared.record.backend})"))
    for p in prepared.points:
        say(note(f"  {rec.run_dir_name(p.index)}: {', '.join(p.overrides)}"))

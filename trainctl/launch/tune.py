"""`trainctl tune`: the K best layouts `plan --auto` ranks, each launched as a short ordinary run under one tune
directory. No torch.

The layouts are `plan.auto.search`'s own top K (the ranking `plan --auto` prints), each the spec it
validated for that layout with train.steps set to the tune's steps. They go through the sweep's machinery
(launch/sweep.py: one run directory per point, every launch check before anything is created, locally one
after another, on Slurm one job array), so a tune directory is a sweep directory and `status`, `cancel`,
`resume` and `mfu-report` take it as one. What tune adds is its record (rundir/tune_record.py): the layouts
and what the plan predicted for each, which report/tune.py holds the runs' measurements against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainctl.errors import UsageError
from trainctl.launch import sweep as sw
from trainctl.rundir import tune_record as tr

if TYPE_CHECKING:
    from trainctl.plan.auto import AutoResult
    from trainctl.spec import RunSpec

# the fields of a layout `plan --auto` searches, as spec keys: a tune run's grid values (status columns)
LAYOUT_KEYS = ("parallel.tp", "parallel.cp", "parallel.pp", "parallel.dp", "parallel.ep", "parallel.zero",
               "parallel.offload", "parallel.micro_batch", "parallel.sequence_parallel", "parallel.schedule",
               "parallel.virtual_stages", "train.recompute")


@dataclass
class PreparedTune:
    sweep: sw.PreparedSweep
    record: tr.TuneRecord
    search: AutoResult


def layout_values(spec: RunSpec) -> dict[str, str]:
    """A spec's layout as `--set` values (what tells a tune's runs apart)."""
    def value(key: str) -> str:
        section, name = key.split(".")
        v = spec.dp if key == "parallel.dp" else getattr(getattr(spec, section), name)
        return str(v).lower() if isinstance(v, bool) else str(v)

    return {k: value(k) for k in LAYOUT_KEYS}


def short_run(spec: RunSpec, steps: int) -> RunSpec:
    """The layout's spec trained for `steps` steps only (warm-up shortened to fit them): a measuring run."""
    from trainctl.spec import resolved_dict, validate_spec

    data = resolved_dict(spec)
    train = data["train"]
    train.update(steps=steps, tokens=None, warmup=min(train.get("warmup") or 0, steps - 1))
    return validate_spec(data, f"{spec.name} (tune, {steps} steps)")


def prepare(spec_path: Path, sets: Sequence[str], *, top: int, steps: int, root: Path, out: Path | None,
            concurrency: int | None, dry_run: bool = False) -> PreparedTune:
    """Rank the layouts as `plan --auto` does, take the best `top`, and check the launch of each as a
    `steps`-step run under `root`, before anything is created."""
    from trainctl.plan.auto import search
    from trainctl.spec import load_spec

    if top < 1 or steps < 2:
        raise UsageError(f"--top {top} --steps {steps}: tune needs at least one layout and two steps (the first "
                         "is warm-up and is not measured)", hint="e.g. --top 3 --steps 10")
    spec = load_spec(spec_path, list(sets))
    res = search(spec, top=top)
    if not res.top:
        raise UsageError(f"{spec_path}: no layout fits in memory on this cluster; nothing to tune",
                         hint="`trainctl plan --auto` shows the best-looking layouts and why each does not fit")
    points = [sw.SweepPoint(i, layout_values(run), short_run(run, steps)) for i, (_, run, _) in enumerate(res.top)]
    varying = [k for k in LAYOUT_KEYS if len({p.values[k] for p in points}) > 1] or ["parallel.tp", "parallel.pp",
                                                                                    "parallel.dp"]
    grid = {k: list(dict.fromkeys(p.values[k] for p in points)) for k in varying}
    prepared = sw.prepare_points(spec_path, list(sets), grid, points, root, concurrency=concurrency,
                                 dry_run=dry_run)
    root = prepared.root
    record = tr.TuneRecord(
        spec=str(spec_path.absolute()), sets=list(sets), steps=steps, top=top, peak_known=res.peak_known,
        out=str((out if out is not None else root / tr.BEST).absolute()),
        layouts=[tr.TunedLayout(dir=prepared.record.runs[i].dir, predicted_rank=i + 1, describe=s.cand.describe(),
                                parallel=run.model_dump(mode="json", by_alias=True)["parallel"] | {"dp": run.dp},
                                recompute=run.train.recompute, predicted=_predicted(s, res.peak_known))
                 for i, (s, run, _) in enumerate(res.top)])
    return PreparedTune(sweep=prepared, record=record, search=res)


def _predicted(s: Any, peak_known: bool) -> dict[str, float | None]:
    """The plan's figures for one layout; without a known peak its times are at a nominal one: not shown."""
    if not peak_known:
        return {"step_time_s": None, "tokens_per_s": None, "mfu": None}
    return {"step_time_s": s.est.step_time, "tokens_per_s": s.est.tokens_per_s, "mfu": s.mfu}


def create(prepared: PreparedTune) -> None:
    """The tune directory: the sweep's record and run directories, then the tune's record."""
    sw.create(prepared.sweep)
    tr.write_record(prepared.sweep.root, prepared.record)

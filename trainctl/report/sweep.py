"""`mfu-report SWEEP`: a sweep's runs side by side, each named by its grid values, and one comparison table
(final loss, tokens/s, MFU, goodput: all measured). No torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainctl.errors import UsageError
from trainctl.report import scaling_law
from trainctl.rundir import sweep_record as rec
from trainctl.rundir.paths import RunPaths


def expand(paths: list[Path]) -> tuple[list[Path], list[dict[str, Any]]]:
    """The run directories to report: a sweep directory stands for its runs that have measured a step (the
    others are listed as not measured yet); and one entry per sweep (its directory, grid, runs)."""
    runs: list[Path] = []
    sweeps: list[dict[str, Any]] = []
    for path in paths:
        if not rec.is_sweep_dir(path):
            runs.append(path)
            continue
        record = rec.read_record(path)
        measured = [r for r in record.runs if RunPaths(path / r.dir).metrics.is_file()
                    and RunPaths(path / r.dir).metrics.stat().st_size > 0]
        if not measured:
            raise UsageError(f"sweep {path}: none of its {len(record.runs)} runs has measured a step yet",
                             hint=f"`trainctl status {path}` shows where they are")
        runs += [path / r.dir for r in measured]
        sweeps.append({"sweep": str(path.absolute()), "grid": record.grid,
                       "runs": [{"dir": r.dir, "run": str((path / r.dir).absolute()), "values": r.values}
                                for r in record.runs],
                       "not_measured": [r.dir for r in record.runs if r not in measured]})
    return runs, sweeps


def compare(sweeps: list[dict[str, Any]], reports: list[dict[str, Any]]) -> None:
    """Each sweep run's report is labelled by its grid values; each sweep gets its comparison rows."""
    by_run = {str(Path(r["run"]).resolve()): r for r in reports}  # a report names its run as it was given
    for sw in sweeps:
        rows = []
        for run in sw["runs"]:
            r = by_run.get(str(Path(run["run"]).resolve()))
            if r is None:
                continue
            r["label"] = f"{run['dir']} " + " ".join(f"{k}={v}" for k, v in run["values"].items())
            s, gp = r["summary"], r["goodput"]
            rows.append({"dir": run["dir"], "values": run["values"],
                         "steps": s["steps_completed"], "steps_target": s["steps_target"],
                         "final_loss": s["final_loss"], "tokens_per_s": s["tokens_per_s"],
                         "model_flops_per_step": s["model_flops_per_step"],
                         "mfu": None if s["mfu"] is None else s["mfu"]["median"],
                         "goodput": gp.get("goodput") if gp.get("available") else None})
        sw["comparison"] = rows  # every figure measured (metrics.jsonl, events.jsonl)
        if scaling_law.qualifies(sw["grid"]):  # a grid over model size or tokens: loss against compute
            sw["scaling_fit"] = scaling_law.fit(scaling_law.points_of(rows))


def table(sweep: dict[str, Any]) -> Any:
    """The comparison as a rich table: one row per measured run."""
    from rich.table import Table

    from trainctl.terminal import escape
    from trainctl.units import pct, si

    t = Table(title=f"Sweep {escape(sweep['sweep'])} (measured)", title_justify="left")
    for name in ("run", *sweep["grid"], "steps", "final loss", "tokens/s", "MFU median", "goodput"):
        t.add_column(escape(name))
    for row in sweep["comparison"]:
        loss = "-" if row["final_loss"] is None else f"{row['final_loss']:.4f}"
        t.add_row(escape(row["dir"]), *(escape(row["values"][k]) for k in sweep["grid"]),
                  f"{row['steps']}/{row['steps_target'] or '?'}", loss, si(row["tokens_per_s"]),
                  pct(row["mfu"]), pct(row["goodput"], 1))
    return t

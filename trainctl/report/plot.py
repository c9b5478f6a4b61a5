"""`--plot FILE.png`: loss, MFU and step time over steps, restarts marked, one colour per run, and a wall-clock
timeline of each run (steps, restarts, checkpoint stalls, lost time by cause).

matplotlib is an optional extra (`pip install trainctl[plot]`), imported lazily with the Agg backend so
the report works on a headless login node and the CLI stays fast without it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trainctl.errors import UsageError
from trainctl.units import dur, pct


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise UsageError("--plot needs matplotlib, which is not installed",
                         hint="pip install 'trainctl[plot]' (or pip install matplotlib)") from e
    matplotlib.use("Agg")  # no display needed; must precede the pyplot import
    import matplotlib.pyplot as plt

    return plt


def check_target(out: Path) -> None:
    """Refuse, before any work, a file name matplotlib cannot write: its format comes from the suffix."""
    plt = _pyplot()
    formats = sorted(plt.figure().canvas.get_supported_filetypes())
    plt.close("all")
    suffix = out.suffix.lower().lstrip(".")
    if suffix not in formats:
        what = f"matplotlib cannot write {suffix!r} files" if suffix else "no suffix to take the format from"
        raise UsageError(f"--plot {out}: {what}",
                         hint=f"name the file with one of: {', '.join('.' + f for f in formats)} (e.g. plot.png)")
    if out.is_dir():
        raise UsageError(f"--plot {out} is a directory", hint="give a file name such as plot.png")


def _locator() -> Any:
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator


KIND_STYLE = {  # timeline kind -> (colour, legend name)
    "productive": ("#2ca02c", "productive steps"), "replayed": ("#ff7f0e", "replayed steps"),
    "checkpoint": ("#d62728", "checkpoint stalls"), "startup": ("#7f7f7f", "start-up"),
    "restart": ("#9467bd", "restarts"), "queueing": ("#c7c7c7", "queueing"), "shutdown": ("#bcbd22", "shutdown"),
    "idle": ("#e8e8e8", "idle (waiting for a resume)"),
}
LABEL_LANES = 3  # restart labels close together are staggered over this many heights instead of stacked


def _runs_of(points: list[dict[str, Any]], key: str) -> list[list[dict[str, Any]]]:
    """Consecutive points with the same `key` value, in order."""
    groups: list[list[dict[str, Any]]] = []
    for p in points:
        if groups and groups[-1][0][key] == p[key]:
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def _time_unit(wall_s: float) -> tuple[float, str]:
    return (1.0, "s") if wall_s < 120 else (60.0, "min") if wall_s < 7200 else (3600.0, "h")


def _step_panels(axes: Any, report: dict[str, Any], colours: list[str]) -> None:
    """Loss, MFU and step time over steps. A step's last run is drawn solid; an earlier run of it that a
    later attempt replayed (after a restart from an older checkpoint) dashed and faint."""
    panels = [("loss", "loss", 1.0), ("mfu", "MFU (%)", 100.0), ("step_time_s", "step time (ms)", 1e3)]
    unique = len({r["name"] for r in report["runs"]}) == len(report["runs"])
    markers: list[tuple[float, str, int]] = []
    skipped_labelled = False
    for i, run in enumerate(report["runs"]):
        c = colours[i % len(colours)]
        label: str | None = run["name"] if unique else f"{run['name']} ({Path(run['run']).name})"
        bug = bool(run["summary"].get("mfu_bug"))
        for ax, (key, _label, scale) in zip(axes, panels, strict=True):
            if key == "mfu" and bug:
                continue  # >100% is a bug, not a result: never drawn as one
            for a in sorted({p["attempt"] for p in run["series"]}):
                pts = [p for p in run["series"] if p["attempt"] == a and _finite(p.get(key))]
                for group in _runs_of(pts, "kept"):
                    kept = group[0]["kept"]
                    ax.plot([p["step"] for p in group], [p[key] * scale for p in group], color=c, marker=".",
                            markersize=4, linewidth=1.3, linestyle="-" if kept else "--", alpha=1.0 if kept else 0.5,
                            label=label if key == "loss" and kept else None)
                    if key == "loss" and kept:
                        label = None
        _mark_skipped(axes, run, with_label=not skipped_labelled)
        skipped_labelled = skipped_labelled or any(_skipped(p) for p in run["series"])
        markers += [(x["resumed_at_step"] + 0.5, c, x["attempt"]) for x in run["goodput"].get("restarts", [])
                    if x.get("resumed_at_step") is not None]
        predicted = (run["summary"].get("plan") or {}).get("mfu")
        if predicted is not None and not bug:
            axes[1].axhline(predicted * 100, color=c, linestyle="-.", linewidth=1, alpha=0.7)
            axes[1].annotate("plan", xy=(1.0, predicted * 100), xycoords=("axes fraction", "data"),
                             xytext=(-28, 3), textcoords="offset points", color=c, fontsize=8)
        if bug:
            axes[1].text(0.5, 0.5, f"{run['name']}: MFU > 100% (accounting bug), not plotted",
                         transform=axes[1].transAxes, ha="center", color="red")
    for lane, (x, c, attempt) in enumerate(sorted(markers)):
        for ax in axes:
            ax.axvline(x, color=c, linestyle=":", linewidth=1.5)
        axes[0].annotate(f"restart {attempt}", xy=(x, 1.0), xycoords=("data", "axes fraction"),
                         xytext=(3, -12 - 11 * (lane % LABEL_LANES)), textcoords="offset points", color=c,
                         fontsize=9)
    for ax, (_key, label_, _s) in zip(axes, panels, strict=True):
        ax.set_ylabel(label_)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    # outside the panel, to its right: the restart labels along the panel's top never run into it
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=9)


def _finite(x: Any) -> bool:
    return x is not None and math.isfinite(float(x))


def _skipped(p: dict[str, Any]) -> bool:
    """A step the divergence guard skipped, or one whose loss was NaN/inf: it has no point to draw."""
    return bool(p.get("skipped")) or (p.get("loss") is not None and not _finite(p["loss"]))


def _mark_skipped(axes: Any, run: dict[str, Any], with_label: bool) -> None:
    """A red x along the bottom of every panel at each skipped or NaN step, so a diverged run's gaps show."""
    steps = [p["step"] for p in run["series"] if _skipped(p) and p.get("kept", True)]
    if not steps:
        return
    for k, ax in enumerate(axes):
        ax.scatter(steps, [0.03] * len(steps), transform=ax.get_xaxis_transform(), marker="x", color="red",
                   s=28, zorder=3, clip_on=False, label="skipped step (NaN/inf)" if with_label and k == 0 else None)


def _timeline_panel(ax: Any, report: dict[str, Any], colours: list[str]) -> None:
    """One lane per run on the wall clock: productive steps, replayed steps, checkpoint stalls, start-up,
    restarts, queueing and shutdown (report/timeline.py), with the lost time by cause written under it and, for
    an elastic run, the node count from each attempt's start (report/nodes.py)."""
    runs = [(i, r) for i, r in enumerate(report["runs"]) if r["timeline"].get("available")]
    wall = max((r["timeline"]["wall_s"] for _, r in runs), default=0.0)
    div, unit = _time_unit(wall)
    seen: set[str] = set()
    for lane, (i, run) in enumerate(runs):
        tl, y = run["timeline"], -lane
        for kind, (colour, name) in KIND_STYLE.items():
            bars = [(s["start"] / div, (s["end"] - s["start"]) / div) for s in tl["spans"] if s["kind"] == kind]
            if bars:
                ax.broken_barh(bars, (y - 0.3, 0.6), facecolors=colour,
                               label=None if kind in seen else name)
                seen.add(kind)
        for x in tl["restarts"]:
            if x["at_s"] is not None:
                ax.plot([x["at_s"] / div] * 2, [y - 0.38, y + 0.38], color="black", linewidth=1)
                ax.annotate(str(x["attempt"]), xy=(x["at_s"] / div, y + 0.38), fontsize=8, ha="center",
                            va="bottom")
        nodes = run.get("nodes") or {}
        for x in nodes.get("segments", []) if nodes.get("available") else []:  # elastic: the node count
            if x["from_s"] is not None:
                ax.annotate(f"{x['nodes']} node{'s' if x['nodes'] != 1 else ''}", xy=(x["from_s"] / div, y),
                            xytext=(4, 0), textcoords="offset points", fontsize=8, va="center", color="white",
                            fontweight="bold")
        lost = sorted(((s, k) for k, s in tl["seconds_by_kind"].items() if k not in ("productive", "idle") and s > 0),
                      reverse=True)
        text = "lost: " + ", ".join(f"{KIND_STYLE[k][1]} {dur(s)}" for s, k in lost) if lost else "no lost time"
        ax.annotate(text, xy=(0.003, y - 0.36), xycoords=("axes fraction", "data"), va="top", fontsize=8,
                    color=colours[i % len(colours)])
    ax.set_yticks([-i for i in range(len(runs))],
                  [f"{r['name']}\ngoodput {pct(r['goodput'].get('goodput'), 1)}" for _, r in runs], fontsize=9)
    ax.set_ylim(-len(runs) + 0.3, 1.15)  # the top holds the legend
    ax.set_xlim(0, max(wall / div, 1e-9) * 1.01)
    restarted = any(r["timeline"]["restarts"] for _, r in runs)
    ax.set_xlabel(f"wall clock since the first launch ({unit})"
                  + ("; numbers: restarted attempts" if restarted else ""))
    ax.grid(True, axis="x", alpha=0.3)
    if seen:
        ax.legend(loc="upper left", ncol=len(seen), fontsize=8, frameon=False, handlelength=1.2,
                  columnspacing=1.0)


def _scaling_panel(ax: Any, f: dict[str, Any]) -> None:
    """A sweep's final loss against training compute (log-log): the runs as points, the fitted law as a line."""
    pts = sorted(f["points"], key=lambda p: p["compute"])
    ax.scatter([p["compute"] for p in pts], [p["loss"] for p in pts], zorder=3, label="final loss (measured)")
    for p in pts:
        ax.annotate(p["dir"], (p["compute"], p["loss"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    lo, hi = pts[0]["compute"], pts[-1]["compute"]
    xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
    ax.plot(xs, [f["irreducible"] + f["a"] * x ** -f["b"] for x in xs], label=f"fit: {f['form']}, b={f['b']:.3g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training compute C (model FLOPs)")
    ax.set_ylabel("final loss")
    ax.legend(fontsize=8, frameon=False)
    ax.grid(True, which="both", alpha=0.3)


def figure(report: dict[str, Any]) -> Any:
    """The report's figure (a matplotlib Figure; the caller closes it)."""
    plt = _pyplot()
    MaxNLocator = _locator()  # noqa: N806 - a class
    lanes = sum(1 for r in report["runs"] if r["timeline"].get("available"))
    fits = [sw["scaling_fit"] for sw in report.get("sweeps", []) if (sw.get("scaling_fit") or {}).get("fitted")]
    fig = plt.figure(figsize=(10, 10.5 + 0.7 * lanes + 3.5 * len(fits)), constrained_layout=True)
    grid = fig.add_gridspec(4 + len(fits), 1, height_ratios=[3, 3, 3, 1.4 + 0.9 * lanes] + [3.5] * len(fits))
    for i, f in enumerate(fits):
        _scaling_panel(fig.add_subplot(grid[4 + i]), f)
    axes = [fig.add_subplot(grid[0])]
    axes += [fig.add_subplot(grid[i], sharex=axes[0]) for i in (1, 2)]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    _step_panels(axes, report, colours)
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if lanes:
        _timeline_panel(fig.add_subplot(grid[3]), report, colours)
    names = ", ".join(r["name"] for r in report["runs"])
    axes[0].set_title(f"trainctl mfu-report: {names}" + ("  (dashed: steps run again after a restart)"
                      if any(r["goodput"].get("restarts") for r in report["runs"]) else ""), fontsize=11)
    return fig


def plot(report: dict[str, Any], out: Path) -> Path:
    plt = _pyplot()
    fig = figure(report)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise UsageError(f"--plot {out}: cannot write it ({e.strerror or e})",
                         hint="give a path in a directory you can write") from e
    finally:
        plt.close(fig)
    return out

"""`--plot FILE.png`: loss, MFU and step time over steps, restarts marked, one colour per run.

matplotlib is an optional extra (`pip install trainctl[plot]`), imported lazily with the Agg backend so
the report works on a headless login node and the CLI stays fast without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainctl.errors import UsageError


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


def plot(report: dict[str, Any], out: Path) -> Path:
    plt = _pyplot()
    MaxNLocator = _locator()  # noqa: N806 - a class
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True, constrained_layout=True)
    panels = [("loss", "loss", 1.0), ("mfu", "MFU (%)", 100.0), ("step_time_s", "step time (ms)", 1e3)]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    unique = len({r["name"] for r in report["runs"]}) == len(report["runs"])
    for i, run in enumerate(report["runs"]):
        c = colours[i % len(colours)]
        label = run["name"] if unique else f"{run['name']} ({Path(run['run']).name})"
        series = run["series"]
        bug = bool(run["summary"].get("mfu_bug"))
        for ax, (key, _label, scale) in zip(axes, panels, strict=True):
            if key == "mfu" and bug:
                continue  # >100% is a bug, not a result: never drawn as one
            by_attempt: dict[int, list[dict[str, Any]]] = {}
            for p in series:
                if p.get(key) is not None:
                    by_attempt.setdefault(p["attempt"], []).append(p)
            for a, pts in sorted(by_attempt.items()):
                ax.plot([p["step"] for p in pts], [p[key] * scale for p in pts], color=c, marker=".",
                        markersize=4, linewidth=1.3, linestyle="-" if a == max(by_attempt) else "--",
                        label=label if (key == "loss" and a == max(by_attempt)) else None)
        for x in run["goodput"].get("restarts", []):
            step = x.get("resumed_at_step")
            if step is None:
                continue
            for ax in axes:
                ax.axvline(step + 0.5, color=c, linestyle=":", linewidth=1.5)
            axes[0].annotate(f"restart {x['attempt']}", xy=(step + 0.5, 1.0), xycoords=("data", "axes fraction"),
                             xytext=(3, -12), textcoords="offset points", color=c, fontsize=9)
        predicted = (run["summary"].get("plan") or {}).get("mfu")
        if predicted is not None and not bug:
            axes[1].axhline(predicted * 100, color=c, linestyle="-.", linewidth=1, alpha=0.7)
            axes[1].annotate("plan", xy=(1.0, predicted * 100), xycoords=("axes fraction", "data"),
                             xytext=(-28, 3), textcoords="offset points", color=c, fontsize=8)
        if bug:
            axes[1].text(0.5, 0.5, f"{run['name']}: MFU > 100% (accounting bug), not plotted",
                         transform=axes[1].transAxes, ha="center", color="red")
    for ax, (_key, label, _s) in zip(axes, panels, strict=True):
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(loc="upper right", fontsize=9)
    names = ", ".join(r["name"] for r in report["runs"])
    axes[0].set_title(f"trainctl mfu-report: {names}" + ("  (dashed: attempts later replayed/restarted)"
                      if any(r["goodput"].get("restarts") for r in report["runs"]) else ""), fontsize=11)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise UsageError(f"--plot {out}: cannot write it ({e.strerror or e})",
                         hint="give a path in a directory you can write") from e
    finally:
        plt.close(fig)
    return out

"""`trainctl mfu-report RUN [RUN ...]`: summary, where the time went, goodput, stragglers. No torch."""

from __future__ import annotations

from pathlib import Path

import typer

from trainctl.cli.app import app
from trainctl.cli.console import escape, make_console
from trainctl.cli.jsonout import print_json
from trainctl.cli.options import JsonOpt


@app.command("mfu-report")
def mfu_report(
    runs: list[Path] = typer.Argument(..., metavar="RUN", help="Run directories (several: side by side), or "
                                      "a sweep directory (its runs compared).",
                                      show_default=False),
    as_json: bool = JsonOpt,
    plot_file: Path | None = typer.Option(None, "--plot", metavar="FILE.png",
                                          help="Also plot loss, MFU and step time over steps (needs matplotlib)."),
    calibration: Path | None = typer.Option(None, "--calibration", metavar="PROFILE",
                                            help="Hold the runs against their plans priced with this `trainctl "
                                                 "calibrate` profile (e.g. one measured after the launch)."),
) -> None:
    """MFU, HFU and throughput vs the plan; where the time went; goodput across restarts; stragglers."""
    from trainctl.report import build_report
    from trainctl.report import sweep as sweeps

    if plot_file is not None:
        from trainctl.report.plot import check_target

        check_target(plot_file)  # before the report's work: a wrong suffix is a usage error, not a traceback
    runs, swept = sweeps.expand(runs)  # a sweep directory stands for its runs
    report = build_report(runs, calibration)
    if swept:
        sweeps.compare(swept, report["runs"])
        report["sweeps"] = swept
    if plot_file is not None:
        from trainctl.report.plot import plot

        report["plot"] = str(plot(report, plot_file))
    if as_json:
        print_json(report)
        return
    from trainctl.report.render import render

    con = make_console()
    render(report, con)
    if plot_file is not None:
        con.print(f"plot: {escape(str(report['plot']))}")


__all__ = ["mfu_report"]

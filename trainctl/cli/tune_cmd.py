"""`trainctl tune`: measure the K best layouts `plan --auto` ranks and write the measured best as a spec. No torch.

The layouts and their runs: launch/tune.py (a tune directory is a sweep directory); the measurement against
the plan and the written spec: report/tune.py. This module prints and decides the exit code."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from trainctl.cli.app import app
from trainctl.cli.console import Col, escape, fitted_table, make_console, sayer
from trainctl.cli.jsonout import print_json
from trainctl.cli.options import OptionalSpecArg, SetOpt, StrictOpt, VerboseOpt, check_before_training
from trainctl.errors import EXIT_OK, EXIT_RUN_FAILED, EXIT_STOPPED

WAIT_POLL_S = 5.0  # Slurm: how often tune looks at its runs while it waits for them


@app.command()
def tune(
    spec: Path | None = OptionalSpecArg,
    set_: list[str] = SetOpt,
    top: int = typer.Option(3, "--top", "-k", min=1, max=50, help="How many of the layouts `plan --auto` ranks "
                            "best to measure."),
    steps: int = typer.Option(10, "--steps", min=2, help="Training steps per layout (the first is warm-up, left "
                              "out of the measurement)."),
    tune_dir: Path | None = typer.Option(None, "--tune-dir", help="Directory to create (default "
                                         "runs/tune-<name>-<YYYYmmdd-HHMMSS>); must not exist or be empty."),
    out: Path | None = typer.Option(None, "--out", "-o", metavar="FILE.yaml", help="Where to write the spec "
                                    "with the measured best layout (default TUNE/best.yaml)."),
    max_parallel: int | None = typer.Option(None, "--max-parallel", help="Slurm: at most this many layouts at "
                                            "once (the job array's %K limit; default: one at a time, so they "
                                            "do not share the nodes while measured)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Rank the layouts and check their runs; create nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the result table as JSON."),
    strict: bool = StrictOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Measure the layouts `plan --auto` ranks best, each as a short run, and write the measured fastest as a spec.

    Each layout is an ordinary run under one tune directory (locally one after another; on Slurm one job array,
    tune waits for it). The table holds each layout's predicted and measured step time, tokens/s and MFU and
    its rank in both orders; a layout whose run fails is a row saying so. Ctrl-C stops the run in progress
    after a checkpoint and starts no other (exit 75): `trainctl resume TUNE` finishes the tune."""
    from trainctl.fileio import require_writable
    from trainctl.launch import sweep as sw
    from trainctl.launch import tune as tn
    from trainctl.launch.create import default_run_dir
    from trainctl.spec import load_spec

    console = make_console()
    spec_path = spec if spec is not None else _default_spec()
    default = default_run_dir(load_spec(spec_path, set_ or []))
    root = tune_dir or default.with_name(f"tune-{default.name}")
    prepared = tn.prepare(spec_path, set_ or [], top=top, steps=steps, root=root, out=out,
                          concurrency=max_parallel or 1, dry_run=dry_run)
    if not dry_run and out is not None:
        require_writable(out, f"--out {out}")
    for launch in prepared.sweep.launches:
        check_before_training(console, launch.spec, launch.run_dir, strict)
    _say_layouts(console, prepared)
    if dry_run:
        return
    tn.create(prepared)
    if prepared.sweep.record.backend == "local":
        sw.run_local(prepared.sweep, sayer(console), verbose=verbose)
    else:
        from trainctl.launch.slurm import array

        array_id = array.submit_array(prepared.sweep.root, prepared.sweep.launches,
                                      job_name=prepared.sweep.points[0].spec.name, concurrency=max_parallel or 1)
        console.print(f"[bold]submitted[/bold] Slurm job array {array_id}; waiting for its {top} runs "
                      "(Ctrl-C cancels them; `trainctl resume` finishes the tune)")
        if not wait_for_runs(prepared.sweep.root):
            raise typer.Exit(EXIT_STOPPED)
    raise typer.Exit(finish(prepared.sweep.root, as_json=as_json))


def _default_spec() -> Path:
    from trainctl.cli.options import default_spec_path

    return default_spec_path()


def _say_layouts(console: Any, prepared: Any) -> None:
    rec = prepared.record
    console.print(f"[bold]tune[/bold] {escape(str(prepared.sweep.root))}: the {len(rec.layouts)} best layouts "
                  f"`plan --auto` ranks, {rec.steps} steps each ({prepared.sweep.record.backend})", soft_wrap=True)
    for x in rec.layouts:
        p = x.predicted
        figures = (f": predicted step {p['step_time_s'] * 1e3:.3g} ms, {p['tokens_per_s']:,.0f} tokens/s"
                   if p["step_time_s"] else "")
        console.print(f"  {x.dir}: #{x.predicted_rank} {escape(x.describe)}{figures}", soft_wrap=True)


def wait_for_runs(root: Path) -> bool:
    """Wait until no run of the tune is active (Slurm). Ctrl-C cancels them as `trainctl cancel TUNE` does:
    False then."""
    from trainctl import api

    try:
        while api.status(root).active:
            time.sleep(WAIT_POLL_S)
    except KeyboardInterrupt:
        print(f"\ntrainctl: Ctrl-C: cancelling the tune's runs (`trainctl resume {root}` finishes the tune)")
        for line in api.cancel(root):
            print(line)
        return False
    return True


def finish(root: Path, *, as_json: bool = False) -> int:
    """Measure the tune's runs, print the table, and, once every run has ended, write the measured best's spec
    and TUNE/tune-result.json. The exit code: 0 with a best, 75 while runs are left to finish (stopped or
    never started), 1 if no layout completed."""
    from trainctl.report import tune as rt

    result = rt.measure(root)
    if result["finished"] and result["best"] is not None:
        text = rt.best_spec_text(root, result)
        out = Path(result["out"])
        from trainctl.fileio import write_atomic

        write_atomic(out, text)
        result["written"] = str(out)
    if result["finished"]:
        rt.write_result(root, result)
    if as_json:
        print_json(result)
    else:
        show(result)
    if not result["finished"]:
        return EXIT_STOPPED
    return EXIT_OK if result["best"] is not None else EXIT_RUN_FAILED


def _fig(x: float | None, kind: str) -> str:
    if x is None:
        return "-"
    if kind == "ms":
        return f"{x * 1e3:.3g}"
    if kind == "%":
        return f"{x:.1%}"
    return f"{x:,.0f}"


def show(result: dict[str, Any]) -> None:
    """The tune's table: predicted against measured per layout (plan order), both ranks; then the verdict."""
    from rich import box

    console = make_console()
    console.print(f"[bold]tune[/bold] {escape(result['tune'])}: {len(result['rows'])} layouts, {result['steps']} "
                  "steps each; measured: medians over steady steps (first step of each attempt left out)",
                  soft_wrap=True)
    columns = [Col("plan #", "key", "right"), Col("run", "key"), Col("tp/cp/pp/dp ...", "prose"), Col("state"),
               Col("step ms pred.", justify="right"), Col("step ms meas.", justify="right"),
               Col("tok/s pred.", justify="right"), Col("tok/s meas.", justify="right"),
               Col("MFU pred.", justify="right"), Col("MFU meas.", justify="right"),
               Col("meas. #", "key", "right")]
    rows = []
    for r in result["rows"]:
        p, m = r["predicted"], r["measured"] or {}
        rows.append([str(r["predicted_rank"]), r["dir"], escape(r["short"]), r["state"],
                     _fig(p["step_time_s"], "ms"), _fig(m.get("step_time_s"), "ms"),
                     _fig(p["tokens_per_s"], "n"), _fig(m.get("tokens_per_s"), "n"),
                     _fig(p["mfu"], "%"), _fig(m.get("mfu"), "%"),
                     str(r["measured_rank"]) if r["measured_rank"] else "-"])
    console.print(fitted_table(console, columns, rows, box=box.SIMPLE, show_edge=False))
    for r in result["rows"]:
        if r["state"] != "COMPLETED" and r.get("reason"):
            console.print(f"  {r['dir']}: {r['state']}: {escape(r['reason'])}", soft_wrap=True)
    if not result["peak_known"]:
        console.print("[yellow]predicted times not shown: the accelerator's peak is unknown (the plan ranked at a "
                      "nominal 1 TFLOP/s); set cluster.peak_tflops or calibrate[/yellow]", soft_wrap=True)
    if not result["finished"]:
        left = [r["dir"] for r in result["rows"] if r["state"] not in ("COMPLETED", "FAILED", "DIVERGED")]
        console.print(f"[yellow]not finished[/yellow]: {', '.join(left)} not ended; `trainctl resume "
                      f"{escape(result['tune'])}` runs them and writes the spec", soft_wrap=True)
        return
    best = result["best"]
    if best is None:
        console.print("[red]no layout completed[/red]: no spec written; `trainctl logs` on a run says why",
                      soft_wrap=True)
        return
    agree = "the plan's best too" if best["predicted_rank"] == 1 else f"the plan ranked it #{best['predicted_rank']}"
    console.print(f"[bold]measured best[/bold]: {best['dir']} ({escape(best['layout'])}), {agree}", soft_wrap=True)
    console.print(f"spec written: {escape(result['written'])}", soft_wrap=True)


__all__ = ["finish", "tune"]

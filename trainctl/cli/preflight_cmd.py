"""`trainctl preflight SPEC`: check the nodes of the spec's cluster before training; a table per node with a
verdict. Exit 0 all healthy, 1 bad nodes found, 2 usage or spec. No torch here: the measuring runs on the ranks."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from trainctl.cli.app import app
from trainctl.cli.console import escape, make_console, sayer
from trainctl.cli.options import OptionalSpecArg, SetOpt, read_spec

if TYPE_CHECKING:
    from rich.console import Console

    from trainctl.launch.preflight import Preflight

EXIT_BAD_NODES = 1

MatmulRatioOpt = typer.Option(0.8, "--min-matmul-ratio", help="A device whose matmul rate is below this fraction "
                              "of its peers' median (the other devices') is bad.")
LinkRatioOpt = typer.Option(0.5, "--min-link-ratio", help="A node's all-reduce, or a node pair's link, below this "
                            "fraction of the median of its kind is bad.")
PeakFractionOpt = typer.Option(0.2, "--min-peak-fraction", help="GPU: a matmul rate below this fraction of the "
                               "catalog's dense BF16 peak is bad.")


def show_preflight(console: Console, pf: Preflight) -> None:
    """The table per node, then each bad node with its reasons."""
    from rich.table import Table

    from trainctl.units import dur, size

    t = Table(title=f"preflight of {len(pf.verdicts)} node(s) ({pf.paths.root})")
    for col in ("node", "ranks", "matmul TFLOP/s", "x peers", "memory ok", "intra GB/s", "links", "ckpt free",
                "verdict"):
        t.add_column(col)
    for v in pf.verdicts:
        t.add_row(v.node, str(v.ranks), f"{v.matmul_flops / 1e12:.3g}" if v.matmul_flops else "-",
                  _ratio(v.matmul_ratio, v.matmul_spread), size(v.memory_bytes),
                  f"{v.intra_bytes_per_s / 1e9:.3g}" if v.intra_bytes_per_s else "-", "; ".join(v.links) or "-",
                  size(v.free_bytes) if v.free_bytes is not None else "-",
                  "[green]ok[/green]" if v.ok else "[red]BAD[/red]")
    console.print(t)
    for v in pf.verdicts:
        for reason in v.reasons:
            console.print(f"[red]bad node[/red] {escape(v.node)}: {escape(reason)}")
        for n in v.notes:
            console.print(f"[dim]note[/dim] {escape(v.node)}: {escape(n)}")
    if pf.result.get("ranks") and not any(r.get("nvml") for r in pf.result["ranks"]):
        console.print("[dim]NVML state skipped: the ranks ran on CPUs[/dim]")
    console.print(f"measured in {dur(float(pf.result.get('elapsed_s') or 0))}; "
                  + ("every node healthy" if not pf.bad else f"{len(pf.bad)} bad node(s): "
                     + escape(",".join(v.node for v in pf.bad))))


def _ratio(ratio: float | None, spread: float | None) -> str:
    """x peers, to three digits (0.797 is not 0.80) and the spread it was judged with."""
    if ratio is None:
        return "-"
    return f"{ratio:.3f} ±{spread:.0%}" if spread else f"{ratio:.3f}"


@app.command()
def preflight(
    spec: Path | None = OptionalSpecArg,
    set_: list[str] = SetOpt,
    nodes: int | None = typer.Option(None, "--nodes", help="Nodes to check (default cluster.nodes; more gives "
                                     "spares for `launch --preflight` to choose from)."),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Run directory of the checking job (default "
                                        "runs/preflight/<name>-<YYYYmmdd-HHMMSS>)."),
    min_matmul_ratio: float = MatmulRatioOpt,
    min_link_ratio: float = LinkRatioOpt,
    min_peak_fraction: float = PeakFractionOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the verdicts and measurements as JSON."),
) -> None:
    """Check the spec's nodes before training: matmul rate, memory, links, NVML, checkpoint directory."""
    from trainctl.cli.jsonout import print_json
    from trainctl.launch.node_health import Thresholds
    from trainctl.launch.preflight import run_preflight

    console = make_console(stderr=as_json)
    run = read_spec(spec, set_)
    th = Thresholds(min_matmul_ratio, min_link_ratio, min_peak_fraction)
    th.check()
    console.print(f"[bold]preflight[/bold] {escape(run.name)}: {nodes or run.cluster.nodes} node(s) x "
                  f"{run.cluster.gpus_per_node} (cluster.gpu {run.cluster.gpu}) with the {run.backend} backend")
    pf = run_preflight(run, th, sayer(console), nodes=nodes, run_dir=run_dir)
    if as_json:
        print_json(pf.to_json())
    else:
        show_preflight(console, pf)
    if pf.bad:
        raise typer.Exit(EXIT_BAD_NODES)


__all__ = ["preflight", "show_preflight"]

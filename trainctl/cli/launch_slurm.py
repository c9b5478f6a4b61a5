"""The Slurm branch of `trainctl launch` (kept apart so launch_cmd.py's local path stays as it was)."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from rich.console import Console

from trainctl.spec import RunSpec


def plan_summary(spec: RunSpec) -> list[str]:
    """A few lines of the plan: layout, placement, the planner's headline estimate (if it is there)."""
    c, par = spec.cluster, spec.parallel
    lines = [f"{spec.name}: {spec.world_size} ranks = tp {par.tp} x pp {par.pp} x dp {spec.dp} on "
             f"{c.nodes} node(s) x {c.gpus_per_node} ({c.gpu}); launcher {spec.launcher.mode}, "
             f"max_restarts {spec.launcher.max_restarts}; {spec.train.steps} steps"]
    from trainctl.plan.placement import Layout, tp_groups_across_nodes

    across = tp_groups_across_nodes(Layout.from_spec(spec))
    lines.append("placement: every TP group inside one node" if not across
                 else f"placement: {len(across)} TP group(s) span nodes, e.g. {across[0]}")
    try:
        from trainctl.plan.plan import build_plan
    except ImportError:
        return lines
    p = build_plan(spec)
    est = [f"predicted MFU {p.mfu:.1%}" if p.mfu is not None else None,
           "fits in memory" if p.fits else "DOES NOT FIT in memory"]
    lines.append("plan: " + ", ".join(x for x in est if x))
    lines += [f"plan {w.level}: {w.message}" for w in p.warnings]
    return lines


def launch_slurm(spec: RunSpec, run_dir: Path | None, *, dry_run: bool, grace_s: int, console: Console) -> None:
    from trainctl.launch import slurm

    launch = slurm.plan_slurm(spec, run_dir, grace_s=grace_s)
    if dry_run:
        console.print(f"[bold]run dir (not created)[/bold] {launch.run_dir}", soft_wrap=True)
        for line in plan_summary(launch.spec):
            console.print(line, soft_wrap=True, markup=False)
        if shutil.which("sinfo"):
            problems = slurm.check_cluster(launch.spec, slurm.query_sinfo())
            for p in problems:
                console.print(f"[red]cluster check:[/red] {p}", soft_wrap=True)
            if not problems:
                console.print("cluster check (sinfo): ok", soft_wrap=True)
        else:
            console.print("[dim]sinfo not found: cluster checks skipped[/dim]")
        console.print("[bold]submit with[/bold]", soft_wrap=True)
        print(shlex.join(launch.submit_argv()))
        console.print("[bold]sbatch script[/bold]")
        print(launch.script, end="")
        return
    slurm.require_cluster_fits(launch.spec)
    paths = slurm.create(launch)
    job_id = slurm.submit(launch, paths)
    console.print(f"[bold]submitted[/bold] Slurm job {job_id}  run dir {paths.root}", soft_wrap=True)
    run = shlex.quote(str(paths.root))
    console.print(f"follow it:  trainctl status {run}   |   trainctl logs {run} -f", soft_wrap=True, markup=False)

"""`trainctl launch`: create the run directory and run the bundled trainer (local torchrun, or Slurm)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from trainctl.cli.app import app
from trainctl.cli.console import escape, make_console, sayer, show
from trainctl.cli.options import (
    OptionalSpecArg,
    SetOpt,
    StrictOpt,
    VerboseOpt,
    check_before_training,
    read_spec,
    say_held_back,
)
from trainctl.cli.preflight_cmd import LinkRatioOpt, MatmulRatioOpt, PeakFractionOpt, show_preflight
from trainctl.errors import RunError, UsageError

if TYPE_CHECKING:
    from rich.console import Console

    from trainctl.launch.node_health import Thresholds
    from trainctl.spec import RunSpec


@app.command()
def launch(
    spec: Path | None = OptionalSpecArg,
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Run directory to create (default "
                                        "runs/<name>-<YYYYmmdd-HHMMSS>); must not exist or be empty."),
    set_: list[str] = SetOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the run directory and command; run nothing."),
    strict: bool = StrictOpt,
    grace: int | None = typer.Option(None, "--grace", help="Slurm: seconds before the time limit at which the "
                                     "ranks are told to checkpoint and the job requeues itself "
                                     "(--signal=B:USR1@GRACE); the same as --set launcher.grace_s=N."),
    verbose: bool = VerboseOpt,
    preflight: bool = typer.Option(False, "--preflight", help="Check the nodes first (`trainctl preflight`); on "
                                   "Slurm the bad ones are excluded, and the launch stops if too few remain."),
    preflight_nodes: int | None = typer.Option(None, "--preflight-nodes", help="With --preflight: nodes to check "
                                               "(default cluster.nodes; more gives spares)."),
    min_matmul_ratio: float = MatmulRatioOpt,
    min_link_ratio: float = LinkRatioOpt,
    min_peak_fraction: float = PeakFractionOpt,
) -> None:
    """Launch a run: freeze the spec into a run directory and start the trainer on every rank.

    Locally it runs to the end here: Ctrl-C makes every rank save a checkpoint after its current step and stop
    (exit 75; `trainctl resume RUN` continues); a second Ctrl-C kills at once."""
    from trainctl.launch.backend import backend_for
    from trainctl.launch.create import reserved_run_dir
    from trainctl.launch.node_health import Thresholds
    from trainctl.launch.secrets import credential_names

    console = make_console()
    run = read_spec(spec, [*(set_ or []), *([f"launcher.grace_s={grace}"] if grace is not None else [])])
    if run.train.stages:  # the trainer runs one shape; nothing may train differently from what the spec says
        raise UsageError(f"train.stages: the bundled trainer runs one shape, not the {len(run.train.stages)} stages "
                         "this spec lists (plan prices them together)",
                         hint="remove train.stages to train the spec's own shape, or write each stage as its own "
                              "spec (its global_batch, model.seq_len, parallel.cp and train.tokens)")
    say_held_back(console, credential_names(run.launcher.env))
    # a default run directory is made now, atomically (concurrent launches get distinct ones), and taken back
    # when the launch stops before using it
    with reserved_run_dir(run, run_dir, dry_run=dry_run) as target:
        excluded: dict[str, str] = {}
        if preflight and not dry_run:
            run, excluded = _preflight(console, run, target, preflight_nodes,
                                       Thresholds(min_matmul_ratio, min_link_ratio, min_peak_fraction))
        backend = backend_for(run)
        launch = backend.prepare(run, target, grace_s=run.launcher.grace_s, dry_run=dry_run)
        check_before_training(console, run, target, strict)
        if dry_run:
            for line in backend.dry_run(launch):
                show(console, line)
            return
        code = backend.start(launch, sayer(console), verbose=verbose)
    if excluded:  # the submission already excludes them (cluster.exclude); the record keeps them out of resumes
        from trainctl.launch import exclusions
        from trainctl.rundir.paths import RunPaths

        exclusions.add(RunPaths(Path(launch.run_dir)), excluded, exclusions.PREFLIGHT)
    raise typer.Exit(code)


def _preflight(console: Console, run: RunSpec, target: Path, nodes: int | None,
               th: Thresholds) -> tuple[RunSpec, dict[str, str]]:
    """Run the preflight; the spec without its bad nodes (cluster.exclude) and their reasons, or stop."""
    from trainctl.launch import exclusions
    from trainctl.launch.node_health import enough_left
    from trainctl.launch.preflight import run_preflight

    th.check()
    pf = run_preflight(run, th, sayer(console), nodes=nodes, target_run_dir=target)
    show_preflight(console, pf)
    if not pf.bad:
        return run, {}
    why = enough_left(pf.verdicts, run.cluster.nodes)
    if why is not None:
        raise RunError(f"launch stopped by the preflight: {why}",
                       hint=f"check more nodes (--preflight-nodes), or repair them; details in {pf.paths.root}")
    if run.backend != "slurm":
        raise RunError(f"launch stopped by the preflight: bad node(s) {', '.join(v.node for v in pf.bad)} "
                       f"and the {run.backend} backend cannot exclude a node", hint=f"details in {pf.paths.root}")
    reasons = {v.node: v.reasons[0] for v in pf.bad}
    cluster = run.cluster.model_copy(update={"exclude": exclusions.merged(run.cluster.exclude, list(reasons))})
    console.print(f"[bold]excluding[/bold] {escape(', '.join(reasons))} (sbatch --exclude); the job runs on the "
                  "healthy nodes")
    return run.model_copy(update={"cluster": cluster}), reasons

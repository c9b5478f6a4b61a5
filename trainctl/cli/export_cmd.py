"""`trainctl export RUN --format hf OUT`: a run's checkpoint as a Hugging Face transformers model.

The checks run without torch (trainctl/hf/export.py); the export itself imports it, in this process."""

from __future__ import annotations

from pathlib import Path

import typer

from trainctl.cli.app import app
from trainctl.cli.console import escape, make_console
from trainctl.fileio import write_errors_as_usage


@app.command()
def export(
    run: Path = typer.Argument(..., help="Run directory (made by `trainctl launch`).", show_default=False),
    out: Path = typer.Argument(..., help="New (or empty) directory to write the model into.", show_default=False),
    fmt: str = typer.Option(..., "--format", help="Output format: hf (safetensors + config.json for "
                            "transformers' LlamaForCausalLM, MixtralForCausalLM or GPT2LMHeadModel)."),
    step: int | None = typer.Option(None, "--step", min=0, help="Checkpoint step (default: the newest valid)."),
) -> None:
    """Export a checkpoint of any layout as full weights in another format (Hugging Face: safetensors)."""
    from trainctl.hf.export import plan_export, run_export

    plan = plan_export(run, step, fmt, out)
    with write_errors_as_usage(f"OUT {out}"):  # what the check before cannot foresee: a full disk, a lost mount
        files = run_export(plan)
    size = sum((plan.out / f).stat().st_size for f in files)
    make_console().print(escape(f"exported step {plan.checkpoint.step} of {run} as {plan.architecture} to {plan.out} "
                                f"({', '.join(files)}; {size / 1e6:.1f} MB)"), soft_wrap=True)


__all__ = ["export"]

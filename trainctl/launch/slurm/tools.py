"""Calling Slurm's command-line tools: argv lists (never a shell) with a time limit. No torch."""

from __future__ import annotations

import shutil
import subprocess

from trainctl.errors import RunError, UsageError

SLURM_TIMEOUT_S = 30.0


def run_slurm(*argv: str, timeout: float = SLURM_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run a Slurm command that must exist here (sbatch, sinfo, scancel): UsageError when it does not."""
    if shutil.which(argv[0]) is None:
        raise UsageError(f"{argv[0]} not found: this machine is not a Slurm login node",
                         hint="run trainctl launch where sbatch works, or use --dry-run to see the script")
    try:
        return subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RunError(f"{' '.join(argv)} did not answer within {timeout:.0f}s",
                       hint="is slurmctld up? try `sinfo`") from e


def ask_slurm(*argv: str) -> subprocess.CompletedProcess[str] | None:
    """Run a query whose answer is optional (scontrol, sacct): None when the tool is missing or silent."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=SLURM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None

"""Errors the CLI turns into exit codes: 2 for usage/spec mistakes, 1 for a failed run."""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_USAGE = 2
# The divergence guard stopped the run: the loss or gradient norm stayed NaN/inf for
# train.divergence.max_consecutive_skips steps (trainctl.runtime.train.divergence); the last finite checkpoint is kept.
EXIT_DIVERGED = 3
# Stopped on purpose after committing a checkpoint (Ctrl-C, SIGTERM/SIGUSR1/SIGUSR2, `trainctl cancel`,
# preemption, a time limit): `trainctl resume` (or Slurm's requeue) continues from it. EX_TEMPFAIL.
EXIT_STOPPED = 75


class TrainctlError(Exception):
    """Base class: a message for the user, one line each, plus an optional hint."""

    exit_code = EXIT_RUN_FAILED

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.notes: list[str] = []  # lines printed after the message as `note:`, before the hint


class UsageError(TrainctlError):
    exit_code = EXIT_USAGE


class SpecError(UsageError):
    """One or more problems in a run spec; each names the field, the value and the fix."""

    def __init__(self, problems: list[str], source: str | None = None, not_checked: list[str] | None = None) -> None:
        self.problems = problems
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + p for p in problems))
        # rules another problem kept from judging (`field: not checked: why`): printed as notes after the errors
        self.notes = [prefix + line for line in not_checked or []]


class RunError(TrainctlError):
    exit_code = EXIT_RUN_FAILED

"""When to save: every N steps and/or M minutes after the last save. No torch; the trainer's one schedule."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class SaveSchedule:
    """When to save: at every multiple of N steps and/or M minutes after the last save.

    Steps are multiples (not "N since the last save") so a resumed run saves at the same steps.

    Time differs across ranks: the trainer asks `time_due()` on every rank and agrees on the answer (one
    all-reduce, runtime/train/signals.agree) so every rank enters save() at the same step.
    """

    every_steps: int | None = None
    every_minutes: float | None = None
    last_step: int = 0
    last_time: float = field(default_factory=time.monotonic)

    @property
    def enabled(self) -> bool:
        """Whether any save is scheduled (a run without a schedule gets no final checkpoint either)."""
        return bool(self.every_steps or self.every_minutes)

    def step_due(self, step: int) -> bool:
        return step > self.last_step and bool(self.every_steps) and step % self.every_steps == 0

    def time_due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return bool(self.every_minutes) and (now - self.last_time) >= self.every_minutes * 60

    def due(self, step: int, now: float | None = None) -> bool:
        return step > self.last_step and (self.step_due(step) or self.time_due(now))

    def mark(self, step: int, now: float | None = None) -> None:
        """A checkpoint of `step` exists now (saved, or loaded at resume)."""
        self.last_step = step
        self.last_time = time.monotonic() if now is None else now

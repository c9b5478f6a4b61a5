"""Which old checkpoints may be deleted after a save commits: keep the newest K and the milestones. No torch."""

from __future__ import annotations

from trainctl.checkpoint.format import CheckpointInfo


def is_milestone(step: int, milestone_every: int | None) -> bool:
    return bool(milestone_every) and step > 0 and step % milestone_every == 0


def to_delete(infos: list[CheckpointInfo], keep_last: int, milestone_every: int | None = None,
              current: int | None = None) -> list[CheckpointInfo]:
    """Valid checkpoints that retention may delete: all but the newest `keep_last` valid ones and milestones.

    Pure. Invalid checkpoints are never chosen (they stay for inspection; stale staging dirs are
    cleaned separately), and since keep_last >= 1 the newest valid checkpoint is always kept. Call
    it only after the newest save has committed, so nothing is deleted in favour of a torn save.
    `current` (the step just committed): checkpoints after it (left by a rewound run) are neither
    counted nor deleted, so they cannot push the fresh checkpoint out.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    valid = sorted((i for i in infos if i.valid and (current is None or i.step <= current)), key=lambda i: i.step)
    keep = {i.step for i in valid[-keep_last:]}
    keep |= {i.step for i in valid if i.milestone or is_milestone(i.step, milestone_every)}
    return [i for i in valid if i.step not in keep]

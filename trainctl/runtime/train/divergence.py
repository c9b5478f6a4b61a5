"""The divergence guard: skip a step whose loss or gradient norm is not finite, stop (or roll back) after
several in a row (docs/design/trainer.md, "Divergence guard"; spec section `train.divergence`).

Every step the trainer already reduces the global gradient norm and the mean loss in one all-reduce over
every rank. Two more numbers travel in that same all-reduce: how many ranks found a non-finite value in
their own gradients (all of them, counted in the norm or not: a data-parallel replica's copy is not
counted, yet its optimizer reads it) and how many in their own loss. Every rank reads the decision from
the same reduced buffer, so every rank of every pipeline stage skips the same steps, as the stop flag of
runtime/train/signals.py makes every rank stop after the same step.

A skipped step applies no optimizer update (the weights, the AdamW moments and its step count stay as
they were); the step still counts (the LR schedule and the data move on), is written to metrics.jsonl
with `skipped: true`, recorded as a `step_skipped` event and printed on the console. No checkpoint is
saved while skips are in a row, so retention never deletes the last checkpoint from before them and the
newest checkpoint is always a finite state from before the trouble.

After `train.divergence.max_consecutive_skips` skips in a row the run stops: event `diverged`, the line
"diverged at step N ...", exit 3 (EXIT_DIVERGED) run bare or under srun; 0 under torchrun, whose agent
would otherwise restart the workers into the same divergence (as checkpointing.requeue_code does for 75);
the local launcher reads the event and exits 3.

With `rollback: true` it instead reloads the newest checkpoint (the last one before the skips began) and
skips the data window since that checkpoint: the next step reads the batch after the last one that was
skipped. This is the remedy of PaLM (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with
Pathways", section 5.1 "Training instability"): for loss spikes that a given batch order provokes, "restart
training from a checkpoint roughly 100 steps before the spike started, and skip roughly 200-500 data
batches"; with the data skipped the spikes did not recur. At most `max_rollbacks` times, then it stops as
diverged.

With fp16 loss scaling a non-finite gradient is the loss scaler's overflow (it halves the scale and skips
the step, as GradScaler does): only a non-finite loss counts as divergence there.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainctl.errors import EXIT_DIVERGED, EXIT_OK
from trainctl.rundir.paths import RunPaths, record_event
from trainctl.runtime.observe import metrics
from trainctl.runtime.train import faults, signals
from trainctl.spec.models import RunSpec

if TYPE_CHECKING:
    from trainctl.runtime.checkpoint.policy import Checkpointing
    from trainctl.runtime.parallel.process_groups import Parallel
    from trainctl.runtime.train.loader import BatchLoader


@dataclass(frozen=True)
class Reduced:
    """The step's global numbers, identical on every rank (one all-reduce)."""

    norm: float  # global gradient norm, each element counted once (unscaled)
    loss: float  # global mean loss (unscaled)
    bad_grad_ranks: int  # ranks whose own gradients hold a NaN/inf
    bad_loss_ranks: int  # ranks whose own loss is NaN/inf


def reduce_norm_and_loss(pieces: list[tuple[torch.Tensor, bool]], loss: torch.Tensor | None, par: Parallel,
                         scale: float) -> Reduced:
    """Global grad norm (each element counted once across TP/PP/DP), the global mean loss and the two
    non-finite counts, in one all-reduce. Hand-written: clip_grad_norm_ fails across meshes and
    double-counts replicas. Every piece is checked for NaN/inf, counted in the norm or not."""
    dev = par.device
    sq = torch.zeros((), dtype=torch.float64, device=dev)
    bad_grad = torch.zeros((), dtype=torch.float64, device=dev)
    pieces = [(g, counted) for g, counted in pieces if g.numel()]
    if pieces:
        norms = torch.stack(torch._foreach_norm([g.float() if g.dtype != torch.float64 else g
                                                 for g, _ in pieces])).double()
        counted = torch.tensor([c for _, c in pieces], device=dev)
        sq = torch.where(counted, norms, torch.zeros_like(norms)).pow(2).sum()
        bad_grad = (~torch.isfinite(norms)).any().double()
    contrib = torch.zeros((), dtype=torch.float64, device=dev)
    if loss is not None and par.tp_rank == 0:
        contrib = loss.double() / par.dp
    bad_loss = (~torch.isfinite(contrib)).double()
    buf = torch.stack([sq, contrib, bad_grad, bad_loss])
    if par.world_size > 1:
        dist.all_reduce(buf, group=par.world_group)
    sq_v, loss_v, bg, bl = buf.tolist()
    inv = 1.0 / scale
    return Reduced(math.sqrt(sq_v) * inv, loss_v * inv, int(bg) if math.isfinite(bg) else 1,
                   int(bl) if math.isfinite(bl) else 1)


def exit_code() -> int:
    """3 after divergence; 0 under torchrun (its agent restarts workers after any other status; the
    launcher reads the `diverged` event instead)."""
    return EXIT_OK if "TORCHELASTIC_RESTART_COUNT" in os.environ else EXIT_DIVERGED


def _nan_window() -> tuple[int, int]:
    """The nan_at_step fault: (first, last) batch number (1-based), (0, -1) when off."""
    value = faults.get("nan_at_step")
    if not value:
        return 0, -1
    lo, _, hi = value.partition("-")
    return int(lo), int(hi or lo)


class DivergenceGuard:
    """Collective decisions from identical inputs: every rank holds the same counters."""

    def __init__(self, spec: RunSpec, paths: RunPaths, par: Parallel, loss_scaling: bool) -> None:
        d = spec.train.divergence
        self.max_in_row, self.rollback_on, self.max_rollbacks = d.max_consecutive_skips, d.rollback, d.max_rollbacks
        self.paths, self.log, self.rank = paths, par.rank == 0, par.rank
        self.loss_scaling = loss_scaling
        self.in_row = 0  # skipped steps in a row, now
        self.first_in_row: int | None = None  # the first step of the current run of skips
        self.skipped = 0  # skipped steps in this process
        self.rollbacks = 0
        self.nan_lo, self.nan_hi = _nan_window()
        self.nan_rank = faults.get_int("nan_rank", par.world_size - 1)

    @property
    def in_streak(self) -> bool:
        """Skips in a row now: the state is suspect, so no checkpoint is saved (checkpointing.after_step)."""
        return self.in_row > 0

    def poison(self, batch_no: int, grads: list[torch.Tensor]) -> None:
        """The nan_at_step fault: a NaN in this rank's first gradient when it trains on batch `batch_no`."""
        if self.nan_lo <= batch_no <= self.nan_hi and self.rank == self.nan_rank:
            for g in grads:
                if g.numel():
                    g.view(-1)[0] = float("nan")
                    return

    def check(self, step: int, r: Reduced) -> str | None:
        """Why step `step` (1-based) must be skipped, or None. The same answer on every rank."""
        loss_bad = r.bad_loss_ranks > 0 or not math.isfinite(r.loss)
        grad_bad = r.bad_grad_ranks > 0 or not math.isfinite(r.norm)
        if self.loss_scaling and not loss_bad:
            return None  # fp16: a non-finite gradient is the loss scaler's overflow, handled there
        if not (loss_bad or grad_bad):
            if self.in_row and self.log:
                record_event(self.paths, "divergence_recovered", step=step, skipped_in_row=self.in_row)
            self.in_row, self.first_in_row = 0, None
            return None
        what = " and ".join(w for w, bad in (("loss", loss_bad), ("gradient norm", grad_bad)) if bad)
        ranks = max(r.bad_grad_ranks, r.bad_loss_ranks)
        reason = f"non-finite {what}" + (f" on {ranks} rank{'s' if ranks != 1 else ''}" if ranks else "")
        self.in_row += 1
        self.skipped += 1
        if self.first_in_row is None:
            self.first_in_row = step
        if self.log:
            record_event(self.paths, "step_skipped", step=step, reason=reason, in_row=self.in_row,
                         loss=r.loss if math.isfinite(r.loss) else None,
                         grad_norm=r.norm if math.isfinite(r.norm) else None)
            metrics.warn(f"step {step} skipped: {reason} (no optimizer update on any rank; {self.in_row} in a "
                         f"row, the run stops at {self.max_in_row})")
        return reason

    def may_save(self, step: int, tensors: list[torch.Tensor], device: torch.device, *, scheduled: bool = True) -> bool:
        """Whether a checkpoint of this state may be written (collective): never while skips are in a row
        (a scheduled save only: the final save of a run that completes keeps the weights from before them),
        never when a weight (or an fp32 master copy) on any rank is NaN/inf."""
        if scheduled and self.in_row:
            if self.log:
                record_event(self.paths, "checkpoint_deferred", step=step, reason="skipped steps in a row")
            return False
        by_device: dict[torch.device, list[torch.Tensor]] = {}  # optimizer offload: masters on the host
        for t in tensors:
            if t.numel():
                by_device.setdefault(t.device, []).append(t.float() if t.dtype != torch.float64 else t)
        bad = any(not bool(torch.isfinite(torch.stack(torch._foreach_norm(ts))).all()) for ts in by_device.values())
        if signals.agree([int(bad)], device)[0]:
            if self.log:
                record_event(self.paths, "checkpoint_refused", step=step, reason="non-finite weights")
                metrics.warn(f"checkpoint of step {step} not saved: a weight is NaN/inf (the last finite "
                             "checkpoint is kept)")
            return False
        return True

    def action(self, last_checkpoint: int) -> str | None:
        """After a step: None (go on), "rollback" or "stop"."""
        if self.in_row < self.max_in_row:
            return None
        if self.rollback_on and self.rollbacks < self.max_rollbacks and last_checkpoint > 0:
            return "rollback"
        return "stop"

    def stop(self, step: int, last_checkpoint: int) -> int:
        """Record the divergence (rank 0) and return the exit status."""
        if self.log:
            kept = last_checkpoint or None
            why = ""
            if self.rollback_on:
                why = (f"; {self.rollbacks} rollback{'s' if self.rollbacks != 1 else ''} used of {self.max_rollbacks}"
                       if last_checkpoint else "; no checkpoint to roll back to")
            record_event(self.paths, "diverged", step=step, first_skipped_step=self.first_in_row,
                         skipped_in_row=self.in_row, skipped_total=self.skipped, rollbacks=self.rollbacks,
                         last_finite_checkpoint=kept, exit_code=EXIT_DIVERGED)
            print(f"trainctl: diverged at step {step}: the loss or gradient norm was not finite for {self.in_row} "
                  f"steps in a row (since step {self.first_in_row}){why}; last finite checkpoint "
                  f"{'step ' + str(kept) if kept else 'none'}", flush=True)
        return exit_code()

    def rollback(self, step: int, ckpt: Checkpointing, loader: BatchLoader) -> int:
        """Reload the newest checkpoint (the last before the skips: none is saved during them) and skip the
        data since it; returns the step to continue from. Collective."""
        position = loader.consumed  # identical on every rank: the global slot counter
        first = self.first_in_row
        to = ckpt.resume().step
        skipped_batches = (position - loader.consumed) // loader.global_batch
        first_batch = loader.consumed // loader.global_batch + 1
        loader.consumed = position  # skip the window (PaLM section 5.1)
        self.rollbacks += 1
        if self.log:
            record_event(self.paths, "rollback", step=step, to_step=to, first_skipped_step=first,
                         skipped_in_row=self.in_row, skipped_batches=skipped_batches,
                         batches=[first_batch, first_batch + skipped_batches - 1],
                         rollback=self.rollbacks, max_rollbacks=self.max_rollbacks)
            metrics.warn(f"rolled back from step {step} to checkpoint step {to} after {self.in_row} skipped steps "
                         f"in a row, skipping data batches {first_batch}-{first_batch + skipped_batches - 1} "
                         f"(rollback {self.rollbacks} of {self.max_rollbacks})")
        self.in_row, self.first_in_row = 0, None
        return to


def summary(guard: DivergenceGuard) -> dict[str, Any]:
    """For the `finish` event."""
    return {"skipped_steps": guard.skipped, "rollbacks": guard.rollbacks}

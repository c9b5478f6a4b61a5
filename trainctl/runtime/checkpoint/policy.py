"""The trainer's checkpointing policy: auto-resume at start, saves on schedule, stop-on-signal, final save.

Called from Trainer.run() at three points (start, after every step, end) with the parts a checkpoint holds
(state.TrainState), never the Trainer: it fills those parts in place and returns what it restored. The
state layout is in trainctl.runtime.checkpoint.state, the storage (DCP, async, atomic commit) in
trainctl.runtime.checkpoint.storage, the on-disk format and the save schedule in trainctl.checkpoint.

Auto-resume: at start the newest valid checkpoint in the checkpoint directory is loaded (invalid ones,
torn or truncated or without marker, are reported and skipped; checksums are verified). `trainctl resume
--from-step N` moves newer checkpoints aside before relaunching, so "newest valid" is then N.

Resharding on resume: tp, dp, zero and the pipeline split (pp, schedule, virtual stages) may change; the
global batch is kept (micro-batches per replica follow from dp); TP shards are rebuilt from the old ones
(trainctl.runtime.checkpoint.state). The model must be the same: another shape is refused before any step runs,
naming the difference (docs/design/checkpoints.md, "Checkpoint format and commit protocol").
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainctl.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    SaveSchedule,
    different_model,
    layout_changes,
    layout_of,
    model_of,
    owner,
    resolve_checkpoint_dir,
    same_layout,
)
from trainctl.data import identity as data_identity
from trainctl.errors import EXIT_OK, EXIT_STOPPED, RunError
from trainctl.plan.checkpoint_size import checkpoint_bytes
from trainctl.rundir.paths import DirIdentity, RunPaths, read_jsonl, record_event
from trainctl.runtime.checkpoint import state
from trainctl.runtime.checkpoint.storage import CheckpointManager, set_rng_state
from trainctl.runtime.observe import metrics
from trainctl.runtime.parallel.process_groups import timeout_s
from trainctl.runtime.train import faults, signals
from trainctl.runtime.train.loader import BatchLoader
from trainctl.spec import frozen_text
from trainctl.spec.models import RunSpec


@dataclass(frozen=True)
class Resumed:
    """What resume() restored: the first step to run (0: a fresh start) and the checkpoint it came from."""

    step: int
    checkpoint: CheckpointInfo | None = None
    same_layout: bool = True  # False: resharded, and the RNG streams start afresh


def save_meta(spec: RunSpec, paths: RunPaths, loader: BatchLoader, step: int,
              data: list[dict[str, Any]]) -> dict[str, Any]:
    try:
        spec_hash = hashlib.sha256(paths.spec.read_bytes()).hexdigest()
    except OSError:
        spec_hash = None
    return {"step": step, "layout": layout_of(spec), "model": model_of(spec),
            "seed": spec.train.seed, "global_batch": spec.train.global_batch,
            "consumed_samples": loader.consumed, "tokens": loader.consumed * spec.model.seq_len,
            "spec_sha256": spec_hash, "data": data,
            # the spec this state was trained with, as spec.yaml holds it: what `trainctl resume --repair` writes
            # back when the run directory's copy is lost or damaged (launch/repair.py)
            "spec": frozen_text(spec)}


def data_trained_on(spec: RunSpec, paths: RunPaths) -> list[dict[str, Any]]:
    """The identity of the spec's token files now (trainctl.data.identity), refusing a file changed since the run
    recorded it in job.json: restarts that no `trainctl resume` checked (a Slurm requeue, a torchrun restart)
    stop here, before any step."""
    recorded = data_identity.recorded(_job(paths).get("data"))
    now, _ = data_identity.compare(spec, recorded, since="the run recorded it (job.json)", run=str(paths.root))
    return [i.to_json() for i in now]


def _job(paths: RunPaths) -> dict[str, Any]:
    """The run's job.json, or {} for ranks started without a launcher (tests): nothing recorded to compare with."""
    try:
        job = json.loads(paths.job.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return job if isinstance(job, dict) else {}


def check_compatible(info: CheckpointInfo, spec: RunSpec) -> None:
    """Refuse, before any compute, a checkpoint of another model (or not written by this trainer)."""
    meta = info.meta or {}
    if "layout" not in meta or "model" not in meta:
        raise CheckpointError(f"{info.path}: checkpoint of step {info.step} was not written by the trainctl trainer "
                              "(no layout/model in its manifest)",
                              hint="move it out of the checkpoint directory or pick another with --from-step")
    problem = different_model(spec, info)
    if problem:
        raise CheckpointError(problem, hint="resume with the model the checkpoint was written with, or use a fresh "
                                            "run directory")


def host_memory_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (or the `host_memory` fault); None where there is no such file."""
    pretend = faults.get_int("host_memory")
    if pretend:
        return pretend
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


RESHARD_BATCH_ENV = "TRAINCTL_RESHARD_BATCH_BYTES"
DEFAULT_RESHARD_BATCH_BYTES = 1 << 30


def reshard_batch_bytes() -> int:
    """Bytes of old TP shards one rank reads at a time during a TP reshard (default 1 GiB)."""
    return int(os.environ.get(RESHARD_BATCH_ENV) or DEFAULT_RESHARD_BATCH_BYTES)


def reshard_memory_problem(parts: state.TrainState, info: CheckpointInfo, from_tp: int,
                           batches: list[list[state.Entry]]) -> str | None:
    """Why this rank's TP reshard would not fit in host memory (its largest batch of old shards, times the
    ranks of this node reading at once), or None."""
    need = max((state.batch_bytes(parts, b, from_tp) for b in batches), default=0)
    avail = host_memory_available()
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or 1)
    if avail is None or need * ranks_here <= 0.8 * avail:
        return None
    return (f"{info.path}: resharding tp {from_tp} -> {parts.par.tp} reads whole old TP shards (weights and "
            f"moments) in batches: the largest needs {need / 1e9:.2f} GB x {ranks_here} ranks on this node, but "
            f"only {avail / 1e9:.2f} GB of host memory is available")


def run_dir_deleted(paths: RunPaths, step: int) -> RunError:
    """A rank's one line when its run directory was deleted under the job: it stops, writing nothing there."""
    return RunError(f"the run directory {paths.root} was deleted under the running job (after step {step}); this "
                    "rank stops without writing there")


def requeue_code() -> int:
    """Exit status after a stop signal and its committed checkpoint.

    75 ("requeue me") for a bare run. 0 under torchrun, whose agent restarts the workers after any non-zero
    exit (they would resume and keep training while the job is being preempted), and under srun, which
    would print "srun: error: ... Exited with exit code 75" for a clean stop. Launchers and the Slurm batch
    script read the `checkpoint_on_signal` event instead (rundir/runstate.py)."""
    launched = "TORCHELASTIC_RESTART_COUNT" in os.environ or "SLURM_STEP_ID" in os.environ
    return EXIT_OK if launched else EXIT_STOPPED


class Checkpointing:
    """Collective: construct, resume(), after_step() and finish() on every rank at the same points."""

    def __init__(self, spec: RunSpec, paths: RunPaths, parts: state.TrainState) -> None:
        self.spec, self.paths, self.parts = spec, paths, parts
        self.log = parts.par.rank == 0
        ck = spec.checkpoint
        self.dir = resolve_checkpoint_dir(paths.root, spec)
        # the run directory as this rank found it: one deleted under the job stops it (after_step)
        self.run_dir = DirIdentity.of(paths.root)
        # every rank, before anything is written or pruned there: a Slurm requeue or torchrun restart of a run
        # whose checkpoint directory another run owns stops here (no `trainctl` command saw it)
        if (foreign := owner.problem(self.dir, paths.root, _job(paths))) is not None:
            raise CheckpointError(foreign)
        # Raises CheckpointError on every rank when the directory is not writable (read-only, full, a file).
        self.mgr = CheckpointManager(self.dir, rank=parts.par.rank, world_size=parts.par.world_size,
                                     keep_last=ck.keep_last, milestone_every=ck.milestone_every,
                                     async_save=ck.async_save, events=paths, timeout_s=timeout_s(),
                                     expected_bytes=checkpoint_bytes(spec))
        self.schedule = SaveSchedule(ck.every_steps, ck.every_minutes)
        self.blocked_s = 0.0  # the loop was blocked this long by saves since take_blocked_s()
        self.stop = signals.STOP.install()  # entry.main installed it already; idempotent
        self.stop_after = signals.stop_after_step()
        # Rank 0 writes the manifests: the data files' identity goes into every checkpoint.
        self.data = data_trained_on(spec, paths) if self.log else []

    # -- start ------------------------------------------------------------------------------------------
    def resume(self) -> Resumed:
        """Load the newest valid checkpoint, if any, into the parts; the first step to run and its source."""
        parts = self.parts
        t0 = time.perf_counter()
        info = self.mgr.latest_valid()
        if info is None:
            return Resumed(0)
        check_compatible(info, self.spec)
        state.ensure_optimizer_state(parts.opt)
        built: dict[str, Any] = {}

        def state_for(chosen: CheckpointInfo) -> dict[str, Any]:
            check_compatible(chosen, self.spec)
            built["from_tp"] = chosen.meta["layout"]["tp"]
            if built["from_tp"] != parts.par.tp:
                built["batches"] = state.tp_reshard_batches(parts, built["from_tp"], reshard_batch_bytes())
                problem = self.mgr.first_problem(reshard_memory_problem(parts, chosen, built["from_tp"],
                                                                        built["batches"]))
                if problem:
                    raise CheckpointError(problem, hint=f"set {RESHARD_BATCH_ENV} lower (a batch holds at least "
                                                        f"one parameter), or resume with --set parallel.tp="
                                                        f"{built['from_tp']}")
            built["state"] = state.app_state(parts, 0, from_tp=built["from_tp"])
            return built["state"]

        # Verifies checksums first and may fall back to an older checkpoint, possibly of another tp.
        info, rank_state = self.mgr.load(None, state_for)
        if built["from_tp"] != parts.par.tp:
            self._reshard_tp(info, built["from_tp"], built["batches"])
        step = state.restore(parts, built["state"])
        load_s = time.perf_counter() - t0  # checksums, DCP read and any resharding
        same = same_layout(self.spec, info.meta)
        psgd = state.restore_powersgd(parts, rank_state if same else None)
        if psgd is False and self.log:
            metrics.warn(f"resuming step {step} without this layout's PowerSGD state (another layout, rank, or "
                         "no compression in the checkpoint): its error feedback starts at zero and Q is drawn anew")
        if same and rank_state is not None:
            set_rng_state(rank_state["rng"], cuda=parts.par.device.type == "cuda")
        elif self.log:
            changes = ", ".join(layout_changes(self.spec, info.meta)) or "another world size"
            metrics.warn(f"resuming step {step} with another layout ({changes}): "
                         "model, optimizer and data position are resharded; RNG streams start afresh")
        self.schedule.mark(step)
        if self.log:
            self._report_resume(step, info, same, load_s)
        return Resumed(step, info, same)

    def _reshard_tp(self, info: CheckpointInfo, old_tp: int, batches: list[list[state.Entry]]) -> None:
        """Load the old TP shards batch by batch (collective: every rank runs as many loads as the rank
        with the most batches) and move each into this rank's new shard."""
        for i in range(self.mgr.agree_max(len(batches))):
            batch = batches[i] if i < len(batches) else []
            st = state.old_shards_state(self.parts, batch, old_tp)
            self.mgr.load_more(info, st)
            state.apply_old_shards(self.parts, batch, st, old_tp)

    def _report_resume(self, step: int, info: CheckpointInfo, same_layout: bool, load_s: float) -> None:
        """Rank 0: the resume_from event and console line, naming the logged steps that will run again."""
        logged = [r.get("step") for r in read_jsonl(self.paths.metrics)]
        replayed = sorted({s for s in logged if isinstance(s, int) and s > step})
        record_event(self.paths, "resume_from", step=step, path=str(info.path), same_layout=same_layout,
                     load_s=round(load_s, 4),
                     replayed_steps=len(replayed), replayed_from=replayed[0] if replayed else None,
                     replayed_to=replayed[-1] if replayed else None)
        print(f"trainctl: resumed from checkpoint step {step} ({info.path})"
              + (f"; steps {replayed[0]}-{replayed[-1]} were logged after it and run again" if replayed else ""),
              flush=True)

    # -- every step -------------------------------------------------------------------------------------
    def after_step(self, step: int, may_save: Callable[[], bool] | None = None) -> int | None:
        """After optimizer step `step` (1-based): save when due; on a stop request save synchronously and
        return the exit code (75 after a signal, 0 for the stop_after_step fault), else None. An async save
        that failed on any rank raises its error here, on every rank (one step after it was known at most).

        `may_save` (collective, asked only when a scheduled save is due): False defers the save, so that no
        checkpoint holds a diverging or non-finite state (runtime/train/divergence.py)."""
        lost = self.run_dir.lost(self.paths.root)
        sig, time_due_all, save_failed, run_dir_lost = signals.agree(
            [self.stop.signum, int(self.schedule.time_due()), int(self.mgr.failed()), int(lost is not None)],
            self.parts.par.device)
        if run_dir_lost:  # every rank stops after the same step, writing nothing more there (nor making it again)
            raise run_dir_deleted(self.paths, step)
        if save_failed:  # an async save failed (a full disk...): stop now, not at the next save
            self.mgr.wait()  # raises its error, the same on every rank (the writers agree on a failure)
            raise CheckpointError(f"a checkpoint save failed on another rank; stopping after step {step}")
        if sig or step == self.stop_after:
            self.save(step, wait=True)
            if self.log:
                if sig:
                    record_event(self.paths, "checkpoint_on_signal", step=step, signal=signals.name(sig),
                                 reason=signals.why(sig))
                    record_event(self.paths, "preempted", step=step, signal=signals.name(sig),
                                 reason=f"{signals.why(sig)}: checkpointed step {step}, exit {requeue_code()}")
                else:
                    record_event(self.paths, "stopped", step=step, reason=f"fault stop_after_step={step}")
                print(f"trainctl: stopping after step {step} (checkpoint committed)", flush=True)
            return requeue_code() if sig else EXIT_OK
        due = step < self.spec.train.steps and (self.schedule.step_due(step) or time_due_all)
        if due and (may_save is None or may_save()):
            self.save(step, wait=False)
        return None

    def stop_before_first_step(self, step: int) -> int | None:
        """A stop requested during start-up (collective): stop before training, with nothing new to save
        (`step` is what was loaded, or 0); the exit code, else None."""
        (sig,) = signals.agree([self.stop.signum], self.parts.par.device)
        if not sig:
            return None
        if self.log:
            record_event(self.paths, "checkpoint_on_signal", step=step, signal=signals.name(sig),
                         reason=signals.why(sig), before_first_step=True)
            print(f"trainctl: stopping before the first step ({signals.why(sig)}); nothing new to save", flush=True)
        return requeue_code()

    def save(self, step: int, wait: bool) -> None:
        t0 = time.perf_counter()
        if step == self.schedule.last_step:  # already saved (or loaded) at this step: at most wait for its commit
            if wait:
                self.mgr.wait()
            self.blocked_s += time.perf_counter() - t0
            return
        parts = self.parts
        self.mgr.save(step, state.app_state(parts, step), state.rank_state(parts),
                      save_meta(self.spec, self.paths, parts.loader, step, self.data))
        if wait:
            self.mgr.wait()
        self.blocked_s += time.perf_counter() - t0  # the loop was blocked this long (outside step time)
        self.schedule.mark(step)

    def take_blocked_s(self) -> float:
        """Seconds the training loop spent blocked in saves since the last call (metrics: ckpt_block_s)."""
        blocked, self.blocked_s = self.blocked_s, 0.0
        return blocked

    # -- end --------------------------------------------------------------------------------------------
    def finish(self, step: int, may_save: Callable[[], bool] | None = None) -> None:
        """After the last step: a final checkpoint when checkpointing is configured (and `may_save` agrees,
        as in after_step); wait for the writer."""
        if self.schedule.enabled and step > self.schedule.last_step and (may_save is None or may_save()):
            self.save(step, wait=True)
        self.mgr.wait()

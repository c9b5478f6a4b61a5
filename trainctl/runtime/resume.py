"""The trainer's checkpointing: auto-resume at start, saves on schedule, stop-on-signal, final save.

Called from Trainer.run() at three points (start, after every step, end); the state layout is in
trainctl.runtime.state, the storage (DCP, async, atomic commit) in trainctl.runtime.checkpoint.

Auto-resume: at start the newest valid checkpoint in the checkpoint directory is loaded (invalid ones,
torn or truncated or without marker, are reported and skipped; checksums are verified). `trainctl resume
--from-step N` moves newer checkpoints aside before relaunching, so "newest valid" is then N.

Resharding on resume: tp, dp, zero and the pipeline split (pp, schedule, virtual stages) may change; the
global batch is kept (micro-batches per replica follow from dp); TP shards are rebuilt from the old ones
(trainctl.runtime.state). The model must be the same: another shape is refused before any step runs,
naming the difference.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainctl.checkpoint_meta import layout_changes, layout_of, model_differences, model_of
from trainctl.checkpoints import CheckpointError, CheckpointInfo
from trainctl.errors import EXIT_OK, EXIT_REQUEUE
from trainctl.rundir import read_jsonl, record_event
from trainctl.runtime import metrics, signals, state
from trainctl.runtime.checkpoint import CheckpointManager, set_rng_state
from trainctl.runtime.distributed import timeout_s

if TYPE_CHECKING:
    from trainctl.runtime.trainer import Trainer


def checkpoint_dir(tr: Trainer) -> Path:
    d = tr.spec.checkpoint.dir
    if not d:
        return tr.paths.checkpoints
    return Path(d) if Path(d).is_absolute() else tr.paths.root / d


def save_meta(tr: Trainer, step: int) -> dict[str, Any]:
    spec = tr.spec
    try:
        spec_hash = hashlib.sha256(tr.paths.spec.read_bytes()).hexdigest()
    except OSError:
        spec_hash = None
    return {"step": step, "layout": layout_of(spec), "model": model_of(spec),
            "seed": spec.train.seed, "global_batch": spec.train.global_batch,
            "consumed_samples": tr.loader.consumed, "tokens": tr.loader.consumed * spec.model.seq_len,
            "spec_sha256": spec_hash}


def check_compatible(info: CheckpointInfo, tr: Trainer) -> None:
    """Refuse, before any compute, a checkpoint of another model (or not written by this trainer)."""
    meta = info.meta or {}
    where = f"{info.path}: checkpoint of step {info.step}"
    if "layout" not in meta or "model" not in meta:
        raise CheckpointError(f"{where} was not written by the trainctl trainer (no layout/model in its manifest)",
                              hint="move it out of the checkpoint directory or pick another with --from-step")
    diffs = model_differences(tr.spec, meta)
    if diffs:
        raise CheckpointError(f"{where} is for a different model shape ({'; '.join(diffs)})",
                              hint="resume with the model the checkpoint was written with, or use a fresh run "
                                   "directory")


HOST_MEMORY_ENV = "TRAINCTL_TEST_HOST_MEMORY"  # test knob: pretend the node has this many bytes available


def host_memory_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where there is no such file."""
    if os.environ.get(HOST_MEMORY_ENV):
        return int(os.environ[HOST_MEMORY_ENV])
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


def reshard_memory_problem(tr: Trainer, info: CheckpointInfo, from_tp: int,
                           batches: list[list[state.Entry]]) -> str | None:
    """Why this rank's TP reshard would not fit in host memory (its largest batch of old shards, times the
    ranks of this node reading at once), or None."""
    need = max((state.batch_bytes(tr, b, from_tp) for b in batches), default=0)
    avail = host_memory_available()
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or 1)
    if avail is None or need * ranks_here <= 0.8 * avail:
        return None
    return (f"{info.path}: resharding tp {from_tp} -> {tr.par.tp} reads whole old TP shards (weights and "
            f"moments) in batches: the largest needs {need / 1e9:.2f} GB x {ranks_here} ranks on this node, but "
            f"only {avail / 1e9:.2f} GB of host memory is available")


def requeue_code() -> int:
    """Exit status after a stop signal and its committed checkpoint.

    75 ("requeue me") for srun or a bare run; 0 under torchrun, whose agent restarts the workers after
    any non-zero exit: they would resume and keep training while the job is being preempted. Launchers
    read the `checkpoint_on_signal` event instead (trainctl.launch.resume.stopped_for_requeue)."""
    return EXIT_OK if "TORCHELASTIC_RESTART_COUNT" in os.environ else EXIT_REQUEUE


class Checkpointing:
    """Collective: construct, resume(), after_step() and finish() on every rank at the same points."""

    def __init__(self, tr: Trainer) -> None:
        self.tr = tr
        ck = tr.spec.checkpoint
        self.dir = checkpoint_dir(tr)
        # Raises CheckpointError on every rank when the directory is not writable (read-only, full, a file).
        self.mgr = CheckpointManager(self.dir, rank=tr.par.rank, world_size=tr.par.world_size,
                                     keep_last=ck.keep_last, milestone_every=ck.milestone_every,
                                     async_save=ck.async_save, events=tr.paths, timeout_s=timeout_s())
        self.every_steps, self.every_minutes = ck.every_steps, ck.every_minutes
        self.last_saved = 0
        self.last_time = time.monotonic()
        self.stop = signals.StopFlag().install()
        self.stop_after = signals.test_stop_step()

    # -- start ------------------------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the newest valid checkpoint, if any; the first step to run (0 for a fresh start)."""
        tr = self.tr
        t0 = time.perf_counter()
        info = self.mgr.latest_valid()
        if info is None:
            return 0
        check_compatible(info, tr)
        state.ensure_optimizer_state(tr.opt)
        built: dict[str, Any] = {}

        def state_for(chosen: CheckpointInfo) -> dict[str, Any]:
            check_compatible(chosen, tr)
            built["from_tp"] = chosen.meta["layout"]["tp"]
            if built["from_tp"] != tr.par.tp:
                built["batches"] = state.tp_reshard_batches(tr, built["from_tp"], reshard_batch_bytes())
                problem = self.mgr.first_problem(reshard_memory_problem(tr, chosen, built["from_tp"],
                                                                        built["batches"]))
                if problem:
                    raise CheckpointError(problem, hint=f"set {RESHARD_BATCH_ENV} lower (a batch holds at least "
                                                        f"one parameter), or resume with --set parallel.tp="
                                                        f"{built['from_tp']}")
            built["state"] = state.app_state(tr, 0, from_tp=built["from_tp"])
            return built["state"]

        # Verifies checksums first and may fall back to an older checkpoint, possibly of another tp.
        info, rank_state = self.mgr.load(None, state_for)
        if built["from_tp"] != tr.par.tp:
            self._reshard_tp(info, built["from_tp"], built["batches"])
        step = state.restore(tr, built["state"])
        load_s = time.perf_counter() - t0  # checksums, DCP read and any resharding
        same_layout = info.meta.get("layout") == layout_of(tr.spec)
        if same_layout and rank_state is not None:
            set_rng_state(rank_state["rng"])
        elif tr.log:
            changes = ", ".join(layout_changes(tr.spec, info.meta)) or "another world size"
            metrics.warn(f"resuming step {step} with another layout ({changes}): "
                         "model, optimizer and data position are resharded; RNG streams start afresh")
        self.last_saved, self.last_time = step, time.monotonic()
        if tr.log:
            logged = [r.get("step") for r in read_jsonl(tr.paths.metrics)]
            replayed = sorted({s for s in logged if isinstance(s, int) and s > step})
            record_event(tr.paths, "resume_from", step=step, path=str(info.path), same_layout=same_layout,
                         load_s=round(load_s, 4),
                         replayed_steps=len(replayed), replayed_from=replayed[0] if replayed else None,
                         replayed_to=replayed[-1] if replayed else None)
            print(f"trainctl: resumed from checkpoint step {step} ({info.path})"
                  + (f"; steps {replayed[0]}-{replayed[-1]} were logged after it and run again" if replayed else ""),
                  flush=True)
        return step

    def _reshard_tp(self, info: CheckpointInfo, old_tp: int, batches: list[list[state.Entry]]) -> None:
        """Load the old TP shards batch by batch (collective: every rank runs as many loads as the rank
        with the most batches) and move each into this rank's new shard."""
        tr = self.tr
        for i in range(self.mgr.agree_max(len(batches))):
            batch = batches[i] if i < len(batches) else []
            st = state.old_shards_state(tr, batch, old_tp)
            self.mgr.load_more(info, st)
            state.apply_old_shards(tr, batch, st, old_tp)

    # -- every step -------------------------------------------------------------------------------------
    def after_step(self, step: int) -> int | None:
        """After optimizer step `step` (1-based): save when due; on a stop request save synchronously and
        return the exit code (75 after a signal, 0 for the test knob), else None."""
        tr = self.tr
        time_due = bool(self.every_minutes) and time.monotonic() - self.last_time >= self.every_minutes * 60
        sig, time_due_all = signals.agree([self.stop.signum, int(time_due)], tr.par.device)
        if sig or step == self.stop_after:
            self.save(step, wait=True)
            if tr.log:
                if sig:
                    record_event(tr.paths, "checkpoint_on_signal", step=step, signal=signals.name(sig))
                    record_event(tr.paths, "preempted", step=step, signal=signals.name(sig),
                                 reason=f"{signals.name(sig)}: checkpointed step {step}, exit {requeue_code()}")
                else:
                    record_event(tr.paths, "stopped", step=step, reason=f"{signals.STOP_AFTER_ENV}={step}")
                print(f"trainctl: stopping after step {step} (checkpoint committed)", flush=True)
            return requeue_code() if sig else EXIT_OK
        if step < tr.spec.train.steps and (
                (self.every_steps and step % self.every_steps == 0) or time_due_all):
            self.save(step, wait=False)
        return None

    def save(self, step: int, wait: bool) -> None:
        tr = self.tr
        t0 = time.perf_counter()
        if step == self.last_saved:  # already saved (or loaded) at this step: at most wait for its commit
            if wait:
                self.mgr.wait()
            tr.ckpt_block_s += time.perf_counter() - t0
            return
        self.mgr.save(step, state.app_state(tr, step), state.rank_state(tr), save_meta(tr, step))
        if wait:
            self.mgr.wait()
        tr.ckpt_block_s += time.perf_counter() - t0  # the loop was blocked this long (outside step time)
        self.last_saved, self.last_time = step, time.monotonic()

    # -- end --------------------------------------------------------------------------------------------
    def finish(self, step: int) -> None:
        """After the last step: a final checkpoint when checkpointing is configured; wait for the writer."""
        if (self.every_steps or self.every_minutes) and step > self.last_saved:
            self.save(step, wait=True)
        self.mgr.wait()
        self.stop.uninstall()

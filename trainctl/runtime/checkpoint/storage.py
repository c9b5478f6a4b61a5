"""Sharded, async, atomic checkpoints with torch.distributed.checkpoint (DCP).

Every rank calls the same methods at the same step (they run collectives). The on-disk format and
the commit scheme (staging dir, manifest, COMMITTED marker, atomic rename) are described in
trainctl/checkpoint/format.py; that package also decides validity and retention without torch.

Async save: `save()` copies the state to host memory (reused buffers) and returns; a background
thread writes it with DCP, checksums, and commits. The thread talks over its OWN gloo group
(training collectives on the default group and DCP's on the same group hang: docs/design/checked-facts.md,
"Checked facts: PyTorch distributed on CPU/gloo").
At most one save is in flight: the next `save()`, `load()` or `wait()` waits for it and re-raises
its error, on every rank. `failed()` says, without waiting, that the save in flight failed: the trainer
agrees on it across ranks after every step and stops there (runtime/checkpoint/policy.py).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import secrets
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Collection
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.tensor import DTensor

from trainctl.checkpoint import (
    DCP_INDEX,
    FORMAT_VERSION,
    HASH,
    MANIFEST,
    MARKER,
    CheckpointError,
    CheckpointInfo,
    code_version,
    digest_problem,
    file_digest,
    find_step,
    fsync_path,
    inspect_checkpoint,
    is_milestone,
    latest_valid,
    list_checkpoints,
    manifest_bytes,
    marker_bytes,
    rank_state_filename,
    read_manifest,
    staging_dirname,
    stale_dirs,
    step_dirname,
    to_delete,
    trash_dirname,
    write_durable,
)
from trainctl.checkpoint.space import DISK_FULL_EVENT, dir_bytes, disk_full_message, free_bytes, is_disk_full
from trainctl.rundir.paths import RunPaths, read_jsonl, record_event
from trainctl.runtime.train import faults

# ZeRO-1/2 optimizer state is saved as ShardedTensors (each DP rank owns a flat range; DCP reshards range
# to range). torch warns on every touch that ShardedTensor is deprecated in favour of DTensor, which has no
# uneven 1-D range sharding; keep the console readable until it does.
warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)

# We pass no_dist=True deliberately in one-process runs; DCP warns on every call anyway.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


class _InExistingDir(FileSystem):
    """DCP's file system, but a staging directory is made only inside the existing checkpoint directory: DCP's own
    mkdir makes the missing parents too, which brought a run directory deleted under the job back to life with
    half a checkpoint in it."""

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        Path(path).mkdir(exist_ok=True)


class CheckpointManager:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        rank: int = 0,
        world_size: int = 1,
        process_group: dist.ProcessGroup | None = None,
        keep_last: int | None = 3,
        milestone_every: int | None = None,
        async_save: bool = True,
        events: RunPaths | None = None,
        timeout_s: float = 600.0,
        expected_bytes: int | None = None,
    ) -> None:
        """Collective when distributed: creates the gloo group (unless given) and checks the directory.

        keep_last=None keeps everything. Raises CheckpointError on every rank when any rank cannot create and
        write files in `directory`, and removes leftovers of an earlier writer that died. expected_bytes: the
        planner's size of one checkpoint, named when a save fails for lack of space (plan/checkpoint_size.py).
        """
        self.dir = Path(directory)
        self.rank, self.world_size = rank, world_size
        self.keep_last, self.milestone_every = keep_last, milestone_every
        self.async_save = async_save
        self.events = events
        self._reported: set[Path] = set()  # checkpoints already reported as skipped (once each)
        self.expected_bytes = expected_bytes
        self.distributed = dist.is_available() and dist.is_initialized() and world_size > 1
        if self.distributed and process_group is None:
            process_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.pg = process_group
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._failing = False  # the save in flight is known to have failed; wait() raises its error
        self._buffers: dict[str, torch.Tensor] = {}
        self.last_stats: dict[str, Any] = {}
        self._check_writable()
        if rank == 0:
            for p in stale_dirs(self.dir):
                shutil.rmtree(p, ignore_errors=True)
                self._event("checkpoint_stale_removed", path=str(p))

    # --- public API ---------------------------------------------------------------------------

    def save(self, step: int, app_state: dict[str, Any], rank_state: dict[str, Any] | None = None,
             meta: dict[str, Any] | None = None) -> None:
        """Checkpoint `app_state` (DCP: model/optimizer state dicts, scalars, Stateful objects) and this
        rank's `rank_state` (RNG, data position; torch.save'd beside DCP) as step `step`.

        Async: returns once the state is copied to host memory; the caller may then mutate it.
        Sync: returns after the commit. Errors of the previous async save are raised here.
        """
        self.wait()
        t0 = time.perf_counter()
        try:  # goes into manifest.json: fail here, in the caller, rather than in the writer thread
            meta = json.loads(json.dumps(meta or {}))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint meta of step {step} is not JSON-serialisable: {e}") from e
        if self.async_save:
            staged = self._stage(app_state)
            staged_rank = copy.deepcopy(rank_state)
            blocked = time.perf_counter() - t0
            self.last_stats = {"step": step, "blocked_s": blocked}
            self._thread = threading.Thread(target=self._run, args=(step, staged, staged_rank, meta, t0),
                                            name=f"ckpt-save-{step}", daemon=True)
            self._thread.start()
        else:
            self.last_stats = {"step": step}
            self._write_and_commit(step, app_state, rank_state, meta)
            self.last_stats["blocked_s"] = time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._failing = False
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def settle(self, timeout_s: float) -> None:
        """On the way out of a failed run: give the save in flight up to `timeout_s` to commit. Its state was
        taken at a step that completed, so a failure after it (a changed data file, a bad batch) must not tear
        it; the daemon writer would die with the process. Its own error is left to its checkpoint_failed event
        (the run's failure is the one reported). Bounded, because a writer whose peers are gone waits for them
        until the group's timeout."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def failed(self) -> bool:
        """Whether the async save is known to have failed, from the moment its writers agree that it did (every
        rank learns it then, or at the latest when its error is set); wait() then raises the error."""
        return self._failing or self._error is not None

    def close(self) -> None:
        self.wait()

    def latest_valid(self) -> CheckpointInfo | None:
        """Newest valid checkpoint (shallow check; load() verifies checksums), as rank 0 sees it.

        Invalid newer ones are reported (stderr + events) and skipped.
        """
        self.wait()
        info: CheckpointInfo | None = None
        if self.rank == 0:
            info = self._latest(exclude=())
        return self._broadcast(info)

    def load(self, step: int | None, app_state: dict[str, Any] | Callable[[CheckpointInfo], dict[str, Any]], *,
             deep: bool = True) -> tuple[CheckpointInfo, dict[str, Any] | None]:
        """Load checkpoint `step` (None: the newest valid one) into `app_state` in place, with DCP
        (which reshards to this job's layout). `app_state` may be a function of the checkpoint chosen
        (after checksums, which may fall back to an older one) when what to load depends on how it was
        written (another tp). Returns (info, rank_state); rank_state is None when
        the checkpoint was written by a different world size (RNG streams no longer map to ranks;
        with the same world size but another tp/pp/dp split, compare info.meta's layout yourself).

        deep=True verifies every file's checksum first (split across ranks); a corrupt newest
        checkpoint is skipped for the one before it (step=None) or refused (explicit step).
        """
        self.wait()
        corrupt: set[int] = set()
        while True:
            info = self._choose(step, corrupt)
            reason = self._verify(info.path) if deep else None
            if reason is None:
                break
            if step is not None:
                raise CheckpointError(f"{info.path}: checkpoint of step {step} is invalid: {reason}")
            info.valid, info.reason = False, reason
            corrupt.add(info.step)  # left on disk for inspection; `trainctl checkpoints --deep` shows it
            if self.rank == 0:
                self._warn_skipped(info)
        self.load_more(info, app_state(info) if callable(app_state) else app_state)
        rank_state = None
        rs = info.path / rank_state_filename(self.rank)
        if info.world_size == self.world_size and rs.exists():
            # Our own file, its checksum verified above; holds numpy/python RNG tuples.
            rank_state = torch.load(rs, map_location="cpu", weights_only=False)
        self._event("checkpoint_loaded", step=info.step, path=str(info.path))
        return info, rank_state

    def load_more(self, info: CheckpointInfo, app_state: dict[str, Any]) -> None:
        """Load more of checkpoint `info` (already chosen and verified by load()) into `app_state` in place.
        Collective: every rank calls it the same number of times (an empty state where it needs nothing)."""
        self._check_shapes(info.path, app_state)
        try:
            dcp.load(app_state, checkpoint_id=str(info.path), process_group=self.pg, no_dist=not self.distributed)
        except BaseException as e:
            raise CheckpointError(f"{info.path}: loading step {info.step} failed: {_describe(e, self.rank)}") from e

    def agree_max(self, n: int) -> int:
        """The largest `n` over all ranks (collective)."""
        return max(self._all_gather(n))

    def first_problem(self, problem: str | None) -> str | None:
        """The lowest rank's problem, if any rank has one (collective): every rank then fails together
        instead of the others waiting in the next collective."""
        return next((p for p in self._all_gather(problem) if p is not None), None)

    # --- the write path (runs in the background thread when async) ----------------------------

    def _run(self, step: int, app_state: dict[str, Any], rank_state: dict[str, Any] | None,
             meta: dict[str, Any], t0: float) -> None:
        try:
            self._write_and_commit(step, app_state, rank_state, meta)
        except BaseException as e:  # surfaced by wait()
            self._error = e
        self.last_stats["total_s"] = time.perf_counter() - t0

    def _write_and_commit(self, step: int, app_state: dict[str, Any], rank_state: dict[str, Any] | None,
                          meta: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        nonce = self._broadcast(secrets.token_hex(4) if self.rank == 0 else None)
        tmp = self.dir / staging_dirname(step, nonce)
        files: dict[str, dict[str, Any]] = {}
        error, cause = None, None
        try:
            writer = FileSystemWriter(str(tmp), sync_files=True)
            writer.fs = _InExistingDir()
            dcp.save(app_state, storage_writer=writer, process_group=self.pg, no_dist=not self.distributed)
            if rank_state is not None:
                with open(tmp / rank_state_filename(self.rank), "wb") as f:
                    torch.save(rank_state, f)
                    f.flush()
                    os.fsync(f.fileno())
            slow = faults.get_float("slow_write_s")
            if slow > 0 and step >= faults.get_int("slow_write_from_step"):
                time.sleep(slow)
            for p in sorted(tmp.iterdir()):
                if self._owns(p.name):
                    size, digest = file_digest(p)
                    fsync_path(p)
                    files[p.name] = {"size": size, HASH: digest, "rank": self.rank}
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            error, cause = _describe(e, self.rank), e
        reports = self._all_gather({"error": error, "files": files})
        errors = list(dict.fromkeys(r["error"] for r in reports if r["error"]))  # DCP reports on every rank
        if errors:
            self._failing = True  # before the event: the training loop stops at its next step from here on
            self._event("checkpoint_failed", step=step, path=str(tmp), errors=errors)
            full = self._out_of_space(tmp, errors)
            if self.rank == 0:  # free the space (a full disk is a likely cause); it was never valid
                shutil.rmtree(tmp, ignore_errors=True)
            if full:
                raise self._disk_full(step) from cause
            raise CheckpointError(f"{tmp}: saving step {step} failed: " + "; ".join(errors),
                                  hint="nothing was committed; the previous checkpoint is still the latest") from cause
        write_s = time.perf_counter() - t0
        commit_error = None
        if self.rank == 0:
            try:
                all_files = {k: v for r in reports for k, v in r["files"].items()}
                self._commit(step, tmp, all_files, meta)
            except BaseException as e:
                commit_error = f"{type(e).__name__}: {e}"
        commit_error = self._broadcast(commit_error)
        if commit_error:
            self._failing = True
            self._event("checkpoint_failed", step=step, path=str(tmp), errors=[commit_error])
            if self._out_of_space(tmp, [commit_error]):
                if self.rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise self._disk_full(step)
            raise CheckpointError(f"{tmp}: committing step {step} failed: {commit_error}")
        nbytes = sum(v["size"] for v in files.values())
        self.last_stats.update(write_s=write_s, commit_s=time.perf_counter() - t0 - write_s, rank_bytes=nbytes)
        if self.rank == 0:
            self._retain(step)

    def _needed_bytes(self) -> int:
        """Bytes one checkpoint takes: the planner's figure, else the newest committed checkpoint's size."""
        if self.expected_bytes:
            return self.expected_bytes
        newest = latest_valid(self.dir)
        return newest.size_bytes if newest else 0

    def _out_of_space(self, tmp: Path, errors: list[str]) -> bool:
        """Collective, before the failed staging dir is removed: whether the save failed for lack of space.
        The error says so (ENOSPC, EDQUOT), or the checkpoint could not have fit: what was written plus what
        is free is less than one checkpoint (torch's zip writer reports a short write without the errno)."""
        full = None
        if self.rank == 0:
            full = any(is_disk_full(e) for e in errors)
            if not full:
                with contextlib.suppress(OSError):
                    full = free_bytes(self.dir) + dir_bytes(tmp) < self._needed_bytes()
        return bool(self._broadcast(full))

    def _disk_full(self, step: int) -> CheckpointError:
        """Collective, after a save failed for lack of space and its staging dir is gone: one line naming the
        directory, the free and the needed space and the newest valid checkpoint (same on every rank), and
        a `disk_full` event the launcher prints (docs/design/checkpoints.md, "Disk space")."""
        message = None
        if self.rank == 0:
            newest = latest_valid(self.dir)
            free = free_bytes(self.dir)
            needed = self._needed_bytes()
            message = disk_full_message(self.dir, step, free, needed, newest.step if newest else None)
            self._event(DISK_FULL_EVENT, step=step, dir=str(self.dir), free_bytes=free, needed_bytes=needed,
                        newest_valid_step=newest.step if newest else None, message=message)
        return CheckpointError(self._broadcast(message))

    def _owns(self, name: str) -> bool:
        """The files this rank wrote: its DCP shards, its rank state, and DCP's index on rank 0."""
        return (name.startswith(f"__{self.rank}_") or name == rank_state_filename(self.rank)
                or (self.rank == 0 and name == DCP_INDEX))

    def _commit(self, step: int, tmp: Path, files: dict[str, dict[str, Any]], meta: dict[str, Any]) -> None:
        """Rank 0, after every rank wrote and fsynced: manifest, marker, fsync, atomic rename."""
        manifest = {
            "format": FORMAT_VERSION, "step": step, "time": time.time(), "world_size": self.world_size,
            "milestone": is_milestone(step, self.milestone_every), "code": code_version(), "hash": HASH,
            "meta": meta, "files": files,
        }
        data = manifest_bytes(manifest)
        write_durable(tmp / MANIFEST, data)
        write_durable(tmp / MARKER, marker_bytes(data))
        fsync_path(tmp)
        final = self.dir / step_dirname(step)
        trash = None
        if final.exists():  # re-saving a step (after a rewind): move the old one aside first
            trash = self.dir / trash_dirname(step, secrets.token_hex(4))
            os.replace(final, trash)
        os.replace(tmp, final)  # the commit point
        fsync_path(self.dir)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        self._event("checkpoint_committed", step=step, path=str(final),
                    bytes=sum(f["size"] for f in files.values()))

    def _retain(self, step: int) -> None:
        """Rank 0 after a commit: delete what retention allows. Failure warns, never fails the save."""
        if not self.keep_last:
            return
        for info in to_delete(list_checkpoints(self.dir), self.keep_last, self.milestone_every, current=step):
            try:
                trash = self.dir / trash_dirname(info.step, secrets.token_hex(4))
                os.replace(info.path, trash)  # never a half-deleted directory named step-N
                shutil.rmtree(trash)
                self._event("checkpoint_deleted", step=info.step, path=str(info.path))
            except OSError as e:
                print(f"warning: could not delete old checkpoint {info.path}: {e}", file=sys.stderr)

    # --- staging ------------------------------------------------------------------------------

    def _stage(self, obj: Any, key: str = "") -> Any:
        """A host-memory snapshot of `obj`: tensors copied into buffers reused across saves, the rest deep-copied."""
        if isinstance(obj, dict):
            return {k: self._stage(v, f"{key}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._stage(v, f"{key}/{i}") for i, v in enumerate(obj))
        if isinstance(obj, DTensor):
            local = self._stage_tensor(obj._local_tensor, key)
            return DTensor(local, obj._spec, requires_grad=False)
        if isinstance(obj, ShardedTensor):  # chunked state (runtime/checkpoint/state.py): copy the local shards
            return _restaged(obj, [self._stage_tensor(sh.tensor, f"{key}#{i}")
                                   for i, sh in enumerate(obj.local_shards())])
        if isinstance(obj, torch.Tensor):
            return self._stage_tensor(obj, key)
        if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):  # DCP Stateful
            return self._stage(obj.state_dict(), key)
        return copy.deepcopy(obj)

    def _stage_tensor(self, t: torch.Tensor, key: str) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._buffers[key] = buf
        buf.copy_(t.detach(), non_blocking=t.is_cuda)
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()
        return buf

    # --- checks -------------------------------------------------------------------------------

    def _check_writable(self) -> None:
        error = None
        try:
            self.dir.mkdir(exist_ok=True)  # never its parents: the launcher made them; a deleted run stays deleted
            probe = self.dir / f".probe-{self.rank}-{secrets.token_hex(4)}"
            write_durable(probe, b"x" * 4096)
            probe.unlink()
        except OSError as e:
            error = f"rank {self.rank}: {e.strerror or e}"
        errors = [e for e in self._all_gather(error) if e]
        if errors:
            raise CheckpointError(f"checkpoint directory {self.dir} is not writable: " + "; ".join(errors),
                                  hint="fix the directory (space, permissions, mount) or set checkpoint.dir")

    def _choose(self, step: int | None, exclude: set[int]) -> CheckpointInfo:
        found: CheckpointInfo | str | None = None
        if self.rank == 0:
            try:
                found = find_step(self.dir, step) if step is not None else self._latest(exclude)
                if found is None:
                    raise CheckpointError(f"{self.dir}: no valid checkpoint to load")
            except CheckpointError as e:
                found = e.message + (f" ({e.hint})" if e.hint else "")
        found = self._broadcast(found)
        if isinstance(found, str):
            raise CheckpointError(found)
        return found

    def _latest(self, exclude: Collection[int]) -> CheckpointInfo | None:
        """Rank 0: the newest valid checkpoint not in `exclude`, reporting the invalid ones newer than it."""
        skipped: list[CheckpointInfo] = []
        info = latest_valid(self.dir, skipped=skipped, exclude=exclude)
        for i in skipped:
            self._warn_skipped(i)
        return info

    def _verify(self, path: Path) -> str | None:
        """Deep check, each rank hashing a share of the files; the first reason any rank found."""
        reason = None
        if self.rank == 0:
            reason = inspect_checkpoint(path).reason
        manifest = self._broadcast(read_manifest(path) if self.rank == 0 and reason is None else None)
        if manifest is not None:
            names = sorted(manifest["files"])
            for name in names[self.rank::self.world_size]:
                reason = digest_problem(path, name, manifest["files"][name])
                if reason:
                    break
        reasons = [r for r in self._all_gather(reason) if r]
        return reasons[0] if reasons else None

    def _check_shapes(self, path: Path, app_state: dict[str, Any]) -> None:
        """Refuse a checkpoint of another model shape with a clear message instead of DCP's."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        try:
            md = FileSystemReader(str(path)).read_metadata()
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read DCP metadata: {e}") from e
        problems = []
        for key, t in _flatten(app_state):
            saved = md.state_dict_metadata.get(key)
            if saved is None:
                problems.append(f"{key} is not in the checkpoint")
            elif isinstance(saved, TensorStorageMetadata) and tuple(saved.size) != tuple(t.shape):
                problems.append(f"{key}: checkpoint has shape {tuple(saved.size)}, model has {tuple(t.shape)}")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise CheckpointError(f"{path}: checkpoint does not match this model: " + "; ".join(problems[:5]) + more,
                                  hint="resume with the model shape the checkpoint was written with")

    # --- small collectives (trivial when not distributed) --------------------------------------

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def _event(self, kind: str, **fields: Any) -> None:
        if self.events is not None and self.rank == 0:
            try:
                record_event(self.events, kind, **fields)
            except OSError as e:
                print(f"warning: could not record event {kind}: {e}", file=sys.stderr)

    def _warn_skipped(self, info: CheckpointInfo) -> None:
        """Once per checkpoint: an event, and a console line unless `trainctl resume` already printed it (its
        `resume_requested` event lists the steps it skipped, found by the same validation)."""
        if info.path in self._reported:
            return
        self._reported.add(info.path)
        self._event("checkpoint_skipped", step=info.step, path=str(info.path), reason=info.reason)
        told = next((e.get("skipped") or [] for e in reversed(read_jsonl(self.events.events))
                     if e.get("event") == "resume_requested"), []) if self.events is not None else []
        if info.step not in told:
            print(f"warning: skipping checkpoint {info.path}: {info.reason}", file=sys.stderr)


def rng_state(cuda: bool = False) -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, and every CUDA device where the rank trains on
    one: a CPU run on a GPU machine leaves CUDA alone): for save()'s rank_state."""
    import random

    import numpy as np

    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], cuda: bool = False) -> None:
    """Restore what rng_state() captured (keys it does not find are left alone; CUDA's only where the rank
    trains on a GPU)."""
    import random

    import numpy as np

    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and cuda:
        torch.cuda.set_rng_state_all(state["cuda"])


def _restaged(st: ShardedTensor, tensors: list[torch.Tensor]) -> ShardedTensor:
    """The ShardedTensor `st` over host copies of its local shards (placements moved to the CPU: the
    constructor checks each local shard's device and pinning against the metadata)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    def cpu(m: ShardMetadata) -> ShardMetadata:
        return ShardMetadata(list(m.shard_offsets), list(m.shard_sizes), f"rank:{m.placement.rank()}/cpu")

    md = st.metadata()
    props = TensorProperties(dtype=md.tensor_properties.dtype, pin_memory=any(t.is_pinned() for t in tensors))
    meta = ShardedTensorMetadata([cpu(m) for m in md.shards_metadata], md.size, props)
    shards = [Shard(t, cpu(sh.metadata)) for t, sh in zip(tensors, st.local_shards(), strict=True)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


def _describe(e: BaseException, rank: int) -> str:
    """One line per failing rank; DCP's CheckpointException carries every rank's exception."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, (x, _tb) in sorted(failures.items()))
    return f"rank {rank}: {type(e).__name__}: {e}"


def _flatten(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(DCP key, tensor) pairs: nested dict keys joined with '.', as DCP's flatten_state_dict does."""
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, torch.Tensor):
        out.append((prefix, obj))
    return out


__all__ = ["CheckpointManager", "rng_state", "set_rng_state"]

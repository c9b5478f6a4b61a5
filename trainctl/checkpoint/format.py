"""Checkpoint directories on disk: names, manifest, commit marker, validity, listing. No torch.

Used by the CLI (`trainctl checkpoints`, `trainctl resume`), the launcher and the runtime writer
(trainctl/runtime/checkpoint/storage.py), so all of them agree on what "a valid checkpoint" means
(docs/design/checkpoints.md, "Checkpoint format and commit protocol").

Layout of one checkpoint, in the checkpoints directory (default RUN/checkpoints), beside the directory's owner
record `.trainctl-owner.json` (the one run that writes and prunes there: trainctl/checkpoint/owner.py):

    step-00000500/
        __<r>_<i>.distcp   DCP shards; rank r writes the files with prefix __<r>_
        .metadata          DCP's index, written by rank 0
        rank-<r>.pt        per-rank state (RNG, data position) beside DCP, which would dedup it
        manifest.json      step, time, world size, code version, caller meta, every file's size + sha256
        COMMITTED          {"manifest_sha256": ...}; written last, before the rename below

Atomicity (why a torn checkpoint can never look valid):
  1. every rank writes and fsyncs its files into a staging directory `step-N.tmp-<nonce>/`
     (the nonce comes from rank 0, so all ranks share it); a name that is not `step-N` is never a
     candidate for resume, whatever it holds;
  2. all ranks report success + their files' sizes and checksums to rank 0 (a collective); any
     failure → nothing more is written and the error surfaces on every rank;
  3. rank 0 writes manifest.json, then COMMITTED (holding the manifest's sha256), fsyncs both and the
     directory, then renames the directory to `step-N/` and fsyncs the parent. The rename is the
     commit point: it is atomic, so `step-N/` either does not exist or is complete.
  Validity is still checked independently of the scheme (marker present, marker matches manifest,
  every listed file present with its size; `deep` also re-hashes), which catches later damage:
  a truncated shard, a deleted marker, a hand-copied partial directory.
  Re-saving an existing step (after a rewind) moves the old `step-N/` aside to `step-N.trash-*`
  just before the rename; deletions also rename to `.trash-*` first, so a half-deleted directory is
  never named `step-N`. A writer that dies leaves only `.tmp-*` / `.trash-*` directories, which
  `stale_dirs()` lists for the next start to remove. `trainctl resume --from-step` moves newer
  checkpoints aside to `step-N.abandoned-<time>`, another name that is never a candidate.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from trainctl.errors import RunError
from trainctl.fileio import HASH, bytes_digest, file_digest

MANIFEST = "manifest.json"
MARKER = "COMMITTED"
OWNER = ".trainctl-owner.json"  # which run the directory belongs to (trainctl/checkpoint/owner.py)
DCP_INDEX = ".metadata"  # DCP's own name for its index file
FORMAT_VERSION = 1

_FINAL = re.compile(r"^step-(\d+)$")
_STAGING = re.compile(r"^step-(\d+)\.tmp-([0-9a-zA-Z]+)$")
_TRASH = re.compile(r"^step-(\d+)\.trash-([0-9a-zA-Z]+)$")


class CheckpointError(RunError):
    """A checkpoint could not be written, read or found; the message names the directory."""


# --- names ----------------------------------------------------------------------------------------

def step_dirname(step: int) -> str:
    return f"step-{step:08d}"  # zero-padded so names sort in step order


def staging_dirname(step: int, nonce: str) -> str:
    return f"{step_dirname(step)}.tmp-{nonce}"


def trash_dirname(step: int, nonce: str) -> str:
    return f"{step_dirname(step)}.trash-{nonce}"


def abandoned_dirname(step: int, stamp: str) -> str:
    """Where `trainctl resume --from-step` moves a newer checkpoint: kept for inspection, never resumed."""
    return f"{step_dirname(step)}.abandoned-{stamp}"


def parse_step(name: str) -> int | None:
    m = _FINAL.match(name) or _STAGING.match(name)
    return int(m.group(1)) if m else None


def rank_state_filename(rank: int) -> str:
    return f"rank-{rank}.pt"


@dataclass
class CheckpointInfo:
    step: int
    path: Path
    size_bytes: int
    valid: bool
    reason: str | None  # why invalid; None when valid
    milestone: bool = False
    time: float | None = None
    world_size: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


# --- manifest and marker --------------------------------------------------------------------------

def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def marker_bytes(manifest_data: bytes) -> bytes:
    return json.dumps({"manifest_" + HASH: bytes_digest(manifest_data)}).encode() + b"\n"


@lru_cache(maxsize=1)
def code_version() -> dict[str, str | None]:
    """trainctl version and, when the package lives in a git checkout, its commit."""
    from trainctl import __version__

    commit = None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            commit = out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"trainctl": __version__, "git": commit}


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory; CheckpointError when missing or unreadable."""
    try:
        m = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: no {MANIFEST}") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable {MANIFEST}: {e}") from e
    if not isinstance(m, dict) or not isinstance(m.get("files"), dict) or "step" not in m:
        raise CheckpointError(f"{path}: unreadable {MANIFEST}: not a trainctl manifest")
    return m


# --- validity -------------------------------------------------------------------------------------

def validate(path: Path, deep: bool = False) -> str | None:
    """None when `path` is a valid committed checkpoint, else the reason it is not.

    Shallow: marker present and matching the manifest, every listed file present with its size.
    Deep: also re-hash every file (reads the whole checkpoint).
    """
    return _check(Path(path), deep)[0]


def _check(path: Path, deep: bool) -> tuple[str | None, dict[str, Any] | None]:
    if _STAGING.match(path.name):
        return "incomplete: staging directory, never committed (writer died or the save failed)", None
    if not _FINAL.match(path.name):
        return f"not a checkpoint directory name (expected {step_dirname(0)[:-1]}N)", None
    try:
        manifest_data = (path / MANIFEST).read_bytes()
        manifest = json.loads(manifest_data)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("not a trainctl manifest")
    except FileNotFoundError:
        return ("missing COMMITTED marker and manifest" if not (path / MARKER).exists()
                else "missing manifest.json"), None
    except (OSError, ValueError) as e:
        return f"unreadable manifest: {e}", None
    try:
        marker = (path / MARKER).read_bytes()
    except FileNotFoundError:
        return "missing COMMITTED marker", manifest
    except OSError as e:
        return f"unreadable COMMITTED marker: {e}", manifest
    if marker != marker_bytes(manifest_data):
        return "COMMITTED marker does not match manifest.json", manifest
    if manifest.get("step") != parse_step(path.name):
        return f"manifest step {manifest.get('step')} does not match directory name", manifest
    for name, entry in sorted(manifest["files"].items()):
        f = path / name
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            return f"missing file {name}", manifest
        except OSError as e:
            return f"unreadable file {name}: {e}", manifest
        want = entry.get("size")
        if size != want:
            kind = "truncated shard" if isinstance(want, int) and size < want else "size mismatch in"
            return f"{kind} {name}: {size} bytes, manifest says {want}", manifest
    if deep:
        for name, entry in sorted(manifest["files"].items()):
            reason = digest_problem(path, name, entry)
            if reason:
                return reason, manifest
    return None, manifest


def digest_problem(path: Path, name: str, entry: dict[str, Any]) -> str | None:
    """Why file `name` of checkpoint `path` does not hash to its manifest `entry`, or None."""
    try:
        _, digest = file_digest(path / name)
    except OSError as e:
        return f"unreadable file {name}: {e}"
    return None if digest == entry.get(HASH) else f"checksum mismatch in {name}"


def _dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def inspect_checkpoint(path: Path, deep: bool = False) -> CheckpointInfo:
    path = Path(path)
    reason, manifest = _check(path, deep)
    manifest = manifest or {}
    t = manifest.get("time")
    if t is None:
        try:
            t = path.stat().st_mtime
        except OSError:
            t = None
    return CheckpointInfo(
        step=parse_step(path.name) or 0, path=path, size_bytes=_dir_size(path), valid=reason is None,
        reason=reason, milestone=bool(manifest.get("milestone", False)), time=t,
        world_size=manifest.get("world_size"), meta=manifest.get("meta") or {},
    )


# --- listing and choosing -------------------------------------------------------------------------

def list_checkpoints(directory: Path, deep: bool = False) -> list[CheckpointInfo]:
    """Every checkpoint (committed or staging) in a checkpoints directory, oldest step first.

    Staging directories are listed as invalid so a user sees torn saves; `.trash-*` are not listed.
    A missing directory is an empty list.
    """
    directory = Path(directory)
    try:
        entries = [p for p in directory.iterdir() if p.is_dir() and parse_step(p.name) is not None]
    except FileNotFoundError:
        return []
    except NotADirectoryError as e:
        raise CheckpointError(f"{directory}: not a directory") from e
    except OSError as e:
        raise CheckpointError(f"{directory}: cannot list checkpoints: {e}") from e
    infos = [inspect_checkpoint(p, deep) for p in entries]
    # Same step: the committed one sorts after a staging one, so "newest" is the committed.
    return sorted(infos, key=lambda i: (i.step, i.valid, i.path.name))


def newest_valid(infos: list[CheckpointInfo], deep: bool = False, skipped: list[CheckpointInfo] | None = None,
                 exclude: Collection[int] = ()) -> CheckpointInfo | None:
    """The newest valid of `infos` (oldest first, as list_checkpoints gives them): the one search for the
    checkpoint to resume from. Invalid ones newer than it are appended to `skipped` (with reasons); steps in
    `exclude` (found corrupt by the caller, who already reported them) are passed over silently. `deep`
    re-hashes the candidate before taking it."""
    for info in reversed(infos):
        if info.valid and info.step in exclude:
            continue
        if info.valid and deep:
            reason = validate(info.path, deep=True)
            if reason:
                info.valid, info.reason = False, reason
        if info.valid:
            return info
        if skipped is not None:
            skipped.append(info)
    return None


def latest_valid(directory: Path, deep: bool = False, skipped: list[CheckpointInfo] | None = None,
                 exclude: Collection[int] = ()) -> CheckpointInfo | None:
    """The newest valid checkpoint in `directory` (newest_valid over a shallow listing)."""
    return newest_valid(list_checkpoints(directory, deep=False), deep, skipped, exclude)


def find_step(directory: Path, step: int, deep: bool = False) -> CheckpointInfo:
    """The committed checkpoint of `step`; CheckpointError when missing or invalid."""
    path = Path(directory) / step_dirname(step)
    if not path.is_dir():
        steps = [i.step for i in list_checkpoints(directory) if i.valid]
        raise CheckpointError(f"{path}: no checkpoint for step {step}",
                              hint=f"valid steps: {steps}" if steps else "no valid checkpoints")
    info = inspect_checkpoint(path, deep)
    if not info.valid:
        raise CheckpointError(f"{path}: checkpoint of step {step} is invalid: {info.reason}")
    return info


def stale_dirs(directory: Path) -> list[Path]:
    """Leftovers of a writer that died (`.tmp-*` staging, `.trash-*`); safe to delete when no save runs."""
    try:
        return sorted(p for p in Path(directory).iterdir() if _STAGING.match(p.name) or _TRASH.match(p.name))
    except (FileNotFoundError, NotADirectoryError):
        return []

"""The identity of the token files a run trains on: each file's size and a hash of its content. No torch.

The launcher records it in job.json ("data": the files the run trains on now), the trainer in every
checkpoint's manifest (meta "data": the files it was trained on). `trainctl resume` refuses a file whose
identity differs from the checkpoint's, naming it (`--accept-data-change` continues knowingly and records the
new identity), and the trainer refuses one that differs from job.json's at every start, which also covers the
restarts no `trainctl resume` precedes (a Slurm requeue, a torchrun restart). A file at another path (`resume
--set data.path=...`) is a spec change, said as such, not a changed file.

The hash reads the whole file once: it is cached beside the file (trainctl.data.sidecar) and reused from a recorded
identity while the file's size, mtime and inode are those it was computed for, and while the file's sampled hash
(`sample_digest`: 64 blocks of 64 KiB spread over it, read at every check, milliseconds at any size) is the one
recorded with it. A file rewritten in place with its size and mtime restored (re-tokenized, every token
changed) thus fails the sample and is hashed whole again, and refused. The exact limit: an in-place edit that
restores size and mtime and leaves all 64 sampled blocks unchanged (a file over 4 MiB edited between them) is
not noticed; a file up to 4 MiB is sampled whole.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainctl.data import sidecar
from trainctl.data.files import ids_file
from trainctl.errors import UsageError
from trainctl.fileio import HASH, file_digest

if TYPE_CHECKING:
    from trainctl.spec import RunSpec

SUFFIX = ".trainctl-hash.json"
ANNOUNCE_BYTES = 1 << 30  # hashing a file this large takes seconds: say so
SAMPLE_BLOCKS = 64  # sample_digest reads this many blocks ...
SAMPLE_BLOCK = 64 << 10  # ... of this many bytes: 4 MiB at most (bench/bench_data_identity.py measures it)
SAMPLE = "sample_" + HASH
# how a file is judged unchanged, with the exact limit, as `trainctl resume` says it
UNCHANGED_BY = (f"size, mtime and inode, and a {HASH} of {SAMPLE_BLOCKS} blocks of {SAMPLE_BLOCK >> 10} KiB spread "
                f"over each; not seen: an in-place edit that restores size and mtime and touches none of those blocks")


@dataclass(frozen=True)
class DataIdentity:
    """One token file: where, how big, what content; `key` is the stat key the hash was computed for."""

    path: str  # the file of ids (for a Megatron dataset, P.bin)
    size: int
    sha256: str  # of the whole content (checkpoint.durable's hash, as for checkpoint files)
    key: dict[str, int]
    sample_sha256: str | None = None  # sample_digest; None in a record of an older trainctl

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DataIdentity:
        sample = d.get(SAMPLE)
        return cls(str(d["path"]), int(d["size"]), str(d[HASH]), dict(d.get("key") or {}),
                   sample if isinstance(sample, str) else None)

    def change_from(self, old: DataIdentity) -> str | None:
        """What changed since `old` (of the same path), in words; None when it is the same data."""
        if old.size != self.size:
            return f"size {old.size:,} -> {self.size:,} bytes"
        if old.sha256 != self.sha256:
            return f"same size, other content ({HASH} {old.sha256[:12]} -> {self.sha256[:12]})"
        if old.sample_sha256 and self.sample_sha256 and old.sample_sha256 != self.sample_sha256:
            return f"same size, other content (sampled {HASH} {old.sample_sha256[:12]} -> {self.sample_sha256[:12]})"
        return None


def sample_digest(path: str | Path, size: int) -> str:
    """sha256 of the file's size and SAMPLE_BLOCKS blocks of SAMPLE_BLOCK bytes at evenly spread offsets (the first
    and the last block included; the whole file when it is no larger): cheap at any size, so read at every check,
    never cached. Any change to a sampled byte changes it."""
    import hashlib

    h = hashlib.new(HASH, size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK:
            h.update(f.read())
        else:
            for i in range(SAMPLE_BLOCKS):
                h.update(os.pread(f.fileno(), SAMPLE_BLOCK, i * (size - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1)))
    return h.hexdigest()


def identity(path: str, known: Iterable[DataIdentity] = ()) -> DataIdentity:
    """The file's identity now: from `known` (a recorded identity) or the cache beside the file while the file
    is the one they describe (the same stat key and sampled hash), else hashed (and cached)."""
    key = sidecar.stat_key(path)
    sample = sample_digest(path, key["size"])
    for k in known:
        if k.path == path and k.key == key and k.sample_sha256 in (None, sample):
            return replace(k, sample_sha256=sample)
    cached = sidecar.read(path, SUFFIX, key)
    if cached is not None and isinstance(cached.get(HASH), str) and cached.get(SAMPLE) == sample:
        return DataIdentity(path, key["size"], cached[HASH], key, sample)
    if key["size"] >= ANNOUNCE_BYTES:
        print(f"hashing {path} ({key['size'] / 1e9:.1f} GB; once, cached beside it)", file=sys.stderr, flush=True)
    _, digest = file_digest(Path(path))
    sidecar.write(path, SUFFIX, key, {HASH: digest, SAMPLE: sample})
    return DataIdentity(path, key["size"], digest, key, sample)


def files_of(spec: RunSpec) -> list[str]:
    """The token files `spec` trains on, as the trainer opens them ([] for synthetic data)."""
    return [str(ids_file(s.path, s.format).absolute()) for s in spec.data.sources()]


def of_spec(spec: RunSpec, known: Iterable[DataIdentity] = ()) -> list[DataIdentity]:
    """The identity of every token file of `spec` now (each once, a blend may name one twice)."""
    known = list(known)
    return [identity(p, known) for p in dict.fromkeys(files_of(spec))]


def recorded(entries: object) -> list[DataIdentity]:
    """The identities in a job.json or manifest "data" entry; [] when there is none (synthetic data, or a run
    recorded before trainctl recorded its data)."""
    if not isinstance(entries, list):
        return []
    out = []
    for d in entries:
        try:
            out.append(DataIdentity.from_json(d))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def changes(old: Iterable[DataIdentity], new: Iterable[DataIdentity]) -> list[tuple[str, str]]:
    """(path, what changed) for every file of `new` that `old` records at the same path with another identity."""
    before = {i.path: i for i in old}
    return [(i.path, what) for i in new if i.path in before and (what := i.change_from(before[i.path]))]


def compare(spec: RunSpec, trained: list[DataIdentity], *, since: str, run: str, accept: bool = False,
            known: Iterable[DataIdentity] = ()) -> tuple[list[DataIdentity], list[str]]:
    """The identity of `spec`'s token files now and, as 'PATH: what changed', each that differs from `trained`
    (what the run trained on, `since` then). Refused (UsageError, naming the first file) unless `accept`."""
    now = of_spec(spec, known=[*trained, *known])
    changed = changes(trained, now)
    if changed and not accept:
        path, what = changed[0]
        more = f" (and {len(changed) - 1} more file(s))" if len(changed) > 1 else ""
        raise UsageError(f"data file {path} changed since {since}: {what}{more}",
                         hint=f"put the original back, or `trainctl resume {run} --accept-data-change` to continue on "
                              "it knowingly (the resumed steps then read other sequences than the run would have)")
    return now, [f"{path}: {what}" for path, what in changed]

"""Benchmark: what the data identity check (trainctl.data.identity) costs on a large token file.

Every check (every `trainctl resume`, every rank 0 start: a Slurm requeue, a torchrun restart) reads the file's
sampled hash (64 blocks of 64 KiB, 4 MiB at any size); the full sha256 is read only when the sample or the stat
key differs from the recorded one (then cached beside the file). For a file of `--gb` GB of random uint16
tokens, it measures (wall seconds, median of `--repeat`):
  - sampled: sample_digest, with the file in the page cache (warm) and, as root, after dropping it (cold);
  - full: file_digest (the whole file's sha256), warm and cold;
  - check: identity() with a matching recorded identity: what a start pays when nothing changed.

    .venv/bin/python bench/bench_data_identity.py [--gb 1] [--dir /tmp] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainctl.data import identity  # noqa: E402
from trainctl.fileio import file_digest  # noqa: E402


def drop_caches(path: Path) -> bool:
    """Evict `path` from the page cache (posix_fadvise DONTNEED after a sync); False where it cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


def timed(fn: Callable[[], object], repeat: int, before: Callable[[], object] = lambda: None) -> float:
    times = []
    for _ in range(repeat):
        before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    size = int(args.gb * 1e9) // 2 * 2
    path = args.dir / f"bench-identity-{os.getpid()}.bin"
    try:
        with open(path, "wb") as f:  # random tokens, written in 64 MiB pieces
            left = size
            while left:
                n = min(left, 64 << 20)
                f.write(os.urandom(n))
                left -= n
        size = path.stat().st_size
        sample = lambda: identity.sample_digest(path, size)  # noqa: E731
        full = lambda: file_digest(path)  # noqa: E731
        out = {"file_bytes": size, "sample_bytes": identity.SAMPLE_BLOCKS * identity.SAMPLE_BLOCK,
               "sampled_warm_s": timed(sample, args.repeat), "full_warm_s": timed(full, args.repeat)}
        if drop_caches(path):
            out["sampled_cold_s"] = timed(sample, args.repeat, lambda: drop_caches(path))
            out["full_cold_s"] = timed(full, args.repeat, lambda: drop_caches(path))
        recorded = identity.identity(str(path))  # hashes whole once, caches beside the file
        out["check_unchanged_s"] = timed(lambda: identity.identity(str(path), known=[recorded]), args.repeat)
        out["measured"] = f"wall seconds, median of {args.repeat}, on this machine"
        print(json.dumps(out, indent=1))
    finally:
        path.unlink(missing_ok=True)
        path.with_name(path.name + identity.SUFFIX).unlink(missing_ok=True)


if __name__ == "__main__":
    main()

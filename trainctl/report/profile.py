"""train.profile's output in `mfu-report`: every rank's trace and memory snapshot, with its steps. No torch."""

from __future__ import annotations

from typing import Any

from trainctl.report.load import RunData
from trainctl.rundir.paths import RunPaths


def profile_files(run: RunData) -> list[dict[str, Any]]:
    """The finished traces (Chrome/Perfetto JSON: chrome://tracing, ui.perfetto.dev) and CUDA memory snapshots
    (pytorch.org/memory_viz) of the run directory, by rank and steps."""
    return [{"kind": f.kind, "rank": f.rank, "first_step": f.first, "last_step": f.last, "path": str(f.path),
             "bytes": f.path.stat().st_size}
            for f in RunPaths(run.root).profile_files() if f.path.is_file()]

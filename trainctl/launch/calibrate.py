"""`trainctl calibrate SPEC`: run the calibration worker on the spec's cluster through the same launch backend
as `trainctl launch` (local torchrun or Slurm, the spec's ranks per node), wait for it, keep its profile.
No torch: the worker is trainctl/runtime/calibrate.py.

The run directory (default runs/calibrate/<name>-<time>, not listed by `trainctl runs`) holds what a launch's
does (frozen spec, launch script, job record, per-rank logs) and the worker's RUN/calibration.json, which is
checked and then written atomically to the output path.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from trainctl.errors import EXIT_OK, RunError
from trainctl.launch.backend import CALIBRATE_MODULE, Say, backend_for, note
from trainctl.launch.create import default_run_dir, read_job
from trainctl.plan.calibration import profile as prof
from trainctl.rundir import RunPaths, read_jsonl
from trainctl.spec import RunSpec
from trainctl.spec.models import DataSpec

POLL_S = 5.0  # how often a submitted (Slurm) calibration is asked whether it has ended
PROGRESS = "calibrate: "  # how the worker's rank 0 starts each progress line (trainctl/runtime/calibrate.py)


def default_out(spec: RunSpec) -> Path:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", spec.name).strip("._") or "run"
    return Path(f"calibration-{name}.json")


def calibration_spec(spec: RunSpec) -> RunSpec:
    """The spec the worker runs: synthetic data (it reads none) and no profile (it makes one)."""
    cluster = spec.cluster.model_copy(update={"calibration": None})
    return spec.model_copy(update={"cluster": cluster, "data": DataSpec(synthetic=True)})


def calibrate(spec: RunSpec, out: Path, run_dir: Path | None, say: Say) -> prof.Profile:
    """Measure, check and write the profile to `out`; RunError when the worker fails."""
    spec = calibration_spec(spec)
    backend = backend_for(spec)
    launch: Any = backend.prepare(spec, run_dir or default_run_dir(spec, base=Path("runs") / "calibrate"),
                                  module=CALIBRATE_MODULE)
    paths = RunPaths(Path(launch.run_dir))
    if backend.start(launch, say) != EXIT_OK:
        raise RunError(f"calibration failed on {spec.world_size} ranks", hint=f"rank logs under {paths.logs}")
    _wait(backend, paths, say)
    if backend.name != "local":  # a local run streamed rank 0's lines as they came
        _echo_progress(backend, paths, say)
    if not paths.calibration.exists():
        raise RunError(f"calibration ended without writing {paths.calibration}", hint=f"rank logs under {paths.logs}")
    measured = prof.load(paths.calibration)
    prof.check(measured, spec)  # the worker measured what the spec describes, or something is badly wrong
    prof.save(out, measured.data)
    return prof.load(out)


def _echo_progress(backend: Any, paths: RunPaths, say: Say) -> None:
    """The worker's progress lines (`calibrate: ...`) from the job's output, once it has ended."""
    for f in backend.log_files(paths, read_job(paths), None).files:
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            _, mark, rest = line.partition(PROGRESS)
            if mark:
                say(note(mark + rest))


def _wait(backend: Any, paths: RunPaths, say: Say) -> None:
    """Until the job has ended: at once for a local run (it ran in the foreground), polled for Slurm."""
    told = False
    while True:
        state = backend.job_state(paths, read_job(paths), read_jsonl(paths.events))
        if not state.active:
            return
        if not told:
            say(note(f"waiting for the calibration job ({state.state}); Ctrl-C leaves it running, its profile will "
                     f"be {paths.calibration}"))
            told = True
        time.sleep(POLL_S)

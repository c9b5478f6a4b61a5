"""`trainctl calibrate SPEC`: run the calibration worker on the spec's cluster through the same launch backend
as `trainctl launch` (local torchrun or Slurm, the spec's ranks per node), wait for it, keep its profile.
No torch: the worker is trainctl/runtime/workers/calibrate.py.

The run directory (default runs/calibrate/<name>-<time>, not listed by `trainctl runs`) holds what a launch's
does (frozen spec, launch script, job record, per-rank logs) and the worker's RUN/calibration.json, which is
checked and then written atomically to the output path.
"""

from __future__ import annotations

import re
from pathlib import Path

from trainctl.fileio import write_errors_as_usage
from trainctl.launch.backend import CALIBRATE_MODULE, Say
from trainctl.launch.create import default_run_dir
from trainctl.launch.worker_job import run_worker
from trainctl.plan.calibration import profile as prof
from trainctl.spec import RunSpec
from trainctl.spec.models import DataSpec

PROGRESS = "calibrate: "  # how the worker's rank 0 starts each progress line (trainctl/runtime/workers/calibrate.py)


def default_out(spec: RunSpec, from_run: Path | None = None) -> Path:
    """calibration-NAME.json for a measured profile; a refit is named after its run as well
    (calibration-NAME-from-RUN.json), so it never replaces the measured profile it keeps (--base)."""
    name = _file_word(spec.name)
    if from_run is not None:
        name = f"{name}-from-{_file_word(from_run.resolve().name)}"
    return Path(f"calibration-{name}.json")


def _file_word(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "run"


def calibration_spec(spec: RunSpec) -> RunSpec:
    """The spec the worker runs: synthetic data (it reads none) and no profile (it makes one)."""
    cluster = spec.cluster.model_copy(update={"calibration": None})
    return spec.model_copy(update={"cluster": cluster, "data": DataSpec(synthetic=True)})


def calibrate(spec: RunSpec, out: Path, run_dir: Path | None, say: Say) -> prof.Profile:
    """Measure, check and write the profile to `out`; RunError when the worker fails."""
    spec = calibration_spec(spec)
    paths = run_worker(spec, run_dir or default_run_dir(spec, base=Path("runs") / "calibrate"), CALIBRATE_MODULE,
                       "calibration", "calibration", PROGRESS, say)
    measured = prof.load(paths.calibration)
    prof.check(measured, spec)  # the worker measured what the spec describes, or something is badly wrong
    with write_errors_as_usage(f"--out {out}"):  # e.g. the disk filled while the worker measured
        prof.save(out, measured.data)
    return prof.load(out)

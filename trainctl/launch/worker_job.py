"""Run a measuring worker (`python -m MODULE RUN_DIR` on every rank) on the spec's cluster through the spec's
launch backend, as `trainctl launch` runs the trainer, and wait for it to end: what `trainctl calibrate` and
`trainctl preflight` share. No torch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainctl.errors import EXIT_OK, RunError
from trainctl.launch.backend import Say, backend_for, note
from trainctl.launch.create import read_job
from trainctl.rundir.paths import RunPaths, read_jsonl
from trainctl.spec import RunSpec

POLL_S = 5.0  # how often a submitted (Slurm) job is asked whether it has ended


def run_worker(spec: RunSpec, run_dir: Path, module: str, what: str, result: str, progress: str,
               say: Say, poll_s: float = POLL_S) -> RunPaths:
    """Start the worker, wait for its end and echo its rank 0's progress lines (those starting with
    `progress`); RunError when it fails or leaves no `result` file (a RunPaths attribute name)."""
    backend = backend_for(spec)
    launch: Any = backend.prepare(spec, run_dir, module=module)
    paths = RunPaths(Path(launch.run_dir))
    if backend.start(launch, say) != EXIT_OK:
        raise RunError(f"{what} failed on {spec.world_size} ranks", hint=f"rank logs under {paths.logs}")
    # a local run streamed rank 0's lines as they came; a submitted one's are echoed from its output
    echo = None if backend.name == "local" else _Echo(backend, paths, say, progress)
    _wait(backend, paths, say, what, getattr(paths, result), poll_s, echo)
    if echo is not None:
        echo()
    if not getattr(paths, result).exists():
        raise RunError(f"{what} ended without writing {getattr(paths, result)}", hint=f"rank logs under {paths.logs}")
    return paths


class _Echo:
    """The worker's progress lines from the job's output, each once, as the job writes them."""

    def __init__(self, backend: Any, paths: RunPaths, say: Say, progress: str) -> None:
        self.backend, self.paths, self.say, self.progress = backend, paths, say, progress
        self.shown = 0

    def __call__(self) -> None:
        lines = []
        for f in self.backend.log_files(self.paths, read_job(self.paths), None).files:
            if f.is_file():
                lines += [line for line in f.read_text(encoding="utf-8", errors="replace").splitlines()
                          if self.progress in line]
        for line in lines[self.shown:]:
            self.say(note(self.progress + line.partition(self.progress)[2]))
        self.shown = max(self.shown, len(lines))


def _wait(backend: Any, paths: RunPaths, say: Say, what: str, result: Path, poll_s: float,
          echo: _Echo | None) -> None:
    """Until the job has ended: at once for a local run (it ran in the foreground), polled for Slurm."""
    told = False
    while True:
        state = backend.job_state(paths, read_job(paths), read_jsonl(paths.events))
        if not state.active:
            return
        if echo is not None:
            echo()
        if not told:
            say(note(f"waiting for the {what} job ({state.state}); Ctrl-C leaves it running, its result will "
                     f"be {result}"))
            told = True
        time.sleep(poll_s)

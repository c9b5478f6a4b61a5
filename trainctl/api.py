"""The Python API: load a spec, plan it, launch or resume a run, and look after it from Python. No torch.

    import trainctl.api as tc

    spec = tc.load(overrides=["train.steps=4"])    # the embedded tiny CPU recipe, or a path
    figures = tc.plan(spec)                        # the same figures as `trainctl plan --json`
    run = tc.launch(spec, run_dir="runs/api")      # a Run handle; the launch goes on in its own process
    run.wait()                                     # -> its RunStatus once it has ended (run.status() any time)

A launch or resume is the `trainctl` command itself, in a child process: the same checks, the same run
directory, the same signals (`Run.cancel()` is `trainctl cancel`), so a run started here is like any other.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from trainctl.errors import RunError, UsageError

if TYPE_CHECKING:
    from trainctl.launch.status import RunStatus
    from trainctl.spec import RunSpec

EMBEDDED = Path(__file__).resolve().parent / "spec" / "tiny-cpu.yaml"


def load(spec: str | Path | None = None, overrides: Sequence[str] = ()) -> RunSpec:
    """The validated spec at `spec` (default: the embedded tiny CPU recipe) with `--set`-style overrides
    ("train.steps=4"); SpecError (every problem, one line each) otherwise."""
    from trainctl.spec import load_spec

    return load_spec(Path(spec) if spec is not None else EMBEDDED, list(overrides))


def plan(spec: RunSpec, *, ranks: bool = False) -> dict[str, Any]:
    """The plan of a spec: exactly what `trainctl plan --json` prints (predicted figures)."""
    from trainctl.plan.plan import build_plan

    return build_plan(spec).to_json(ranks=ranks)


@dataclass
class Run:
    """A run directory, and the `trainctl` process working on it from here (a local launch or resume runs in
    it to the end; a Slurm one ends once submitted)."""

    path: Path
    process: subprocess.Popen[str] | None = field(default=None, repr=False)

    def status(self) -> RunStatus:
        """What `trainctl status RUN --json` says (state, steps, loss, MFU...)."""
        from trainctl.launch.status import run_status

        return run_status(self.path)

    def wait(self, timeout: float | None = None, poll_s: float = 1.0) -> RunStatus:
        """Block until the run is no longer active (and this process's `trainctl` has exited); its status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            done = self.process is None or self.process.poll() is not None
            if done and self.path.joinpath("job.json").is_file():
                st = self.status()
                if not st.active:
                    return st
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} is still running after {timeout} s")
            time.sleep(poll_s)

    def metrics(self) -> list[dict[str, Any]]:
        """The measured steps, one record each (RUN/metrics.jsonl)."""
        from trainctl.rundir.paths import RunPaths, read_jsonl

        return read_jsonl(RunPaths(self.path).metrics)

    def report(self) -> dict[str, Any]:
        """What `trainctl mfu-report RUN --json` prints."""
        from trainctl.report import build_report

        return build_report([self.path])

    @property
    def output(self) -> str:
        """What the `trainctl` process printed (once it has exited)."""
        if self.process is None or self.process.poll() is None or self.process.stdout is None:
            return ""
        return self.process.stdout.read()

    def cancel(self, force: bool = False) -> str:
        """`trainctl cancel RUN`: every rank saves after its current step (force: killed at once)."""
        return _trainctl("cancel", *(["--force"] if force else []), str(self.path)).strip()


def launch(spec: RunSpec, run_dir: str | Path, *, overrides: Sequence[str] = ()) -> Run:
    """`trainctl launch` of `spec` into `run_dir`, in a child process; the Run handle as soon as the run
    directory exists (a mistake the launch refuses raises UsageError with its lines)."""
    from trainctl.spec import resolved_dict

    path = Path(run_dir).absolute()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(resolved_dict(spec), f, sort_keys=False)
    args = ["launch", f.name, "--run-dir", str(path), *[w for o in overrides for w in ("--set", o)]]
    return _started(path, args, cleanup=Path(f.name))


def resume(run: Run | str | Path) -> Run:
    """`trainctl resume RUN` in a child process: the run goes on from its newest valid checkpoint."""
    path = Path(run.path if isinstance(run, Run) else run).absolute()
    return _started(path, ["resume", str(path)])


def _started(path: Path, args: list[str], cleanup: Path | None = None) -> Run:
    proc = subprocess.Popen([sys.executable, "-m", "trainctl", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while proc.poll() is None and not path.joinpath("job.json").is_file():
            time.sleep(0.2)
    finally:
        if cleanup is not None and (proc.poll() is not None or path.joinpath("job.json").is_file()):
            cleanup.unlink(missing_ok=True)  # the run directory holds the frozen spec now
    if proc.poll() not in (None, 0) and not path.joinpath("job.json").is_file():
        out = proc.stdout.read() if proc.stdout else ""
        raise UsageError(out.strip() or f"trainctl {args[0]} exited {proc.returncode}")
    return Run(path, proc)


def _trainctl(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "trainctl", *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RunError((proc.stderr or proc.stdout).strip())
    return proc.stdout


__all__ = ["Run", "launch", "load", "plan", "resume"]

"""The Python API: load a spec, plan it, launch or resume a run, and look after it from Python. No torch.

    import trainctl.api as tc

    spec = tc.load(overrides=["train.steps=4"])    # the embedded tiny CPU recipe, or a path
    figures = tc.plan(spec)                        # the same figures as `trainctl plan --json`
    run = tc.launch(spec, run_dir="runs/api")      # a Run handle; the launch goes on in its own process
    run.wait()                                     # -> its RunStatus once it has ended (run.status() any time)

A launch, resume, sweep or tune is the `trainctl` command itself, in a child process: the same checks, the
same run directory, the same signals, so a run started here is like any other. What a run or sweep is now
(`status`) and stopping it (`cancel`) are owned here: `trainctl status` and `trainctl cancel` print what these
return. A sweep directory (and a tune directory, which is one) stands for all of its runs.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from trainctl.errors import RunError, UsageError

T = TypeVar("T")

if TYPE_CHECKING:
    from trainctl.launch.status import RunStatus
    from trainctl.plan.plan import Plan
    from trainctl.rundir.sweep_record import SweepRecord, SweepRun
    from trainctl.spec import RunSpec

EMBEDDED = Path(__file__).resolve().parent / "spec" / "tiny-cpu.yaml"


def load(spec: str | Path | None = None, overrides: Sequence[str] = ()) -> RunSpec:
    """The validated spec at `spec` (default: the embedded tiny CPU recipe) with `--set`-style overrides
    ("train.steps=4"); SpecError (every problem, one line each) otherwise."""
    from trainctl.spec import load_spec

    return load_spec(Path(spec) if spec is not None else EMBEDDED, list(overrides))


def plan(spec: RunSpec, *, ranks: bool = False) -> dict[str, Any]:
    """The plan of a spec: exactly what `trainctl plan --json` prints (predicted figures)."""
    return plan_of(spec).to_json(ranks=ranks)


def plan_of(spec: RunSpec) -> Plan:
    """The typed plan (trainctl/plan/plan.py's Plan) that `trainctl plan` prints and `plan` gives as JSON."""
    from trainctl.plan.plan import build_plan

    return build_plan(spec)


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
        def settled() -> RunStatus | None:
            if _running(self.process) or not self.path.joinpath("job.json").is_file():
                return None
            st = self.status()
            return None if st.active else st

        return _poll(settled, self.path, timeout, poll_s)

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
        return "\n".join(cancel(self.path, force=force))


def _running(process: subprocess.Popen[str] | None) -> bool:
    return process is not None and process.poll() is None


def _poll(settled: Callable[[], T | None], path: Path, timeout: float | None, poll_s: float) -> T:
    """What `settled()` returns once it is not None, asked every `poll_s`; TimeoutError after `timeout` s."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while (result := settled()) is None:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{path} is still running after {timeout} s")
        time.sleep(poll_s)
    return result


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


def _started(path: Path, args: list[str], cleanup: Path | None = None, made: str = "job.json") -> Run:
    return Run(path, _child(path, args, made, cleanup))


def _child(path: Path, args: list[str], made: str, cleanup: Path | None = None) -> subprocess.Popen[str]:
    """`trainctl ARGS` in a child process, once it has made `path/made` (or refused: UsageError, its lines)."""
    proc = subprocess.Popen([sys.executable, "-m", "trainctl", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while proc.poll() is None and not path.joinpath(made).is_file():
            time.sleep(0.2)
    finally:
        if cleanup is not None and (proc.poll() is not None or path.joinpath(made).is_file()):
            cleanup.unlink(missing_ok=True)  # the run directory holds the frozen spec now
    if proc.poll() not in (None, 0) and not path.joinpath(made).is_file():
        out = proc.stdout.read() if proc.stdout else ""
        raise UsageError(out.strip() or f"trainctl {args[0]} exited {proc.returncode}")
    return proc


# --- what a run or sweep is now, and stopping it: `trainctl status` and `trainctl cancel` print these --------

@dataclass
class SweepStatus:
    """A sweep's record and each run's status (or the error that stands for it: a run directory damaged)."""

    path: Path
    record: SweepRecord
    runs: list[tuple[SweepRun, RunStatus | RunError | UsageError]]

    @property
    def active(self) -> bool:
        return any(not isinstance(st, Exception) and st.active for _, st in self.runs)

    def states(self) -> list[str]:
        return [st.state if not isinstance(st, Exception) else "UNKNOWN" for _, st in self.runs]

    def to_json(self) -> dict[str, Any]:
        """What `trainctl status SWEEP --json` prints."""
        return {"sweep": str(self.path.absolute()), "backend": self.record.backend, "grid": self.record.grid,
                "array_job_id": self.record.array.get("job_id"),
                "runs": [{"dir": run.dir, "values": run.values,
                          **(st.to_json() if not isinstance(st, Exception) else {"error": str(st)})}
                         for run, st in self.runs]}


def status(path: str | Path) -> RunStatus | SweepStatus:
    """What `trainctl status PATH` says: a run's status, or for a sweep (or tune) directory every run's."""
    from trainctl.errors import TrainctlError
    from trainctl.launch import sweep as sw
    from trainctl.launch.status import run_status
    from trainctl.rundir.sweep_record import is_sweep_dir

    root = Path(path)
    if not is_sweep_dir(root):
        return run_status(root)
    record = sw.open_sweep(root)
    runs: list[tuple[SweepRun, Any]] = []
    for run in record.runs:
        try:
            runs.append((run, run_status(root / run.dir)))
        except TrainctlError as e:
            runs.append((run, e))
    return SweepStatus(root, record, runs)


def cancel(path: str | Path, *, force: bool = False) -> list[str]:
    """`trainctl cancel PATH`, its lines: a run saves after its current step and stops (force: killed at once);
    a sweep's (or tune's) every active run likewise, the queued first, and none of its runs starts after."""
    from trainctl.launch import sweep as sw
    from trainctl.rundir.runstate import PENDING

    st = status(path)
    if not isinstance(st, SweepStatus):
        return [_cancel_run(Path(path), st, force)]
    sw.request_cancel(st.path)
    # the queued first: on Slurm a job array would start its next element as soon as a running one ends
    active = sorted(((run, rs) for run, rs in st.runs if not isinstance(rs, Exception) and rs.active),
                    key=lambda x: x[1].state != PENDING)
    if not active:
        return [f"sweep {st.path}: no run is active; none of its runs will start until `trainctl resume {st.path}`"]
    return [f"{run.dir}: {_cancel_run(st.path / run.dir, rs, force)}" for run, rs in active]


def _cancel_run(run: Path, st: RunStatus, force: bool) -> str:
    from trainctl.launch.backend import backend_for
    from trainctl.launch.status import open_run, read_job_json
    from trainctl.rundir.paths import record_event
    from trainctl.rundir.runstate import STOPPING, stopping_progress

    paths = open_run(run)
    job = read_job_json(paths)
    if not st.active:
        return f"{st.name}: already {st.state}; nothing to cancel"
    if st.state == STOPPING and not force:  # a second signal must not cut short the save it asked for
        return (f"{st.name}: already stopping: {stopping_progress(paths)}; nothing more sent "
                f"(`trainctl cancel --force {run}` kills at once)")
    # recorded first: how the run ends reads "cancelled" (runstate); the launcher reads `force` (a SIGTERM
    # alone cannot say it), and ranks still starting read the request (runtime/train/signals.recorded_stop)
    try:
        record_event(paths, "cancel_requested", state=st.state, force=force)
    except OSError as e:
        raise RunError(f"{paths.events}: cannot record the cancel ({e.strerror}); nothing was sent",
                       hint="the run directory must be writable (its launcher stops a run whose directory "
                            "became read-only by itself)") from e
    return backend_for(job).cancel(paths, job, force=force)


# --- sweeps and tunes ----------------------------------------------------------------------------------------

@dataclass
class Sweep:
    """A sweep directory, and the `trainctl sweep` (or `tune`) process working on it from here (a local one runs
    its runs one after another in it; a Slurm sweep's ends once the job array is submitted)."""

    path: Path
    process: subprocess.Popen[str] | None = field(default=None, repr=False)

    def status(self) -> SweepStatus:
        """What `trainctl status SWEEP --json` says: the grid and every run's status."""
        st = status(self.path)
        assert isinstance(st, SweepStatus)
        return st

    def runs(self) -> list[Run]:
        """Each run of the sweep as a Run handle, in grid order."""
        from trainctl.launch import sweep as sw

        return [Run(self.path / r.dir) for r in sw.open_sweep(self.path).runs]

    def wait(self, timeout: float | None = None, poll_s: float = 1.0) -> SweepStatus:
        """Block until this process's `trainctl` has exited and no run of the sweep is active; its status."""
        def settled() -> SweepStatus | None:
            if _running(self.process):
                return None
            st = self.status()
            return None if st.active else st

        return _poll(settled, self.path, timeout, poll_s)

    def cancel(self, force: bool = False) -> list[str]:
        """`trainctl cancel SWEEP`: every active run saves and stops; none of the others starts."""
        return cancel(self.path, force=force)

    @property
    def output(self) -> str:
        """What the `trainctl` process printed (once it has exited)."""
        if self.process is None or self.process.poll() is None or self.process.stdout is None:
            return ""
        return self.process.stdout.read()


@dataclass
class Tune(Sweep):
    """A tune directory (a sweep over the layouts `plan --auto` ranks best) and its `trainctl tune` process."""

    def result(self) -> dict[str, Any] | None:
        """The table once every run has ended (TUNE/tune-result.json): per layout the predicted and measured
        step time, tokens/s and MFU and both ranks, the best, and `written`, the spec file; None before."""
        import json

        from trainctl.rundir.tune_record import RESULT

        f = self.path / RESULT
        return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None


def sweep(grid: dict[str, Sequence[Any]], spec: str | Path | None = None, *, sweep_dir: str | Path,
          overrides: Sequence[str] = (), max_parallel: int | None = None) -> Sweep:
    """`trainctl sweep` of the spec file (default: the embedded tiny CPU recipe) over `grid` ({key: values},
    every combination, the last key fastest), in a child process; the Sweep handle once its directory is made
    (a grid the spec refuses raises UsageError with every mistake, and nothing is made)."""
    path = Path(sweep_dir).absolute()
    args = ["sweep", *([str(spec)] if spec is not None else []), "--sweep-dir", str(path),
            *_sets(overrides), *(["--max-parallel", str(max_parallel)] if max_parallel else [])]
    for key, values in grid.items():
        args += ["--grid", f"{key}={','.join(_text(v) for v in values)}"]
    return Sweep(path, _child(path, args, "sweep.json"))


def tune(spec: str | Path | None = None, *, tune_dir: str | Path, top: int = 3, steps: int = 10,
         overrides: Sequence[str] = (), out: str | Path | None = None) -> Tune:
    """`trainctl tune` in a child process: the `top` layouts `plan --auto` ranks best, each run for `steps`
    steps; the Tune handle once its directory is made. `Tune.wait()`, then `Tune.result()`."""
    from trainctl.rundir.tune_record import RECORD

    path = Path(tune_dir).absolute()
    args = ["tune", *([str(spec)] if spec is not None else []), "--tune-dir", str(path), "--top", str(top),
            "--steps", str(steps), *_sets(overrides), *(["--out", str(Path(out).absolute())] if out else [])]
    return Tune(path, _child(path, args, RECORD))


def _sets(overrides: Sequence[str]) -> list[str]:
    return [w for o in overrides for w in ("--set", o)]


def _text(value: Any) -> str:
    """A grid value as `--grid` takes it (YAML's spelling: true, 0.001)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


__all__ = ["Run", "Sweep", "SweepStatus", "Tune", "cancel", "launch", "load", "plan", "plan_of", "resume", "status",
           "sweep", "tune"]

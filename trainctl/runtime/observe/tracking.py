"""Experiment tracking: extra sinks of the per-step metrics line (rank 0), TensorBoard and Weights & Biases.

RUN/metrics.jsonl is the record: the trainer appends each line there first, then hands it to these sinks,
which mirror its numeric fields (`scalars`). Both libraries are optional extras, imported only here and only
when the spec switches them on; a sink that cannot start or fails while writing warns once and is dropped,
and the run goes on (docs/design/trainer.md, "Experiment tracking and profiler traces").

Restarts and resumes append to the same run's logs. TensorBoard: each attempt writes a new event file whose
first event purges the steps after the checkpoint it resumed from (`purge_step`), so TensorBoard shows the
replayed steps once, with the values of the attempt that finished them; a rollback inside an attempt opens a
new file the same way. W&B: every attempt resumes one W&B run (its id kept in the run directory), and, as
W&B needs increasing steps, a step it was already given is not sent again (its first value stays).
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Protocol

from trainctl.fileio import write_atomic
from trainctl.rundir.paths import RunPaths, read_jsonl
from trainctl.runtime.observe.metrics import warn
from trainctl.spec.models import RunSpec

# The metrics line's fields that are not series: the x axis, its target, and the wall clock (TensorBoard takes
# it as each event's time instead).
NOT_SCALARS = frozenset({"step", "steps", "time"})
TRAIN = frozenset({"loss", "lr", "grad_norm"})  # train/<field>; every other top-level number is perf/<field>


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """tag -> value for every finite number of a metrics line: train/loss, train/lr, train/grad_norm, perf/mfu,
    perf/step_time_s, ..., and a nested section's numbers under its name (moe/imbalance, memory/max/weights).
    Lists (per-rank, per-expert) and flags stay in metrics.jsonl."""
    out: dict[str, float] = {}

    def walk(prefix: str, d: dict[str, Any]) -> None:
        for key, v in d.items():
            if isinstance(v, dict):
                walk(f"{prefix}{key}/", v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out[f"{prefix}{key}"] = float(v)

    for key, v in rec.items():
        if key in NOT_SCALARS:
            continue
        if isinstance(v, dict):
            walk(f"{key}/", v)
        else:
            walk("train/" if key in TRAIN else "perf/", {key: v})
    return out


class Sink(Protocol):
    name: str

    def write(self, rec: dict[str, Any]) -> None: ...

    def close(self, ok: bool) -> None: ...


class TensorBoardSink:
    """RUN/tensorboard: one event file per attempt (and per rollback), scalars by global step."""

    name = "TensorBoard"

    def __init__(self, paths: RunPaths, resumed_step: int):
        # torch's writer (the tensorboard extra: no tensorflow); the proto it writes, as torch imports it
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter

        self._writer_cls, self._summary = SummaryWriter, Summary
        self.dir = paths.tensorboard
        self._open(resumed_step + 1)

    def _open(self, purge_step: int) -> None:
        # purge_step: TensorBoard's readers drop every event of an earlier file at or after this step
        self.writer = self._writer_cls(str(self.dir), purge_step=purge_step)
        self.last = purge_step - 1

    def write(self, rec: dict[str, Any]) -> None:
        step = int(rec["step"])
        if step <= self.last:  # a rollback runs logged steps again: a new file purges them
            self.writer.close()
            self._open(step)
        # One event of every scalar, flushed: 0.2-0.5 ms a line on 2 busy cores, where add_scalar per field took
        # 4 ms (each a queue hand-off to the writer thread); a killed rank loses no line metrics.jsonl has.
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=v)
                                       for tag, v in scalars(rec).items()])
        self.writer.file_writer.add_summary(summary, step, rec.get("time"))
        self.writer.flush()
        self.last = step

    def close(self, ok: bool) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run under RUN/wandb (offline: nothing leaves the machine until `wandb sync`)."""

    name = "W&B"

    def __init__(self, spec: RunSpec, paths: RunPaths):
        import wandb  # the wandb extra

        from trainctl.spec import resolved_dict

        w = spec.tracking.wandb
        assert w is not None
        paths.wandb.mkdir(exist_ok=True)
        # W&B takes steps in increasing order only: the steps earlier attempts logged are not sent again
        self.last = max((r["step"] for r in read_jsonl(paths.metrics) if isinstance(r.get("step"), int)), default=0)
        self.run = wandb.init(project=w.project, entity=w.entity, mode=w.mode, dir=str(paths.root),
                              id=_wandb_run_id(paths), resume="allow",
                              name=paths.root.resolve().name, config=resolved_dict(spec),
                              settings=wandb.Settings(console="off", quiet=True))  # the rank's stdout is its own

    def write(self, rec: dict[str, Any]) -> None:
        step = int(rec["step"])
        if step <= self.last:
            return
        self.run.log(scalars(rec), step=step)
        self.last = step

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


def _wandb_run_id(paths: RunPaths) -> str:
    """The W&B run id of this run directory: made by the first attempt, read by every later one."""
    try:
        return paths.wandb_run_id.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        run_id = secrets.token_hex(6)  # W&B ids: letters, digits, - and _, unique in the project
        write_atomic(paths.wandb_run_id, run_id + "\n")
        return run_id


class Tracking:
    """The extra sinks of one attempt; a sink that fails is dropped with one warning (metrics.jsonl has every
    step)."""

    def __init__(self, sinks: list[Sink] | None = None):
        self.sinks: list[Sink] = list(sinks or [])

    def write(self, rec: dict[str, Any]) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(rec)
            except Exception as e:  # noqa: BLE001 - a tracking library's failure must not stop training
                self.sinks.remove(sink)
                warn(f"{sink.name} stopped at step {rec.get('step')} ({type(e).__name__}: {e}); it is off for the "
                     "rest of this attempt (metrics.jsonl has every step)")

    def close(self, ok: bool) -> None:
        for sink in self.sinks:
            try:
                sink.close(ok)
            except Exception as e:  # noqa: BLE001
                warn(f"{sink.name} did not close cleanly ({type(e).__name__}: {e})")
        self.sinks = []


def open_tracking(spec: RunSpec, paths: RunPaths, resumed_step: int) -> Tracking:
    """The sinks the spec switches on (rank 0, after the resume: `resumed_step` is the checkpoint's step, 0 for a
    fresh start). Nothing is imported when tracking is off."""
    t = spec.tracking
    sinks: list[Sink] = []
    for on, extra, make in ((t.tensorboard, "tensorboard", lambda: TensorBoardSink(paths, resumed_step)),
                            (t.wandb is not None, "wandb", lambda: WandbSink(spec, paths))):
        if not on:
            continue
        try:
            sinks.append(make())
        except Exception as e:  # noqa: BLE001 - not installed where the ranks run, a W&B server out of reach...
            fix = f"; pip install 'trainctl[{extra}]' where the ranks run" if isinstance(e, ImportError) else ""
            warn(f"tracking: {extra} is off for this attempt ({type(e).__name__}: {e}){fix} (metrics.jsonl has "
                 "every step)")
    return Tracking(sinks)

"""Experiment tracking and profiler traces on a real 2-rank run that fails once and resumes: TensorBoard's own
reader gives back metrics.jsonl's values step by step (the replayed step once, from the attempt that finished
it), the offline W&B run holds every step once, each selected rank leaves one trace that loads as JSON with the
collectives and the profiled steps in it, and mfu-report lists it. With tracking off nothing is imported or
created."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from trainer_utils import ROOT, make_run, metrics, run_trainer

from trainctl.report import build_report
from trainctl.report.render import render
from trainctl.runtime.train import faults

STEPS = 6
FAIL_AT = 4  # the first attempt fails here; it saved step 2, so step 3 runs twice
PROFILE = {"start_step": 5, "steps": 2, "ranks": [1]}  # in the second attempt, on rank 1 only


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard shows them (its own reader, restarts purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """The history rows of an offline .wandb file: a 7-byte W&B header, then LevelDB log records (32 KiB blocks,
    each chunk crc32c:4 length:2 type:1; full=1, first=2, middle=3, last=4) holding wandb's Record protos."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            if rec.WhichOneof("record_type") == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item})
    return rows


@pytest.mark.slow
def test_tensorboard_wandb_and_traces_across_a_restart(tmp_path: Path) -> None:
    run, world = make_run(tmp_path, "tracked", parallel={"dp": 2},
                          train={"steps": STEPS, "profile": PROFILE},
                          checkpoint={"every_steps": 2, "async": False},
                          tracking={"tensorboard": True, "wandb": {"project": "trainctl-test", "mode": "offline"}})
    first = run_trainer(run, world, env=faults.encode(fail_at_step=FAIL_AT, fail_rank=1), dump=False)
    assert first.returncode != 0 and "fail_at_step=4" in first.stderr
    second = run_trainer(run, world, dump=False)
    assert second.returncode == 0, second.stderr[-3000:]

    recs = metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 3, 4, 5, 6]  # step 3 logged by both attempts
    final = {r["step"]: r for r in recs}  # the later line of a step: the attempt that finished it

    # TensorBoard: every step once, each numeric field equal to metrics.jsonl's (float32, as TensorBoard stores)
    tb = tensorboard_scalars(run / "tensorboard")
    assert len(list((run / "tensorboard").iterdir())) == 2  # one event file per attempt
    fields = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm", "perf/mfu": "mfu",
              "perf/step_time_s": "step_time_s", "perf/tokens_per_s": "tokens_per_s", "perf/hfu": "hfu",
              "perf/tflops_per_gpu": "tflops_per_gpu", "perf/data_wait_s": "data_wait_s",
              "perf/peak_mem_bytes": "peak_mem_bytes"}
    for tag, key in fields.items():
        assert [s for s, _ in tb[tag]] == list(range(1, STEPS + 1)), tag
        assert [v for _, v in tb[tag]] == [np.float32(final[s][key]) for s in range(1, STEPS + 1)], tag
    # the replayed step shows the second attempt's time, not the first's
    replayed = [r for r in recs if r["step"] == 3]
    assert replayed[0]["step_time_s"] != replayed[1]["step_time_s"]
    assert dict(tb["perf/step_time_s"])[3] == np.float32(replayed[1]["step_time_s"])
    # a field of a nested section: the measured memory, once per attempt
    assert {s for s, _ in tb["memory/max/weights"]} == {r["step"] for r in recs if "memory" in r}

    # W&B offline: one run id for both attempts, every step once (W&B keeps a step's first value)
    run_id = (run / "wandb" / "trainctl-run-id").read_text().strip()
    files = sorted((run / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
    assert len(files) == 2, list((run / "wandb").iterdir())
    rows = [row for f in files for row in wandb_history(f)]
    assert [row["_step"] for row in rows] == list(range(1, STEPS + 1))
    first_value = {}
    for r in recs:
        first_value.setdefault(r["step"], r)
    assert [row["train/loss"] for row in rows] == [first_value[s]["loss"] for s in range(1, STEPS + 1)]
    assert [row["perf/mfu"] for row in rows] == [first_value[s]["mfu"] for s in range(1, STEPS + 1)]

    # profiler: one trace, of the selected rank, covering exactly the window, with collectives and the steps
    traces = sorted((run / "profile").iterdir())
    assert [t.name for t in traces] == ["trace-rank1-steps5-6.json"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events if e.get("ph") == "X"}
    assert {"gloo:all_reduce", "c10d::allreduce_"} <= names  # the DP gradient and loss/norm all-reduces
    assert {n for n in names if n.startswith("train_step#")} == {"train_step#5", "train_step#6"}
    assert any(n.startswith("Optimizer.step") for n in names)
    assert [r["step"] for r in recs if r.get("profiled")] == [5, 6]

    # mfu-report lists it, in its JSON and its text
    report = build_report([run])
    listed = report["runs"][0]["profile"]
    assert [(f["kind"], f["rank"], f["first_step"], f["last_step"], Path(f["path"]).name) for f in listed] == [
        ("trace", 1, 5, 6, "trace-rank1-steps5-6.json")]
    out = io.StringIO()
    render(report, Console(file=out, width=200))
    assert f"rank 1, steps 5-6: trace {traces[0]}" in out.getvalue()


_IMPORTS = """
import sys
from pathlib import Path
from trainctl.rundir.paths import RunPaths
from trainctl.runtime.observe import profiling, tracking
from trainctl.runtime.train import trainer
from trainctl.spec import load_spec
import torch
spec = load_spec(sys.argv[1])
paths = RunPaths(Path(sys.argv[2]))
sinks = tracking.open_tracking(spec, paths, 0)
prof = profiling.for_rank(spec, paths, 0, torch.device("cpu"), 0)
print(len(sinks.sinks), type(prof).__name__, sorted(m for m in sys.modules if m.split(".")[0] in
      ("tensorboard", "wandb", "tensorboardX") or m.startswith("torch.utils.tensorboard")))
"""


@pytest.mark.slow
def test_tracking_off_imports_and_creates_nothing(tmp_path: Path) -> None:
    run, world = make_run(tmp_path, "plain", train={"steps": 2})
    r = run_trainer(run, world, dump=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not {"tensorboard", "wandb", "profile"} & {p.name for p in run.iterdir()}
    assert not any("profiled" in x for x in metrics(run))
    # the trainer's modules and its sinks' opener, as a rank runs them, with the spec's defaults
    out = subprocess.run([sys.executable, "-c", _IMPORTS, str(run / "spec.yaml"), str(run)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "NoProfiler", "[]"]

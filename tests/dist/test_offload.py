"""Optimizer offload (parallel.offload: optimizer) trains what the plain run trains: ZeRO-1, ZeRO-2 (bf16
parameters, rounded on the host) and ZeRO-3 (FSDP2's CPUOffloadPolicy) with the optimizer state in host memory
reproduce the plain run's losses, grad norms and final weights bit for bit (the host step and the plain one
are both torch's fused CPU AdamW, over the same slices). A ZeRO-1 offload run
resumes bit for bit with offload, and across the flag (the checkpoint holds the same state wherever it lived).
Real processes (gloo, CPU); on this machine host and device are both the CPU, but the host tensors are separate
and the copies between them run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from resume_utils import assert_resumed_bitwise, assert_same_weights, curve, ok, set_spec, straight_and_resumed
from trainer_utils import final_weights, make_run, metrics, run_trainer

from trainctl.checkpoint import abandoned_dirname, list_checkpoints

pytestmark = pytest.mark.slow

SMALL_BUCKETS = {"TRAINCTL_BUCKET_NUMEL": "20000"}  # several buckets: ZeRO slices cut through parameters
STEPS = 6
OFFLOAD = {"offload": "optimizer"}


def assert_same_runs(a: Path, b: Path, steps: list[int] | None = None) -> None:
    """Losses and grad norms of the given steps (default: all), and the final fp32 weights, bit for bit."""
    ca = {s: (loss, g) for s, loss, g in curve(a)}
    cb = {s: (loss, g) for s, loss, g in curve(b)}
    for s in steps or sorted(ca):
        assert cb[s] == ca[s], f"loss and grad norm of step {s}"
    for run in (a, b):
        assert all(w.dtype == torch.float32 for w in final_weights(run).values()), run
    assert_same_weights(a, b)


def host_memory(run: Path) -> list[dict[str, int]]:
    (rec,) = [m["memory"] for m in metrics(run) if "memory" in m]
    return rec["per_rank"]


def assert_host_as_planned(run: Path) -> None:
    """The trainer's host bytes are the plan's (plan/memory.py offloaded_state_bytes), up to bucket padding and
    AdamW's step counters, and no optimizer byte stays on the device: planned and measured."""
    from trainctl.plan.plan import build_plan
    from trainctl.spec import load_spec

    est = build_plan(load_spec(run / "spec.yaml")).est
    assert est.worst.optimizer == 0 and est.host_per_gpu > 0
    for r in host_memory(run):
        assert r["optimizer"] == 0, r
        assert r["host"] == pytest.approx(est.host_per_gpu, rel=0.01), (r, est.host_per_gpu)


def rewound_copy(straight: Path, dest: Path, step: int) -> Path:
    """A copy of `straight` whose checkpoints after `step` are moved aside (as `trainctl resume --from-step`)."""
    shutil.copytree(straight, dest, ignore=shutil.ignore_patterns("final_weights"))
    for info in list_checkpoints(dest / "checkpoints"):
        if info.step > step:
            os.replace(info.path, info.path.with_name(abandoned_dirname(info.step, "rewound")))
    return dest


def test_zero1_offload_matches_plain_and_resumes_across_the_flag(tmp_path: Path) -> None:
    parallel = {"dp": 2, "zero": 1, "micro_batch": 2}
    plain, world = make_run(tmp_path, "plain", parallel=parallel, train={"steps": STEPS})
    ok(run_trainer(plain, world, env=SMALL_BUCKETS), "plain ZeRO-1")
    straight, resumed = straight_and_resumed(tmp_path, {**parallel, **OFFLOAD}, STEPS, env=SMALL_BUCKETS)
    assert_same_runs(plain, straight)
    # the master, moments and gradient copies lived in host memory (16/dp bytes per parameter), none on the
    # "device"
    assert_host_as_planned(straight)
    assert "host" not in host_memory(plain)[0]
    assert_resumed_bitwise(straight, resumed, STEPS)  # offload -> offload: bit for bit
    # offload -> plain: the same state on the device, stepped there
    off = rewound_copy(straight, tmp_path / "off", STEPS // 2)
    set_spec(off, parallel={"offload": "none"})
    ok(run_trainer(off, world, env=SMALL_BUCKETS), "resumed without offload")
    assert [s for s, _, _ in curve(off)][STEPS:] == list(range(STEPS // 2 + 1, STEPS + 1))
    assert_same_runs(straight, off, steps=list(range(STEPS // 2 + 1, STEPS + 1)))


POWERSGD = {"grad_compression": {"powersgd": {"rank": 2, "start_step": 2}}}


@pytest.mark.parametrize("case", ["zero2-bf16", "zero3", "zero1-powersgd"])
def test_offload_matches_plain(case: str, tmp_path: Path) -> None:
    """Each sharded optimizer, and ZeRO-1 with PowerSGD (the compressed reduction, then the host step)."""
    zero, sections, extra = {"zero2-bf16": (2, {"train": {"steps": STEPS, "precision": "bf16",
                                                          "low_precision_on_cpu": True}}, {}),
                             "zero3": (3, {"train": {"steps": STEPS}}, {}),
                             "zero1-powersgd": (1, {"train": {"steps": STEPS}}, POWERSGD)}[case]
    parallel = {"dp": 2, "zero": zero, "micro_batch": 2, **extra}
    plain, world = make_run(tmp_path, "plain", parallel=parallel, **sections)
    ok(run_trainer(plain, world, env=SMALL_BUCKETS), f"plain {case}")
    offload, _ = make_run(tmp_path, "offload", parallel={**parallel, **OFFLOAD}, **sections)
    ok(run_trainer(offload, world, env=SMALL_BUCKETS), f"offload {case}")
    # bf16 parameters (ZeRO-2) are the master's rounding, on the host or not; PowerSGD orthogonalises the same
    # error-fed gradients before either step
    assert_same_runs(plain, offload)
    if zero == 2:  # 18/dp bytes: the bf16 parameters came from the host's rounding of the master
        assert_host_as_planned(offload)

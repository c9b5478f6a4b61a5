"""The trainer's entry point and bookkeeping: MFU arithmetic, failing ranks, exit status, LR schedule."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer_utils import ROOT, make_run, metrics, run_trainer

from trainctl.rundir.paths import read_jsonl
from trainctl.runtime.train import faults
from trainctl.runtime.train.optim import lr_at
from trainctl.spec.models import TrainSpec


def independent_flops_per_token(model: dict) -> float:
    """6N + 12*L*h*s with N counted here from the spec fields (GELU MLP 4h, MHA, tied LM head counted)."""
    h, L, V, s = model["hidden"], model["layers"], model["vocab"], model["seq_len"]
    per_layer = 4 * h * h + 2 * h * (4 * h)  # q, k, v, o + fc1, fc2
    n = L * per_layer + V * h  # + LM head (tied: the lookup is not a matmul, the projection is)
    return 6 * n + 12 * L * h * s


@pytest.mark.slow
def test_mfu_is_model_flops_over_time_ranks_and_peak(tmp_path: Path) -> None:
    run, world = make_run(tmp_path, "mfu", parallel={"dp": 2}, train={"steps": 4})
    r = run_trainer(run, world, dump=False)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = metrics(run)
    assert [x["step"] for x in recs] == [1, 2, 3, 4]
    spec_model = {"hidden": 64, "layers": 4, "vocab": 256, "seq_len": 32}
    tokens = 8 * 32
    flops = independent_flops_per_token(spec_model) * tokens
    for x in recs:
        assert x["model_flops_per_step"] == pytest.approx(flops, rel=1e-12)
        expect = flops / (x["step_time_s"] * world * x["peak_tflops_per_gpu"] * 1e12)
        assert x["mfu"] == pytest.approx(expect, rel=1e-9)
        assert 0 < x["mfu"] < 1 and "mfu_bug" not in x
        assert x["world_size"] == world
        assert x["tokens_per_s"] == pytest.approx(tokens / x["step_time_s"])
        assert x["tflops_per_gpu"] * 1e12 == pytest.approx(flops / x["step_time_s"] / world)
        for key in ("loss", "lr", "grad_norm", "hfu", "peak_mem_bytes", "tokens_per_s_per_gpu"):
            assert key in x
    assert "MFU" in r.stdout and "tok/s" in r.stdout
    events = [e["event"] for e in read_jsonl(run / "events.jsonl")]
    assert {"start", "finish"} <= set(events) and "failure" not in events


@pytest.mark.slow
def test_failing_rank_fails_the_job_promptly(tmp_path: Path) -> None:
    run, world = make_run(tmp_path, "fail", parallel={"dp": 2}, train={"steps": 6})
    t0 = time.monotonic()
    r = run_trainer(run, world, env={**faults.encode(fail_at_step=3, fail_rank=1), "TRAINCTL_TIMEOUT_S": "60"},
                    dump=False, timeout=120)
    assert r.returncode != 0
    assert time.monotonic() - t0 < 60
    assert "trainctl: rank 1 failed: InjectedFailure: fault fail_at_step=3" in r.stderr
    failures = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "failure"]
    assert failures and failures[0]["rank"] == 1
    assert len(metrics(run)) == 2  # steps 1 and 2 completed


def test_spec_error_exits_2(tmp_path: Path) -> None:
    run, _ = make_run(tmp_path, "bad")
    (run / "spec.yaml").write_text((run / "spec.yaml").read_text().replace("layers: 4", "layerz: 4"))
    # one plain process (torchrun would turn any failing child into its own exit status 1)
    r = subprocess.run([sys.executable, "-m", "trainctl.runtime", str(run)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert "layerz" in r.stderr


def test_world_size_mismatch_is_a_clear_error(tmp_path: Path) -> None:
    run, _ = make_run(tmp_path, "mismatch", parallel={"dp": 2})
    r = subprocess.run([sys.executable, "-m", "trainctl.runtime", str(run)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1
    assert "2 ranks but 1 processes were started" in r.stderr


def test_lr_schedule_is_pure_warmup_then_cosine_to_min() -> None:
    t = TrainSpec(global_batch=8, steps=110, lr=1.0, warmup=10)
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(60, t) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, t) == pytest.approx(0.1)  # default min_lr = lr/10
    assert lr_at(500, t) == pytest.approx(0.1)
    lin = TrainSpec(global_batch=8, steps=10, lr=1.0, lr_schedule="linear", min_lr=0.0)
    assert lr_at(5, lin) == pytest.approx(0.5)
    const = TrainSpec(global_batch=8, steps=10, lr=2.0, lr_schedule="constant")
    assert {lr_at(s, const) for s in range(10)} == {2.0}


def test_peak_cache_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainctl.runtime.observe import peak

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = peak.cpu_single_thread_flops()
    assert first > 1e8
    cached = json.loads((tmp_path / "trainctl" / "cpu_peak.json").read_text())
    assert list(cached.values()) == [first]
    monkeypatch.setattr(peak, "measure_matmul_flops", lambda *a, **k: pytest.fail("measured twice"))
    assert peak.cpu_single_thread_flops() == first

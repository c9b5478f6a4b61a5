"""Checkpoint cadence (plan/cadence.py): the Young/Daly interval in `plan` and `mfu-report`.

Formulas: Young, CACM 17(9) 1974 (T = sqrt(2CM)); Daly, FGCS 22(3) 2006, eq. 37
(T = sqrt(2CM)(1 + sqrt(C/2M)/3 + (C/2M)/9) - C for C < 2M, else M). The per-node MTBF is Llama 3's
(Dubey et al. 2024, sec. 3.3.4: 419 unexpected interruptions in 54 days on 16,384 GPUs = 2,048 nodes)."""

from __future__ import annotations

import json

import pytest
from cli_utils import trainctl
from paths import REPO

from trainctl.plan import cadence
from trainctl.plan.checkpoint_size import checkpoint_bytes
from trainctl.plan.plan import build_plan
from trainctl.report import analyze, load_run
from trainctl.spec import load_spec

LLAMA_8B = REPO / "recipes" / "llama3-8b.yaml"
LLAMA3_GPU_HOURS = 54 * 24 * 16384 / 419  # Llama 3 sec. 3.3.4: GPU-hours per interruption


def test_young_and_daly_against_hand_arithmetic():
    # C = 5 min, M = 1 day: 2CM = 51,840,000 s^2 -> Young exactly 7,200 s; C/2M = 1/576, sqrt = 1/24
    c, m = 300.0, 86_400.0
    assert cadence.young_interval(c, m) == pytest.approx(7200.0)
    assert cadence.daly_interval(c, m) == pytest.approx(7200 * (1 + 1 / 72 + 1 / 5184) - 300)  # 7,001.39 s
    assert cadence.daly_interval(2 * m, m) == m  # a save longer than 2 MTBF: Daly's T = M
    # the loss is the whole-run model's share of the wall clock; with C, T << M it is close to the first-order
    # C/T + T/2M = 300/7200 + 7200/172800 = 1/12 of the compute, i.e. (1/12) / (1 + 1/12) = 1/13 of the wall,
    # plus the higher-order terms (T/M = 1/12: about 5% more)
    loss = cadence.expected_loss(7200.0, c, m)
    assert loss == pytest.approx(1 / 13, rel=0.07) and loss > 1 / 13
    assert cadence.expected_loss(5000.0, c, m) > loss < cadence.expected_loss(10000.0, c, m)


def test_the_interval_loss_is_one_less_the_ettr_of_the_same_run() -> None:
    """One model: at an MTBF of 1 hour (saves every 3h 51m) the first-order loss C/T + T/2M said 134.68% beside
    an ETTR of 17.3%. The loss printed is 1 - ETTR of a run of whole intervals, and never 100% or more."""
    from trainctl.plan.whole_run import WholeRun

    c, m, r, t = 0.3, 3600.0, 432.0, 13860.0
    run = WholeRun(compute_s=10 * t, interval_s=t, save_block_s=c, last_write_s=0.0, restart_s=r, mtbf_s=m)
    loss = cadence.expected_loss(t, c, m, r)
    assert loss == pytest.approx(1 - run.ettr) and 0 < loss < 1
    assert c / t + t / (2 * m) > 1  # the first-order sum this replaces
    assert cadence.expected_loss(1e6, c, m, r) == 1.0  # exp past a float's range: all of it lost


def test_job_mtbf_scales_a_published_fleets_rate_per_gpu():
    """Llama 3's snapshot: 54 days x 16,384 H100 / 419 interruptions = 50,677 GPU-hours each, so a job of that
    size fails every 3.09 h (the paper's ~3 hours) and one of 64 GPUs every 33 days; OPT-175B's 105 restarts (35
    manual, an estimated 70+ automatic) in 60 days on 992 A100 give 13,605 GPU-hours, the default for an A100.
    checkpoint.mtbf_hours overrides both."""
    llama = 54 * 24 * 16384 / 419
    mtbf, source = cadence.job_mtbf(gpus=16384, gpu="h100-sxm", mtbf_hours=None, fleet=None)
    assert mtbf / 3600 == pytest.approx(3.093, abs=1e-3) and "llama3-h100" in source and "Dubey" in source
    assert cadence.job_mtbf(gpus=64, gpu="h200", mtbf_hours=None, fleet=None)[0] == pytest.approx(llama / 64 * 3600)
    mtbf, source = cadence.job_mtbf(gpus=992, gpu="a100-80gb", mtbf_hours=None, fleet=None)
    assert mtbf == pytest.approx(60 * 24 * 3600 / 105) and "opt175b-a100" in source and "Zhang" in source
    chosen = cadence.job_mtbf(gpus=992, gpu="a100-80gb", mtbf_hours=None, fleet="llama3-h100")[0]
    assert chosen == pytest.approx(llama / 992 * 3600)
    assert cadence.job_mtbf(gpus=8, gpu="h100-sxm", mtbf_hours=12.0, fleet="opt175b-a100")[0] == 12 * 3600.0


def test_plan_prices_a_save_and_compares_the_interval():
    spec = load_spec(LLAMA_8B)  # 4 nodes x 8 H100, async saves every 1,000 steps
    j = build_plan(spec).to_json()
    ck, step = j["checkpoint"], j["prediction"]["step_time_s"]
    size = checkpoint_bytes(spec)
    write = size / 4 / 2e9  # estimate.checkpoint_write_gbps 2 per node
    stage = size / 32 / 10e9  # estimate.checkpoint_stage_gbps 10 per GPU
    assert ck["bytes"] == size and ck["blocking_s"] == pytest.approx(stage)
    assert ck["save_s"] == pytest.approx(stage + write)
    cad = ck["cadence"]
    assert cad["configured_s"] == pytest.approx(1000 * step)
    assert cad["optimal_s"] == pytest.approx(cadence.daly_interval(stage, LLAMA3_GPU_HOURS / 32 * 3600))
    assert cad["optimal_steps"] == round(cad["optimal_s"] / step)
    assert not [w for w in j["warnings"] if w["code"].startswith("CHECKPOINT")]


def test_plan_warns_about_a_wasteful_or_missing_cadence():
    def warnings(*sets: str) -> dict[str, str]:
        j = build_plan(load_spec(LLAMA_8B, overrides=sets)).to_json()
        return {w["code"]: w["message"] for w in j["warnings"] if w["code"].startswith("CHECKPOINT")}

    # synchronous saves every step: each blocks for the whole write (~12 s) of a ~14 s step
    w = warnings("checkpoint.async=false", "checkpoint.every_steps=1")
    assert "too frequent" in w["CHECKPOINT_INTERVAL"] and "Young/Daly" in w["CHECKPOINT_INTERVAL"]
    # every 100,000 steps (~16 days) against a 2-hour MTBF: much too far apart
    w = warnings("checkpoint.every_steps=100000", "train.steps=200000", "checkpoint.mtbf_hours=2")
    assert "too far apart" in w["CHECKPOINT_INTERVAL"]
    # none scheduled on a run longer than the interval: say so; a short run is left alone
    w = warnings("checkpoint.every_steps=null", "checkpoint.mtbf_hours=2")
    assert "no checkpoints scheduled" in w["CHECKPOINT_INTERVAL"]
    assert warnings("checkpoint.every_steps=null", "train.steps=10", "train.warmup=0") == {}
    # async saves due faster than the filesystem writes them
    w = warnings("checkpoint.every_steps=1", "estimate.checkpoint_write_gbps=0.5")
    assert "each save waits for the previous one" in w["CHECKPOINT_BACKLOG"]


def test_plan_prints_the_checkpoint_rows_and_rejects_a_bad_mtbf():
    out = trainctl("plan", str(LLAMA_8B)).stdout
    assert "Young/Daly interval" in out and "every 1000 steps" in out
    p = trainctl("plan", str(LLAMA_8B), "--set", "checkpoint.mtbf_hours=-1")
    assert p.returncode == 2 and "checkpoint.mtbf_hours" in p.stderr and "Traceback" not in p.stderr


def test_mfu_report_measures_the_cadence(tmp_path):
    """The unit report fixture: a 0.2 s blocking save after step 4 (committed 0.1 s after the step ended),
    1 s steps; saved every step the loss is 0.2 of 1.2 s: warned."""
    from test_report_unit import interrupted_run

    run = interrupted_run(tmp_path)
    c = analyze(load_run(run))["checkpoint_cadence"]
    mtbf = LLAMA3_GPU_HOURS / 8 * 3600  # the fixture's spec: 1 node of 8 H100 by default
    assert (c["cost_s"], c["save_s"], c["saves"]) == pytest.approx((0.2, 0.1, 1))
    assert c["optimal_s"] == pytest.approx(cadence.daly_interval(0.2, mtbf)) and c["configured_s"] is None
    (run / "spec.yaml").write_text("name: x\ntrain: {log_every: 1, steps: 10}\ncheckpoint: {every_steps: 1}\n")
    r = analyze(load_run(run))
    # saved every 1 s step, a 0.2 s save is 0.2 of every 1.2 s of wall clock (failures hardly count at this MTBF)
    assert r["checkpoint_cadence"]["loss_configured"] == pytest.approx(0.2 / 1.2, rel=1e-4)
    assert any("checkpoints every 1.00 s are too frequent" in w for w in r["warnings"])
    json.dumps(r, allow_nan=False)


def test_lr_scaling_rules_for_a_changed_global_batch():
    """Batch x4 with lr 3e-4 kept: square-root rule (Malladi et al. 2022) 6e-4, linear (Goyal et al. 2017)
    1.2e-3; an unchanged batch, or an lr the user changed too, is no warning."""
    from trainctl.plan.lr_scaling import lr_unchanged_warning

    line = lr_unchanged_warning(old_batch=256, new_batch=1024, old_lr=3e-4, new_lr=3e-4)
    assert line is not None and "(x4)" in line and "gives 0.0006, the linear rule" in line and "0.0012" in line
    assert lr_unchanged_warning(old_batch=256, new_batch=256, old_lr=3e-4, new_lr=3e-4) is None
    assert lr_unchanged_warning(old_batch=256, new_batch=1024, old_lr=3e-4, new_lr=6e-4) is None

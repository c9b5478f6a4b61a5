"""The whole-run model (plan/whole_run.py): its closed forms against a seeded event simulation of the same
failure process, and its default failure model against a published fleet."""

from __future__ import annotations

import math
import os
import random
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from trainctl.plan.cadence import daly_interval, job_mtbf
from trainctl.plan.whole_run import WholeRun, optimal_interval_s, simulate_wall_s

HOUR = 3600.0


def _run(**overrides: float) -> WholeRun:
    values = dict(compute_s=200 * HOUR, interval_s=1.0 * HOUR, save_block_s=0.05 * HOUR,
                  last_write_s=0.1 * HOUR, restart_s=0.3 * HOUR, mtbf_s=10 * HOUR)
    values.update(overrides)
    return WholeRun(**values)


@pytest.mark.parametrize("overrides", [{}, {"compute_s": 200.5 * HOUR},  # a last, shorter segment
                                       {"mtbf_s": 2 * HOUR, "restart_s": 0.5 * HOUR}])  # failure-heavy
def test_closed_form_matches_seeded_simulation(overrides: dict[str, float]) -> None:
    run = _run(**overrides)
    draws = [simulate_wall_s(run, random.Random(seed)) for seed in range(400)]
    walls = [w for w, _ in draws]
    mean, sd = statistics.fmean(walls), statistics.stdev(walls)
    err = 4 * sd / math.sqrt(len(walls))  # four standard errors of the simulated mean
    assert abs(run.expected_wall_s - mean) < err
    assert abs(run.ettr - run.compute_s / mean) / run.ettr < 1.01 * err / mean
    fail_mean = statistics.fmean(f for _, f in draws)
    fail_sd = statistics.stdev(f for _, f in draws)
    assert abs(run.expected_failures - fail_mean) < 4 * fail_sd / math.sqrt(len(draws))
    p10, p50, p90 = run.wall_percentiles_s()
    sim_p10, sim_p50, sim_p90 = (statistics.quantiles(walls, n=10)[i] for i in (0, 4, 8))
    # P50: within the error of the simulated median (about 1.25 standard errors of the mean for a normal)
    assert abs(p50 - sim_p50) < 1.25 * err
    # the spread is a normal approximation: its half-width within a fifth of the simulation's
    assert (p90 - p10) == pytest.approx(sim_p90 - sim_p10, rel=0.2)


def test_no_failures_costs_only_the_saves() -> None:
    run = _run(mtbf_s=1e15)
    assert run.saves == 200
    assert run.expected_wall_s == pytest.approx(200 * 1.05 * HOUR + 0.1 * HOUR, rel=1e-6)
    assert run.expected_failures == pytest.approx(0.0, abs=1e-6)


def test_expected_failures_are_the_failure_rate_times_the_exposed_time() -> None:
    """Wald's identity: every second but the last write is exposed to failures at rate 1/M."""
    run = _run()
    assert run.expected_failures == pytest.approx((run.expected_wall_s - run.last_write_s) / run.mtbf_s, rel=1e-9)


def test_full_model_interval_is_daly_whatever_the_restart_costs() -> None:
    """The restart cost enters the expected wall clock as the factor exp(R/M), the same at every interval, so it
    does not move the optimum: the full model minimises (exp((T+C)/M) - 1) / T, which Daly's formula approximates."""
    run = _run(compute_s=2000 * HOUR)
    best = optimal_interval_s(run)
    daly = daly_interval(run.save_block_s, run.mtbf_s)
    assert best == pytest.approx(daly, rel=0.05)
    assert optimal_interval_s(_run(compute_s=2000 * HOUR, restart_s=3 * HOUR)) == pytest.approx(best, rel=0.02)
    at_best = replace(run, interval_s=best).expected_wall_s
    assert all(at_best < replace(run, interval_s=t).expected_wall_s for t in (best / 2, best * 2))


def test_default_failure_model_reproduces_llama3_interruptions() -> None:
    """Dubey et al., "The Llama 3 Herd of Models" (2024), sec. 3.3.4: 419 unexpected interruptions in a 54-day
    snapshot of pre-training on 16,384 H100s (2,048 nodes of 8)."""
    mtbf_s, _ = job_mtbf(gpus=16384, gpu="h100-sxm", mtbf_hours=None, fleet=None)
    snapshot_s = 54 * 24 * HOUR
    run = WholeRun(compute_s=snapshot_s * 0.9, interval_s=0.5 * HOUR, save_block_s=30.0, last_write_s=0.0,
                   restart_s=0.1 * HOUR, mtbf_s=mtbf_s)
    per_wall_second = run.expected_failures / run.expected_wall_s
    assert per_wall_second * snapshot_s == pytest.approx(419, rel=0.03)


REPO = Path(__file__).resolve().parents[2]
LLAMA_405B = str(REPO / "recipes" / "llama3-405b.yaml")
LLAMA_405B_STAGED = str(REPO / "recipes" / "llama3-405b-staged.yaml")  # the whole run: train.stages
BLOOM_STAGED = str(REPO / "recipes" / "bloom-176b.yaml")  # the batch ramp as two stages, then the full batch


def test_plan_prices_the_whole_run_from_its_own_step_time() -> None:
    """The 405B recipe's whole run worked by hand from its figures, the plan's predicted step time and
    checkpoint size taken as given (the memory and step models are tested elsewhere). No Slurm time limit
    (cluster.time=null), so no requeue but those after failures; a 3 h MTBF given (checkpoint.mtbf_hours: the
    fleet's default rate is tested with its fleet)."""
    from trainctl.plan.plan import build_plan
    from trainctl.spec import load_spec

    spec = load_spec(LLAMA_405B, ["cluster.gpu_hour_price=2.5", "cluster.time=null", "checkpoint.mtbf_hours=3"])
    plan = build_plan(spec).to_json()
    ck, run = plan["checkpoint"], plan["checkpoint"]["whole_run"]
    step = plan["prediction"]["step_time_s"]  # the planner's, given (about 7 s)
    compute = 900_000 * step  # train.steps
    interval = 250 * step  # checkpoint.every_steps: about half an hour of compute between saves
    segments = 900_000 // 250  # 3,600 intervals, none shorter: the steps divide into them
    mtbf = 3 * 3600  # checkpoint.mtbf_hours: 10,800 s (Llama 3's 16K GPUs saw an interruption every ~3 h)
    load = ck["bytes"] / 2048 / 2.0e9  # the checkpoint read back at 2 GB/s per node: ~1.19 s
    restart = 120 + 300 + load  # requeue + start-up (the estimate defaults) + load: ~421.2 s
    block = ck["blocking_s"]  # an async save blocks ~0.03 s; its write (~1.19 s) follows the last step
    span = interval + block
    # each interval T + C takes M e^(R/M) (e^((T+C)/M) - 1) on average, e^(R/M) = 1.0398 for R/M = 0.039
    per_segment = mtbf * math.exp(restart / mtbf) * math.expm1(span / mtbf)
    wall = segments * per_segment + (ck["save_s"] - block)  # about 80 days at a 7 s step
    failures = segments * math.exp(restart / mtbf) * math.expm1(span / mtbf)  # some 600 interruptions
    assert run["compute_s"] == pytest.approx(compute, rel=1e-12) and run["saves"] == segments
    assert run["mtbf_s"] == pytest.approx(mtbf) and run["restart_s"] == pytest.approx(restart)
    assert run["restart_parts_s"] == pytest.approx({"requeue": 120, "startup": 300, "checkpoint_load": load})
    assert run["wall_days"]["mean"] == pytest.approx(wall / 86400, rel=1e-9)
    assert run["expected_interruptions"] == pytest.approx(failures, rel=1e-9)
    assert run["ettr"] == pytest.approx(compute / wall, rel=1e-9)
    # the spread: each interruption costs R plus a uniform share of the interval it hits (E[X^2] of R + U(0, S))
    sd = math.sqrt(failures * (restart**2 + restart * span + span**2 / 3))
    assert run["wall_days"]["p10"] == pytest.approx((wall - 1.2815515655446004 * sd) / 86400, rel=1e-9)
    assert run["wall_days"]["p90"] == pytest.approx((wall + 1.2815515655446004 * sd) / 86400, rel=1e-9)
    gpu_hours = wall / 3600 * 2048 * 8  # on 16,384 H100s
    assert run["gpu_hours"] == pytest.approx(gpu_hours, rel=1e-9)
    assert run["cost"] == pytest.approx(2.5 * gpu_hours, rel=1e-9)
    assert run["energy_mwh"] == pytest.approx(gpu_hours * 700 / 1e6, rel=1e-9)  # H100 SXM's 700 W datasheet maximum
    assert 0 < run["ettr"] < 1 and set(run["formulas"]) >= {"wall", "spread", "restart_s", "cost"}
    assert build_plan(load_spec(LLAMA_405B)).to_json()["checkpoint"]["whole_run"]["cost"] is None  # no default


def test_negative_price_is_one_line_naming_the_field_exit_2() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "from trainctl.cli.app import main; main()", "plan", LLAMA_405B,
                          "--set", "cluster.gpu_hour_price=-2"], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "cluster.gpu_hour_price" in out.stderr


def test_token_budget_sets_the_steps_and_refuses_a_partial_batch() -> None:
    from trainctl.errors import SpecError
    from trainctl.plan.plan import build_plan
    from trainctl.spec import load_spec, load_spec_text

    by_steps = load_spec(LLAMA_405B)
    tokens = by_steps.train.steps * by_steps.batch_tokens
    for written in (str(tokens), f"{tokens / 1e12:.12g}T"):
        spec = load_spec(LLAMA_405B, ["train.steps=null", f"train.tokens={written}"])
        assert spec.train.steps == by_steps.train.steps and spec.train.tokens == tokens
    run = build_plan(spec).to_json()["checkpoint"]["whole_run"]
    assert (run["steps"], run["tokens"], run["given"]) == (by_steps.train.steps, tokens, "train.tokens")
    with pytest.raises(SpecError) as err:
        load_spec(LLAMA_405B, ["train.steps=null", f"train.tokens={tokens + 1}"])
    assert "train.tokens" in str(err.value) and "Fix: use" in str(err.value)
    # a --set of one of the two replaces the other, as a data source's does
    assert load_spec(LLAMA_405B, [f"train.tokens={tokens}"]).train.steps == by_steps.train.steps
    assert load_spec(LLAMA_405B, [f"train.tokens={tokens}", "train.steps=9000"]).train.tokens is None
    # both in one file (a run directory's frozen spec) must agree
    assert load_spec(LLAMA_405B, ["train.steps=null", f"train.tokens={tokens}"]).train.steps == by_steps.train.steps
    with pytest.raises(SpecError) as err:
        load_spec_text(Path(LLAMA_405B).read_text().replace(
            f"steps: {by_steps.train.steps},", f"tokens: {tokens}, steps: {by_steps.train.steps + 1},"))
    assert f"train.steps = {by_steps.train.steps + 1}: disagrees with train.tokens" in str(err.value)
    with pytest.raises(SpecError, match="give train.steps, train.tokens or train.stages"):
        load_spec(LLAMA_405B, ["train.steps=null"])


def test_tokens_not_a_multiple_of_the_batch_suggest_two_counts_that_differ_in_print() -> None:
    """15T on the 70B recipe (4,194,304 tokens a step): the short forms once read (1.5e+13 or 1.5e+13)."""
    import re

    from trainctl.errors import SpecError
    from trainctl.spec import load_spec

    with pytest.raises(SpecError) as err:
        load_spec(REPO / "recipes" / "llama3-70b.yaml", ["train.tokens=15T"])
    down, up = 3576278 * 4194304, 3576279 * 4194304
    assert f"use {down:,} or {up:,}" in str(err.value)
    short = re.search(r"\(([^ ]+) or ([^ )]+)\)", str(err.value))
    assert short and short[1] != short[2] and float(short[1]) == pytest.approx(down, rel=1e-7)


def _whole_run_at(path: str, step_time: Callable[[dict[str, Any], dict[str, Any]], float | None]
                  ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The spec's stages and its whole run through the plan's own model (saves, failures, restarts, requeues) with
    each stage's step replaced by step_time(stage, plan), where that gives one: a published rate in place of the
    predicted step."""
    from trainctl.plan.plan import build_plan, staged_gpus, staged_mean_step, whole_run_plan
    from trainctl.spec import load_spec

    spec = load_spec(path)
    plan = build_plan(spec).to_json()
    ck = plan["checkpoint"]
    stages = ck["whole_run"]["stages"]
    for s in stages:
        published = step_time(s, plan)
        if published is not None:
            s["step_time_s"], s["compute_s"] = published, published * s["steps"]
    run = whole_run_plan(spec, step_time=staged_mean_step(stages, spec), blocking_s=ck["blocking_s"],
                         save_s=ck["save_s"], mtbf_s=ck["whole_run"]["mtbf_s"], stages=stages)
    assert run is not None
    assert run["gpu_hours"] == pytest.approx(run["wall_days"]["mean"] * 24 * staged_gpus(stages, spec), rel=1e-9)
    return stages, run


def test_405b_recipe_priced_at_the_published_rate_needs_the_published_gpu_hours() -> None:
    """Meta's Llama 3.1 model card: 30.84M H100-80GB GPU-hours to train the 405B model (700 W TDP). Dubey et al.
    (2024), Table 4: 400 TFLOP/s per GPU at 8K (TP8 PP16 DP128) and 380 at 128K (CP16). Each of the recipe's
    stages (train.stages: the batch ramp on 8,192 GPUs, the main stage on 16,384, six long-context stages,
    annealing; 15.6T tokens) priced at that rate on its own GPUs (in place of the datasheet efficiency plan
    assumes; 400 for the ramp and 380 for every long-context length, rates the paper gives only for 8K and 128K)
    with the plan's own whole-run model (saves, failures, restarts) needs 32.5M GPU-hours at an ETTR of 90.4%,
    5% above the card: Meta reports an ETTR above 90%. The tolerance, 10%, is the target for published whole
    runs."""
    def published(stage: dict[str, Any], _plan: dict[str, Any]) -> float:
        rate = (380e12 if stage["seq_len"] > 8192 else 400e12) * stage["gpus"]
        return stage["model_flops_per_step"] / rate

    stages, run = _whole_run_at(LLAMA_405B_STAGED, published)
    assert {s["gpus"] for s in stages} == {8192, 16384}
    assert run["tokens"] == pytest.approx(15.6e12, rel=1e-6)
    assert run["gpu_hours"] == pytest.approx(30.84e6, rel=0.10)
    compute_gpu_hours = sum(s["compute_s"] * s["gpus"] for s in stages) / 3600
    assert compute_gpu_hours < 30.84e6 < run["gpu_hours"] * 1.10
    # energy: GPU-hours x the catalog's 700 W, the card's own figure
    assert run["energy_mwh"] == pytest.approx(run["gpu_hours"] * 700 / 1e6)


def test_bloom_recipe_priced_at_the_logged_rate_needs_the_published_gpu_hours() -> None:
    """BLOOM paper (sec. 3.5.1) and model card: 1,082,990 A100 GPU-hours. Its README logged 149.77 TFLOP/s per GPU
    at the full batch, counted with the recomputed forward (the plan's hardware FLOPs): 104.7 s a step on 384 GPUs.
    The main stage priced at that rate and the batch ramp as planned (the README gives the ramp's rate only at its
    first batch) with the plan's own whole-run model (synchronous saves every 100 steps, OPT-175B's 105 hardware
    restarts in 2 months on 992 A100 scaled to 384, 100-hour jobs requeued) needs 1.02M GPU-hours, 5.5% short of
    the paper's: what is left is downtime the fleet's rate does not hold (BLOOM's chronicles log hangs of hours
    found by hand). The tolerance, 10%, is the target for published whole runs."""
    def logged(stage: dict[str, Any], plan: dict[str, Any]) -> float | None:
        if stage["name"] != "main":
            return None
        # the main stage is the spec's own shape, whose hardware FLOPs the plan counts
        assert (stage["global_batch"], stage["micro_batch"]) == (2048, plan["layout"]["micro_batch"])
        return plan["flops"]["hardware_per_step"] / (149.77e12 * stage["gpus"])

    stages, run = _whole_run_at(BLOOM_STAGED, logged)
    assert [(s["name"], s["gpus"]) for s in stages] == [("ramp-mb1", 384), ("ramp-mb2", 384), ("main", 384)]
    assert stages[-1]["step_time_s"] == pytest.approx(104.7, abs=0.05)
    assert run["tokens"] == pytest.approx(366e9, rel=1e-3)
    assert run["gpu_hours"] == pytest.approx(1_082_990, rel=0.10)
    compute_gpu_hours = sum(s["compute_s"] * s["gpus"] for s in stages) / 3600
    assert compute_gpu_hours < run["gpu_hours"] < 1_082_990


def test_a_run_without_saves_far_beyond_the_mtbf_is_not_expected_to_finish() -> None:
    """575 days of work with no save against a 2-hour MTBF: exp(T/M) is past a float's range, so the expected
    wall clock is infinite (null in --json), not an OverflowError, and plan says why in one row."""
    import subprocess
    import sys

    never = _run(compute_s=575 * 24 * HOUR, interval_s=575 * 24 * HOUR, mtbf_s=2 * HOUR)
    assert never.expected_wall_s == math.inf and never.ettr == 0.0
    assert never.wall_percentiles_s() == (math.inf, math.inf, math.inf)
    args = [sys.executable, "-c", "from trainctl.cli.app import main; main()", "plan", str(REPO / "recipes" /
            "llama3-8b.yaml"), "--set", "checkpoint.every_steps=null", "--set", "checkpoint.mtbf_hours=2"]
    wide = {**os.environ, "COLUMNS": "300"}  # the row on one line
    text = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=120, env=wide).stdout
    assert "not expected to finish" in text and "checkpoint.every_steps" in text
    import json

    run = json.loads(subprocess.run([*args, "--json"], capture_output=True, text=True, cwd=REPO,
                                    timeout=120).stdout)["checkpoint"]["whole_run"]
    assert run["wall_days"]["mean"] is None and run["gpu_hours"] is None

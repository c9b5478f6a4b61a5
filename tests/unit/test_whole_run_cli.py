"""The whole-run block of `plan` and the node sweep as a user reads them, through the real CLI: time limits
priced as requeues, failure rates past finishing said in words (never 10^120 days), the interval rows and the
ETTR from one model, figures in units that show them, one parser for --deadline and --budget, and sweeps that
refuse what they cannot price."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
from cli_utils import trainctl
from paths import REPO

LLAMA_8B = str(REPO / "recipes" / "llama3-8b.yaml")
BLOOM = str(REPO / "recipes" / "gpt3-175b-a100.yaml")
WIDE = {"COLUMNS": "400"}  # each row of the plan on one line
DAY = 86400.0


def plan_json(*args: str) -> dict[str, Any]:
    out = trainctl("plan", *args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def whole(*args: str) -> dict[str, Any]:
    return plan_json(*args)["checkpoint"]["whole_run"]


def plan_rows(*args: str) -> dict[str, str]:
    out = trainctl("plan", *args, env=WIDE)
    assert out.returncode == 0, out.stderr
    rows = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.split("│") if c.strip()]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


def test_a_time_limit_is_a_requeue_priced_apart_from_failures() -> None:
    """llama3-8b on Slurm: 20 minutes against the recipe's 2 days. Each attempt trains for the limit less the
    grace (300 s), the start-up (300 s) and the checkpoint load; each stop adds the stop's save and a restart."""
    two_days = whole(LLAMA_8B)
    short = whole(LLAMA_8B, "--set", "cluster.time=00:20:00")
    load = short["restart_parts_s"]["checkpoint_load"]
    limit = short["time_limit"]
    assert limit["train_per_attempt_s"] == pytest.approx(1200 - 300 - 300 - load)
    ck = plan_json(LLAMA_8B)["checkpoint"]
    assert limit["cost_each_s"] == pytest.approx(ck["save_s"] + 120 + 300 + load)  # save write + requeue + start
    assert short["expected_interruptions"] == pytest.approx(two_days["expected_interruptions"])
    failure_wall = two_days["wall_days"]["mean"] * DAY - two_days["time_limit"]["total_s"]
    stops = math.ceil(failure_wall / limit["train_per_attempt_s"]) - 1
    assert limit["stops"] == stops and stops > 100 * two_days["time_limit"]["stops"]  # 20 min: ~300x the stops
    assert short["wall_days"]["mean"] * DAY == pytest.approx(failure_wall + stops * limit["cost_each_s"])
    assert short["wall_days"]["p50"] > 1.5 * two_days["wall_days"]["p50"]  # each 20-min attempt pays a restart
    assert two_days["time_limit"]["stops"] == math.ceil(failure_wall / (2 * DAY - 600 - load)) - 1
    row = plan_rows(LLAMA_8B, "--set", "cluster.time=00:20:00")["time limits"]
    assert row.startswith(f"~{stops:,} requeues at cluster.time 20m 00s") and "not failures" in row
    # no limit, or a local run: no time-limit stops; a limit that leaves no training is not expected to finish
    assert whole(LLAMA_8B, "--set", "cluster.time=null")["time_limit"] is None
    tiny = whole(str(REPO / "recipes" / "tiny-cpu.yaml"), "--set", "cluster.peak_tflops=1",
                 "--set", "cluster.time=00:01:00", "--set", "launcher.grace_s=6")
    assert tiny["time_limit"] is None and tiny["finishes"] is True
    tight = whole(LLAMA_8B, "--set", "cluster.time=00:10:00")
    assert tight["finishes"] is False and "raise cluster.time" in tight["not_finishing"]


@pytest.mark.parametrize("mtbf", ["0.01", "0.001"])
def test_a_failure_rate_past_finishing_prints_no_figures(mtbf: str) -> None:
    """At 36 s (or 3.6 s) between failures a 7-minute restart never completes: both say why, in words."""
    run = whole(LLAMA_8B, "--set", f"checkpoint.mtbf_hours={mtbf}")
    assert run["finishes"] is False and run["wall_days"]["mean"] is None and run["gpu_hours"] is None
    assert "no save interval makes it finish: raise checkpoint.mtbf_hours" in run["not_finishing"]
    rows = plan_rows(LLAMA_8B, "--set", f"checkpoint.mtbf_hours={mtbf}")
    assert "not expected to finish" in rows["whole run"] and "days" not in rows["whole run"]
    assert not re.search(r"e\+\d\d\d", json.dumps(run))  # no figure of 10^100 anywhere
    assert rows["interval"].endswith("over 99% expected lost: not expected to finish")


def test_the_interval_row_and_the_ettr_come_from_one_model() -> None:
    """MTBF 1 hour, saves every 1,000 steps (3h 51m): the first-order sum said 134.68% lost beside an ETTR of
    17.3%. Now the configured interval's loss is 1 - ETTR of the failure model (the run is whole intervals
    but its last, and the time-limit stops are priced apart)."""
    sets = ("--set", "checkpoint.mtbf_hours=1", "--set", "cluster.time=null")
    j = plan_json(LLAMA_8B, *sets)["checkpoint"]
    loss, ettr = j["cadence"]["loss_configured"], j["whole_run"]["ettr"]
    assert 0 < loss < 1 and loss == pytest.approx(1 - ettr, abs=0.005)
    rows = plan_rows(LLAMA_8B, *sets)
    assert f"{100 * loss:.2f}% expected lost" in rows["interval"] and f"ETTR {100 * ettr:.1f}%" in rows["interruptions"]


def test_a_big_run_without_saves_is_not_expected_to_finish() -> None:
    """The GPT-3 175B recipe (192 nodes, MTBF 32.8 h) with no checkpoint interval once printed 3.1 billion days."""
    run = whole(BLOOM, "--set", "checkpoint.every_steps=null")
    assert run["finishes"] is False and run["wall_days"]["p50"] is None
    assert "no saves scheduled" in run["not_finishing"] and "schedule checkpoints, every" in run["not_finishing"]


def test_short_runs_show_their_figures() -> None:
    """llama3-8b for 100 steps: under 2 days, under 1 MWh; `0.00 days`, `0 GPU-hours`, `0 MWh` said nothing."""
    run = whole(LLAMA_8B, "--set", "train.steps=100", "--set", "train.warmup=10")
    rows = plan_rows(LLAMA_8B, "--set", "train.steps=100", "--set", "train.warmup=10")
    wall = rows["wall clock"]
    assert "0.00" not in wall and " 0 GPU-hours" not in wall and " 0 MWh" not in wall
    hours = run["wall_days"]["p50"] * 24
    seconds = round(hours * 3600)  # as shown: whole seconds (26m 00s, not the 25m of 25.99999 minutes)
    assert f"P50 {int(hours)}h {round(hours % 1 * 60):02d}m" in wall or f"P50 {seconds // 60}m" in wall
    shown = re.search(r"([\d,.]+) GPU-hours, at most ([\d,.]+) kWh", wall)
    assert shown, wall
    gpu_hours, kwh = (float(x.replace(",", "")) for x in shown.groups())
    assert gpu_hours == pytest.approx(run["gpu_hours"], rel=5e-3)  # three significant figures
    assert kwh == pytest.approx(run["energy_mwh"] * 1e3, rel=5e-3)
    # an uncalibrated H100 plan prints the whole run again at the published record's range (plan/record.py)
    lo, hi = run["record_range"]["step_ratio"]
    assert rows["record range"].startswith(f"if the step is {lo:.2f}x-{hi:.2f}x the predicted one, as on ")
    shown = re.search(r"([\d,.]+) to ([\d,.]+) GPU-hours", rows["record range"])
    assert shown, rows["record range"]
    assert [float(x.replace(",", "")) for x in shown.groups()] == pytest.approx(run["record_range"]["gpu_hours"],
                                                                              rel=5e-3)


def test_durations_round_to_whole_seconds() -> None:
    from trainctl.units import dur

    assert (dur(599.7), dur(599.4), dur(3599.6), dur(7199.5)) == ("10m 00s", "9m 59s", "1h 00m", "2h 00m")


def test_deadline_and_budget_share_one_parser_and_echo() -> None:
    def sweep(*extra: str) -> Any:
        return trainctl("plan", "--auto", LLAMA_8B, "--nodes", "1..8", *extra)

    for budget in ("1e6gpuh", "5e+6gpuh", "1000000gpuh"):
        out = sweep("--budget", budget, "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["objective"] == "budget"
    assert "--budget 1 GPU-hours: no node count" in sweep("--budget", "1gpuh").stderr
    assert "within 1,000,000 GPU-hours" in " ".join(sweep("--budget", "1e6gpuh").stdout.split())
    for deadline in ("1e400d", "infd", "nand", "-3d"):
        out = sweep("--deadline", deadline)
        assert out.returncode == 2 and "positive, finite amount" in out.stderr, out.stderr
    out = sweep("--deadline", "1000d", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["objective"] == "deadline"  # not "time"


def test_a_sweep_of_a_cpu_spec_refuses_rather_than_invents() -> None:
    """The default recipe: a local backend (one node), and a CPU with no catalog peak (no seconds)."""
    out = trainctl("plan", "--auto", "--nodes", "1..4")
    assert out.returncode == 2 and "launcher.backend local runs on one node" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "0.0 days" not in out.stdout
    out = trainctl("plan", "--auto", "--nodes", "1..4", "--set", "launcher.backend=auto")
    assert out.returncode == 2 and "no step time in seconds for cpu" in out.stderr and "--calibration" in out.stderr


def test_a_sweep_where_no_count_finishes_says_so_and_the_fix() -> None:
    out = trainctl("plan", "--auto", LLAMA_8B, "--nodes", "1..8", "--set", "checkpoint.every_steps=null",
                   "--set", "checkpoint.mtbf_hours=2")
    assert out.returncode == 2 and "Answer" not in out.stdout and "inf" not in out.stderr
    assert "no node count is expected to finish the run" in out.stderr and "schedule checkpoints" in out.stderr


def test_the_docs_token_budget_example_is_valid_for_its_recipe() -> None:
    """docs/plan-and-calibrate.md's example once read `train.tokens: 15T`, which the 70B recipe refuses."""
    text = " ".join((REPO / "docs" / "plan-and-calibrate.md").read_text().split())
    [(tokens, steps)] = re.findall(r"--set train.tokens=(\d+)` runs its ([\d,]+) steps", text)
    out = trainctl("plan", str(REPO / "recipes" / "llama3-70b.yaml"), "--set", f"train.tokens={tokens}", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["checkpoint"]["whole_run"]["steps"] == int(steps.replace(",", ""))
    assert trainctl("validate", str(REPO / "recipes" / "llama3-70b.yaml"), "--set", "train.tokens=15T").returncode == 2


def test_planned_maintenance_stretches_the_calendar_and_is_printed_as_an_assumption() -> None:
    """8 hours a week down: the run's calendar time and the GPU-hours held grow by 168 / 160, failures unchanged;
    without the field the plan says it assumes none."""
    base = whole(LLAMA_8B)
    held = whole(LLAMA_8B, "--set", "cluster.maintenance_hours_per_week=8")
    assert held["wall_days"]["mean"] == pytest.approx(base["wall_days"]["mean"] * 168 / 160, rel=1e-9)
    assert held["gpu_hours"] == pytest.approx(base["gpu_hours"] * 168 / 160, rel=1e-9)
    assert held["expected_interruptions"] == pytest.approx(base["expected_interruptions"])
    assert held["maintenance"]["total_s"] == pytest.approx(held["wall_days"]["mean"] * DAY * 8 / 168)
    assert "none assumed" in plan_rows(LLAMA_8B)["maintenance"]
    assert "8 h a week" in plan_rows(LLAMA_8B, "--set", "cluster.maintenance_hours_per_week=8")["maintenance"]
    bad = trainctl("plan", LLAMA_8B, "--set", "cluster.maintenance_hours_per_week=168")
    assert bad.returncode == 2 and "maintenance_hours_per_week" in bad.stderr and "Traceback" not in bad.stderr


def test_the_failure_rate_comes_from_a_cited_fleet_and_scales_with_the_gpus() -> None:
    """An A100 run takes OPT-175B's published rate (105 restarts in 60 days on 992 A100: 35 manual and an
    estimated 70+ automatic), per GPU, so its MTBF is 13,605 GPU-hours / 1,536 GPUs; Llama 3's fleet can be chosen
    instead, and the source is printed."""
    run = whole(BLOOM)
    assert run["mtbf_s"] == pytest.approx(60 * 24 * 3600 * 992 / 105 / 1536)
    assert "opt175b-a100" in run["mtbf_source"] and "Zhang et al. 2022" in run["mtbf_source"]
    llama = whole(BLOOM, "--set", "checkpoint.failure_fleet=llama3-h100")
    assert llama["mtbf_s"] == pytest.approx(54 * 24 * 3600 * 16384 / 419 / 1536)
    assert "llama3-h100" in plan_rows(LLAMA_8B)["Young/Daly interval"]
    bad = trainctl("plan", BLOOM, "--set", "checkpoint.failure_fleet=meta")
    assert bad.returncode == 2 and "failure_fleet" in bad.stderr and "Traceback" not in bad.stderr

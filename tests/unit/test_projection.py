"""report/projection.py: the rest of a run projected from its measured rates, and the gap to the plan's whole
run split into its causes, checked against figures worked out by hand."""

from __future__ import annotations

import time

import pytest

from trainctl.report.projection import Measured, Planned, gap, lines, project

# 100 of 400 steps done at 2 s a step; 10 s of save stalls (0.1 s a step); 2 failures in 200 s of compute,
# 60 s lost to them (30 s each); 300 s of wall clock so far (30 s of it start-up and the like); 8 GPUs
RUN = Measured(steps_done=100, steps_total=400, step_s=2.0, elapsed_s=300.0, productive_s=200.0, save_stall_s=10.0,
               failures=2, failure_cost_s=60.0, gpus=8)
# planned: 1 s a step, 20 s of save blocking in all (0.05 s a step), 2 interruptions expected at 20 s each
PLAN = {"steps": 400, "compute_s": 400.0, "save_blocking_s": 20.0, "last_write_s": 0.0,
        "expected_interruptions": 2.0, "wall_days": {"mean": 460.0 / 86400}, "restart_s": 15.0}


def test_remaining_is_the_steps_left_at_the_measured_rates() -> None:
    # 300 steps left: 600 s compute + 30 s saves + 0.01 failures/s x 600 s x 30 s = 180 s of failures
    assert RUN.remaining_s == pytest.approx(810.0)
    assert RUN.total_s == pytest.approx(1110.0)
    assert RUN.projected_failures == pytest.approx(8.0)  # 2 so far + 6 more
    now = time.time()  # a run that trains: its last step just ended
    p = project(RUN, plan_whole_run=None, finished=False, last_time=now, tokens_per_step=None,
                tokens_given=False, basis="measured over attempts 0-2")
    assert p["total_is"] == "projected" and p["eta_time"] == pytest.approx(now + 810.0)
    assert p["gpu_hours"] == pytest.approx(1110.0 * 8 / 3600)
    assert p["total_days"] == pytest.approx(1110.0 / 86400)
    assert p["vs_plan"] is None and "no whole-run projection" in p["vs_plan_note"]


def test_the_plan_side_prices_the_same_steps() -> None:
    plan = Planned.from_whole_run(PLAN)
    assert (plan.step_s, plan.save_per_step_s, plan.cost_per_failure_s) == pytest.approx((1.0, 0.05, 20.0))
    assert plan.total_s(400) == pytest.approx(460.0)  # the plan's own expected wall clock


def test_the_gap_splits_into_its_causes() -> None:
    g = gap(RUN, Planned.from_whole_run(PLAN))
    assert g["gap_s"] == pytest.approx(650.0)  # 1110 projected - 460 planned
    c = g["causes_s"]
    assert c["steps"] == pytest.approx(400.0)  # 400 steps x 1 s slower
    assert c["saves"] == pytest.approx(20.0)  # 400 x (0.1 - 0.05)
    assert c["restarts"] == pytest.approx(120.0)  # (8 - 2) more failures x 20 s planned each
    assert c["restart_length"] == pytest.approx(80.0)  # 8 failures x (30 - 20) s
    assert c["other"] == pytest.approx(30.0)  # the start-up in the elapsed time
    assert g["largest"] == "slower steps"


def test_ahead_of_plan_names_what_saved_most_and_no_failures_project_none() -> None:
    fast = Measured(steps_done=100, steps_total=400, step_s=1.0, elapsed_s=100.0, productive_s=100.0,
                    save_stall_s=0.0, failures=0, failure_cost_s=0.0, gpus=8)
    g = gap(fast, Planned.from_whole_run(PLAN))
    # 400 s projected vs 460 planned: no saves (-20 s), no failures (-40 s at the plan's 20 s each)
    assert g["gap_s"] == pytest.approx(-60.0)
    assert g["causes_s"]["restarts"] == pytest.approx(-40.0) and g["causes_s"]["restart_length"] == 0.0
    assert g["largest"] == "more restarts"  # the largest saving: the failures the plan expected did not come
    text = lines(project(fast, plan_whole_run=PLAN, finished=False, last_time=None, tokens_per_step=None,
                         tokens_given=False, basis="measured over attempt 0"))
    assert "no failures so far, none projected" in text[0]
    assert "projected 60.00 s ahead of the plan's" in text[2] and "more restarts" in text[2]


def test_a_finished_run_is_measured_and_counts_tokens() -> None:
    done = Measured(steps_done=400, steps_total=400, step_s=2.0, elapsed_s=900.0, productive_s=800.0,
                    save_stall_s=40.0, failures=0, failure_cost_s=0.0, gpus=8)
    p = project(done, plan_whole_run=None, finished=True, last_time=5.0, tokens_per_step=1024,
                tokens_given=True, basis="measured over attempt 0")
    assert p["total_is"] == "measured" and p["remaining_s"] == 0.0 and p["total_s"] == 900.0
    assert p["tokens"] == {"done": 409600, "total": 409600, "given": True}
    assert lines(p)[0].startswith("tokens 409.60 k/409.60 k")
    assert "ETA" not in lines(p)[1]


def test_a_run_not_running_has_no_eta_but_what_is_left() -> None:
    """A stopped (or cancelled, failed, requeued) run: its last step plus what is left is a time that will not
    come, so the ETA gives way to what is left to run."""
    p = project(RUN, plan_whole_run=None, finished=False, last_time=1000.0, tokens_per_step=None,
                tokens_given=False, basis="measured over attempts 0-2", running=False)
    assert p["eta_time"] is None and p["remaining_s"] == pytest.approx(810.0) and p["total_is"] == "projected"
    text = lines(p)[1]
    assert ", ETA" not in text, text
    assert text.endswith("; no ETA while it does not train: 13m 30s of it left to run once resumed"), text
    running = lines(project(RUN, plan_whole_run=None, finished=False, last_time=1000.0, tokens_per_step=None,
                            tokens_given=False, basis="measured over attempts 0-2"))[1]
    assert "ETA" in running and "(in 13m 30s)" in running, running


def test_a_short_run_whose_gap_is_start_up_names_it_not_a_priced_term() -> None:
    """10 steps at 0.4 s against the plan's 0.532 s, but 6.1 s of start-up and 1.4 s of shutdown the plan's whole
    run does not price: 6.18 s behind, and the cause named is that time, not a priced term at +0 s (it named
    "longer restarts (+0 s)" for a run with no failure)."""
    short = Measured(steps_done=10, steps_total=10, step_s=0.4, elapsed_s=11.5, productive_s=4.0, save_stall_s=0.0,
                     failures=0, failure_cost_s=0.0, gpus=2)
    plan = {"steps": 10, "compute_s": 5.32, "save_blocking_s": 0.0, "last_write_s": 0.0,
            "expected_interruptions": 0.0, "wall_days": {"mean": 5.32 / 86400}, "restart_s": 423.0}
    g = gap(short, Planned.from_whole_run(plan))
    assert g["gap_s"] == pytest.approx(11.5 - 5.32)
    assert g["causes_s"]["steps"] == pytest.approx(-1.32)  # faster steps: a saving, not the cause
    assert g["causes_s"]["other"] == pytest.approx(11.5 - 5.32 + 1.32)
    assert g["largest_cause"] == "other"
    text = lines(project(short, plan_whole_run=plan, finished=True, last_time=None, tokens_per_step=None,
                         tokens_given=False, basis="measured over attempt 0"))
    assert ("measured 6.18 s behind the plan's 5.32 s; largest cause: start-up, queueing and shutdown (+7.50 s: "
            "time the plan's whole run does not price)") in text[2], text


def test_a_run_that_waited_is_done_from_now_not_from_its_last_step() -> None:
    """A resumed job that waited in Slurm's queue trains again: its last step was an hour ago, so the rest ends
    `remaining` from now, not an hour ago plus `remaining`, a time already past."""
    before = time.time()
    p = project(RUN, plan_whole_run=None, finished=False, last_time=before - 3600.0, tokens_per_step=None,
                tokens_given=False, basis="measured over attempts 0-2")
    assert before + 810.0 <= p["eta_time"] <= time.time() + 810.0


def test_the_plan_side_keeps_time_limit_requeues_apart_from_failures() -> None:
    """The same plan with 2 requeues at the time limit of 50 s each (100 s more wall clock): failures still cost
    20 s each, and the plan's total is its own 560 s."""
    limited = {**PLAN, "wall_days": {"mean": 560.0 / 86400}, "time_limit": {"stops": 2, "total_s": 100.0}}
    plan = Planned.from_whole_run(limited)
    assert plan.cost_per_failure_s == pytest.approx(20.0) and plan.total_s(400) == pytest.approx(560.0)


def test_a_plan_that_expects_no_finish_has_no_gap_and_says_why() -> None:
    """Infinite failures x a zero cost once crashed status (NaN to int); a plan.json written before `finishes`
    held an infinite mean instead."""
    never = {**PLAN, "finishes": False, "not_finishing": "its expected wall clock is over 100x its compute",
             "expected_interruptions": None, "wall_days": {"mean": None}}
    old = {**PLAN, "expected_interruptions": float("inf"), "wall_days": {"mean": float("inf")}}
    for whole, why in ((never, "over 100x its compute"), (old, "infinite")):
        p = project(RUN, plan_whole_run=whole, finished=False, last_time=None, tokens_per_step=None,
                    tokens_given=False, basis="measured over attempt 0")
        assert p["vs_plan"] is None and p["vs_plan_note"].startswith("the plan expects the run not to finish")
        assert why in p["vs_plan_note"] and any("not to finish" in line for line in lines(p))

"""mfu-report's arithmetic on hand-made run directories (fast; the real runs are in test_report_runs.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from trainctl.report import analyze, build_report, load_run
from trainctl.report.render import render


def _step(step: int, t_end: float, dt: float = 1.0, **extra: Any) -> dict[str, Any]:
    return {"step": step, "steps": 10, "loss": 5.0 - 0.1 * step, "step_time_s": dt, "time": t_end, "tokens": 1024,
            "tokens_per_s": 1024 / dt, "tokens_per_s_per_gpu": 512 / dt, "tflops_per_gpu": 0.5, "mfu": 0.4,
            "hfu": 0.5, "world_size": 2, "peak_tflops_per_gpu": 1.25, "peak_source": "spec cluster.peak_tflops",
            **extra}


def _write(run: Path, metrics: list[dict[str, Any]], events: list[dict[str, Any]], plan: dict | None = None) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "spec.yaml").write_text(f"name: {run.name}\ntrain: {{log_every: 1}}\n")
    if plan is not None:
        (run / "plan.json").write_text(json.dumps(plan))
    return run


def interrupted_run(root: Path) -> Path:
    """Attempt 0: launch t=0, steps 1-6 (1 s each; a 0.2 s blocking checkpoint after step 4, logged, as the
    trainer logs it, with the next step), rank 1 fails at t=11.5. Attempt 1 (resume from step 4): launch t=13,
    steps 5-10, finish; launcher exits at t=22.5."""
    m = [_step(k, 5 + k) for k in range(1, 5)]
    m += [_step(5, 10.2, ckpt_block_s=0.2), _step(6, 11.2)]
    m += [_step(k, 12 + k) for k in range(5, 11)]
    ev = [{"time": 0.0, "event": "launch"}, {"time": 4.5, "event": "start"},
          {"time": 9.1, "event": "checkpoint_committed", "step": 4},
          {"time": 11.5, "event": "failure", "rank": 1, "error": "InjectedFailure: boom"},
          {"time": 11.6, "event": "launcher_exit", "exit_code": 1},
          {"time": 13.0, "event": "launch", "resume": True}, {"time": 15.5, "event": "start"},
          {"time": 15.6, "event": "checkpoint_loaded", "step": 4},
          {"time": 22.1, "event": "finish", "steps": 10}, {"time": 22.5, "event": "launcher_exit", "exit_code": 0}]
    return _write(root / "interrupted", m, ev)


def test_a_rank_that_only_lost_its_peer_is_not_said_to_have_failed(tmp_path):
    """The survivor's "connection reset by peer" was recorded first (the victim, SIGKILLed, recorded nothing, or
    recorded later): the restart's cause says it lost a peer, after the rank that failed of itself."""
    run = interrupted_run(tmp_path)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    lost = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
            "[127.0.0.1]:20893: Connection reset by peer")
    events.insert(3, {"time": 11.4, "event": "failure", "rank": 0, "error": lost})
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (restart,) = analyze(load_run(run))["goodput"]["restarts"]
    assert restart["cause"] == f"rank 1 failed: InjectedFailure: boom; rank 0 lost a peer: {lost}"
    alone = [e for e in events if e.get("error") != "InjectedFailure: boom"]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in alone))
    (restart,) = analyze(load_run(run))["goodput"]["restarts"]
    assert restart["cause"] == f"rank 0 lost a peer: {lost}"


def test_a_ctrl_c_before_the_trainer_started_is_a_stop_not_a_failure(tmp_path):
    """The user pressed Ctrl-C while the ranks were still starting (the launcher's stop_requested came before the
    trainer's start), then resumed: the restart is the user's stop, not a failure, and the projection counts no
    failure (status once said "1 failure")."""
    ev = [{"time": 0.0, "event": "launch"}, {"time": 1.0, "event": "stop_requested", "signal": "SIGINT"},
          {"time": 2.0, "event": "start"},
          {"time": 2.1, "event": "checkpoint_on_signal", "step": 0, "before_first_step": True},
          {"time": 3.0, "event": "launcher_exit", "exit_code": 0, "state": "STOPPED",
           "reason": "stopped (Ctrl-C); before the first step, nothing to save", "signal": "SIGINT"},
          {"time": 10.0, "event": "resume"}, {"time": 12.0, "event": "start"},
          {"time": 22.1, "event": "finish", "steps": 10}, {"time": 22.5, "event": "launcher_exit", "exit_code": 0}]
    run = _write(tmp_path / "stopped", [_step(k, 12 + k) for k in range(1, 11)], ev)
    g = analyze(load_run(run))["goodput"]
    (restart,) = g["restarts"]
    assert restart["failure"] is False and restart["cause"].startswith("stopped (Ctrl-C)"), restart


def test_a_job_cancelled_while_starting_then_resumed_waited_for_its_user(tmp_path):
    """A Slurm job cancelled before its trainer started, resumed 19 s later: those 19 s are the user's idle wait,
    not start-up lost (mfu-report once put them in "lost: start-up")."""
    ev = [{"time": 0.0, "event": "submit"}, {"time": 0.5, "event": "slurm_start"},
          {"time": 30.0, "event": "cancel_requested", "state": "STARTING"}, {"time": 31.0, "event": "signal"},
          {"time": 50.0, "event": "resume_requested"}, {"time": 50.1, "event": "submit"},
          {"time": 51.0, "event": "slurm_start"}, {"time": 60.0, "event": "start"},
          {"time": 71.1, "event": "finish", "steps": 10}]
    run = _write(tmp_path / "cancelled", [_step(k, 60 + k) for k in range(1, 11)], ev)
    g = analyze(load_run(run))["goodput"]
    assert g["idle_s"] == pytest.approx(50.0 - 31.0)
    queued = 0.5 + (51.0 - 50.1)
    assert g["lost_s"]["startup"] == pytest.approx(60.0 - queued - 19.0)  # the first step began at t = 60


def test_goodput_attributes_the_lost_time(tmp_path):
    r = analyze(load_run(interrupted_run(tmp_path)))
    g = r["goodput"]
    assert g["wall_s"] == pytest.approx(22.5)
    assert g["productive_s"] == pytest.approx(10.0)  # every step once
    assert g["goodput"] == pytest.approx(10 / 22.5)
    lost = g["lost_s"]
    assert lost["startup"] == pytest.approx(5.0)  # launch -> step 1 began
    assert lost["replayed_steps"] == pytest.approx(2.0)  # steps 5 and 6 of attempt 0 were run again
    assert lost["restarts"] == pytest.approx(16.0 - 11.2)  # last step of attempt 0 -> first of attempt 1
    assert lost["checkpoint_stalls"] == pytest.approx(0.2)
    assert lost["shutdown"] == pytest.approx(0.5)
    assert lost["queueing"] is None  # not known for a local launch
    assert lost["other"] == pytest.approx(0.0, abs=1e-9)
    assert g["attempts"] == 2 and g["final_outcome"] == "finished"
    (restart,) = g["restarts"]
    assert restart["cause"] == "rank 1 failed: InjectedFailure: boom"
    assert restart["resumed_at_step"] == 4 and restart["replayed_steps"] == 2
    s = r["summary"]
    assert s["steps_completed"] == 10
    assert s["step_time_s"]["median"] == pytest.approx(1.0)
    assert s["peak"]["source"] == "spec cluster.peak_tflops"
    assert [p["attempt"] for p in r["series"]] == [0] * 6 + [1] * 6


def test_attempts_without_timestamps_split_on_step_decrease(tmp_path):
    """Older metrics lines have no "time": a step number that does not increase starts the next attempt."""
    run = interrupted_run(tmp_path)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in m.items() if k != "time"}) + "\n"
                                               for m in lines))
    g = analyze(load_run(run))["goodput"]
    assert g["attempts"] == 2 and g["productive_s"] == pytest.approx(10.0)
    assert g["lost_s"]["replayed_steps"] == pytest.approx(2.0)


def test_hang_is_a_restart_cause(tmp_path):
    m = [_step(1, 2.0), _step(2, 3.0), _step(1, 20.0), _step(2, 21.0)]
    ev = [{"time": 0.0, "event": "launch"}, {"time": 0.5, "event": "start"},
          {"time": 9.0, "event": "hang", "rank": 1, "step": 2, "idle_s": 6.0},
          {"time": 18.5, "event": "start"}, {"time": 21.1, "event": "finish"}]
    g = analyze(load_run(_write(tmp_path / "hung", m, ev)))["goodput"]
    assert g["restarts"][0]["cause"] == "rank 1 hung after step 2 (watchdog: no progress for 6 s)"
    assert g["lost_s"]["replayed_steps"] == pytest.approx(2.0)


def test_straggler_named_with_host_and_cost(tmp_path):
    """Rank 2 is 50 ms slower every step; the first step of the attempt is warm-up and not sampled."""
    run = _write(tmp_path / "strag", [_step(k, float(k)) for k in range(1, 9)], [{"time": 0.0, "event": "launch"}])
    logs = run / "logs"
    logs.mkdir()
    for rank in range(4):
        lines = [{"header": True, "rank": rank, "host": f"node{rank // 2}", "local_rank": rank % 2,
                  "device": f"cuda:{rank % 2}"}]
        for step in range(1, 9):
            busy = 0.100 + 0.001 * rank + (0.050 if rank == 2 else 0.0)
            lines.append({"step": step, "time": step, "step_s": 0.16, "sync_s": 0.16 - busy})
        (logs / f"steptimes-rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    st = analyze(load_run(run))["stragglers"]
    assert st["available"] and st["ranks"] == 4 and st["steps_sampled"] == 7
    (x,) = st["stragglers"]
    assert x["rank"] == 2 and x["where"] == "rank 2 on node1 GPU 0"
    assert x["cost_s"] == pytest.approx(7 * (0.152 - 0.103))  # vs the next-slowest rank, every step
    assert x["fraction_above"] == 1.0


def test_mfu_above_100_percent_is_a_bug_not_a_result(tmp_path):
    m = [_step(k, float(k), mfu=1.3, mfu_bug=True) for k in range(1, 5)]
    report = build_report([_write(tmp_path / "bug", m, [{"time": 0.0, "event": "launch"}])])
    s = report["runs"][0]["summary"]
    assert s["mfu"] is None and s["hfu"] is None and s["mfu_bug"]["max_mfu"] == 1.3
    buf = io.StringIO()
    render(report, Console(file=buf, width=160))
    out = buf.getvalue()
    assert "BUG (>100%)" in out and "130" not in out


def test_runs_of_one_spec_are_told_apart_on_every_line(tmp_path):
    """Two launches of one recipe share its name: the table's column, each per-run line and the warnings say
    which run by its directory's name beside the spec's, or by the whole path where those collide too."""
    def run(where: Path) -> Path:
        path = _write(where, [_step(k, float(k)) for k in range(1, 6)], [{"time": 0.0, "event": "launch"}])
        (path / "spec.yaml").write_text("name: same\ntrain: {log_every: 1}\n")
        return path

    a, b = run(tmp_path / "a"), run(tmp_path / "b")
    report = build_report([a, b])
    assert [r["label"] for r in report["runs"]] == ["same (a)", "same (b)"]
    assert [r["name"] for r in report["runs"]] == ["same", "same"]  # the spec's name, as --json had it
    buf = io.StringIO()
    render(report, Console(file=buf, width=200))
    out = buf.getvalue()
    assert "same (a): stats over" in out and "same (b): stats over" in out, out
    twins = [run(tmp_path / "x" / "run"), run(tmp_path / "y" / "run")]
    assert [r["label"] for r in build_report(twins)["runs"]] == [str(t) for t in twins]
    assert build_report([a])["runs"][0]["label"] == "same"


def test_plan_prediction_side_by_side_and_cpu_note(tmp_path):
    plan = {"prediction": {"mfu": 0.5, "hfu": 0.6, "step_time_s": 0.8, "tokens_per_s": 1280.0},
            "hardware": {"peak_flops": 1.25e12}, "layout": {"pp": 2}, "pipeline": {"bubble_fraction": 0.2},
            "communication": {"per_kind": {}}}
    gpu = _write(tmp_path / "gpu", [_step(k, float(k)) for k in range(1, 6)], [{"time": 0.0, "event": "launch"}], plan)
    cpu_plan = {**plan, "prediction": {"mfu": None, "step_time_s": None}}
    cpu = _write(tmp_path / "cpu", [_step(k, float(k)) for k in range(1, 6)], [{"time": 0.0, "event": "launch"}],
                 cpu_plan)
    report = build_report([gpu, cpu])
    p = report["runs"][0]["summary"]["plan"]
    assert p["available"] and p["mfu_gap_points"] == pytest.approx(-10.0)
    assert p["measured_over_predicted_step"] == pytest.approx(1.25)
    items = {i["name"]: i for i in report["runs"][0]["time_breakdown"]["items"]}
    bubble = items["pipeline bubble (predicted)"]  # the plan's fraction of the plan's step, never subtracted
    assert bubble["kind"] == "predicted" and bubble["seconds"] == pytest.approx(0.2 * 0.8)
    assert all(i["kind"] == "measured" for n, i in items.items() if "(predicted)" not in n)
    assert all(i["seconds"] is None or i["seconds"] >= 0 for i in items.values())
    assert "no prediction" in report["runs"][1]["summary"]["plan"]["note"]
    buf = io.StringIO()
    render(report, Console(file=buf, width=200))
    out = buf.getvalue()
    assert "50.00% (gap -10.00 pts)" in out and "no prediction (CPU peak is measured)" in out
    assert " gpu " in out and " cpu " in out  # one column per run


def test_not_a_run_dir_is_a_usage_error(tmp_path):
    from trainctl.errors import UsageError

    with pytest.raises(UsageError, match="no such run directory"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no metrics.jsonl"):
        load_run(tmp_path / "empty")


def test_report_prose_fits_a_narrow_terminal(tmp_path):
    """Notes, warnings, restart causes and memory gaps wrap to the console's width (tables fit by themselves)."""
    run = interrupted_run(tmp_path)
    m = [_step(k, float(k), mfu=1.3, mfu_bug=True) for k in range(1, 5)]  # a long warning line as well
    bug = _write(tmp_path / "bug", m, [{"time": 0.0, "event": "launch"}])
    buf = io.StringIO()
    render(build_report([run, bug]), Console(file=buf, width=80, soft_wrap=True))  # cli/console.py's settings
    lines = buf.getvalue().splitlines()
    assert max(map(len, lines)) <= 80, [ln for ln in lines if len(ln) > 80][:3]
    words = " ".join(" ".join(lines).split())
    assert "restart -> attempt 1" in words and "a FLOPs-accounting or timing bug" in words


def _moe(imbalance: float, a2a_s: float, aux: float, dropped: int = 0) -> dict[str, Any]:
    return {"aux_loss": aux, "z_loss": 2.0, "imbalance": imbalance, "dropped": dropped, "a2a_s": a2a_s,
            "tokens_per_expert": {"min": 40.0, "max": 40.0 * imbalance, "mean": 64.0}}


def test_routing_imbalance_and_all_to_all_share(tmp_path):
    """Steps 2-5 are steady (step 1 is warm-up): imbalance median of 1.3, 1.2, 1.25, 1.15 = 1.225, above the
    1.1 the run's plan priced; the all-to-all takes 0.1 s of each 0.5 s step (20%); drops summed over every step."""
    imb = [1.8, 1.3, 1.2, 1.25, 1.15]
    m = [_step(k, float(k), dt=0.5, moe=_moe(imb[k - 1], 0.1, 1.1 - 0.02 * k, dropped=k)) for k in range(1, 6)]
    plan = {"moe": {"load_imbalance_allowance": 1.1}}
    report = build_report([_write(tmp_path / "moe", m, [{"time": 0.0, "event": "launch"}], plan),
                           _write(tmp_path / "dense", [_step(k, float(k)) for k in range(1, 6)],
                                  [{"time": 0.0, "event": "launch"}])])
    moe, dense = report["runs"]
    r = moe["routing"]
    assert r["imbalance"]["median"] == pytest.approx(1.225) and r["imbalance"]["max"] == pytest.approx(1.3)
    assert r["imbalance"]["first"] == 1.8 and r["imbalance"]["last"] == 1.15
    assert r["a2a_share"] == pytest.approx(0.2) and r["dropped"] == 15
    assert r["aux_loss"]["first"] == pytest.approx(1.08) and r["aux_loss"]["last"] == pytest.approx(1.0)
    (warned,) = [w for w in moe["warnings"] if "routing imbalance 1.23" in w]
    assert "`--set estimate.moe_imbalance=1.23` plans with what this run measured" in warned, warned
    a2a = next(i for i in moe["time_breakdown"]["items"] if i["name"] == "EP all-to-all (measured)")
    assert a2a["fraction"] == pytest.approx(0.2)
    assert not dense["routing"]["available"] and not any("routing" in w for w in dense["warnings"])
    buf = io.StringIO()
    render(report, Console(file=buf, width=200))
    out = buf.getvalue()
    assert "Mixture-of-experts routing" in out and "1.23 / 1.30 (planned 1.10)" in out and "(20.0%)" in out


def test_step_time_predicted_vs_measured_per_component(tmp_path):
    """Two ranks, 6 steps; step 1 is warm-up. Rank 0: step 1.0 s, DP sync 0.1, collectives+pipeline 0.3 of
    which pipeline 0.2; rank 1: 1.0, 0.2, 0.1, 0.0. Data wait 0.05 (rank 0's metrics). Means over ranks:
    sync 0.15, comm 0.2, pp 0.1, so collectives 0.1 and compute 1.0 - 0.15 - 0.2 - 0.05 = 0.6.
    The plan: compute 0.5, TP 0.05 + CP 0.05, bubble 0.1 + p2p 0.02, DP 0.08 = step 0.8; of its compute, 0.05
    of a profile's ends and a 0.02 optimizer step outside the layers."""
    m = [_step(k, float(k), data_wait_s=0.05, **({"ckpt_block_s": 0.3} if k == 4 else {})) for k in range(1, 7)]
    breakdown = {"compute": 0.5, "TP exposed": 0.05, "CP K/V exchange": 0.05, "pipeline bubble": 0.1,
                 "PP point-to-point": 0.02, "DP exposed": 0.08}
    outside = {"per_micro_batch_s": 0.0125, "micro_batches": 4, "micro_batches_s": 0.05, "optimizer_step_s": 0.02,
               "total_s": 0.07}
    plan = {"prediction": {"mfu": 0.5, "hfu": 0.6, "step_time_s": 0.8, "breakdown_s": breakdown,
                           "outside_layers": outside},
            "hardware": {"gpu": "h100-sxm", "peak_flops": 1.25e12}, "layout": {"pp": 2}}
    run = _write(tmp_path / "vs", m, [{"time": 0.0, "event": "launch"}], plan=plan)
    (run / "logs").mkdir()
    per_rank = {0: (0.1, 0.3, 0.2), 1: (0.2, 0.1, 0.0)}
    for rank, (sync, comm, pp) in per_rank.items():
        lines = [{"header": True, "rank": rank, "host": "n", "local_rank": rank, "device": f"cuda:{rank}"}]
        lines += [{"step": s, "time": s, "step_s": 9.0 if s == 1 else 1.0, "sync_s": sync, "comm_s": comm,
                   "pp_s": pp} for s in range(1, 7)]
        (run / "logs" / f"steptimes-rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = analyze(load_run(run))
    v = r["step_vs_plan"]
    got = {x["component"]: (x["predicted_s"], x["measured_s"]) for x in v["rows"]}
    assert got["compute"] == pytest.approx((0.5, 0.6))
    assert got["collectives (TP, CP, EP)"] == pytest.approx((0.1, 0.1))
    assert got["pipeline bubble + point-to-point"] == pytest.approx((0.12, 0.1))
    assert got["DP gradient sync (exposed)"] == pytest.approx((0.08, 0.15))
    assert got["data-loader wait"] == pytest.approx((0.0, 0.05))
    assert sum(p for p, _ in got.values()) == pytest.approx(0.8)  # the plan's parts make its step
    assert sum(m for _, m in got.values()) == pytest.approx(1.0)  # and the measured ones the measured step
    assert r["prediction"]["step_time_s"] == 0.8 and r["measured"]["step_time_s"] == pytest.approx(1.0)
    assert v["step_error"] == pytest.approx(0.25) and v["checkpoint_block_s_per_save"] == pytest.approx(0.3)
    # compute is the largest gap: +100 ms of the step's +200 ms
    assert v["largest_gap"].startswith("compute took 100 ms longer than predicted (+20%); 50% of the step's gap")
    buf = io.StringIO()
    render(build_report([run]), Console(file=buf, width=200))
    out = buf.getvalue()
    assert "Step time, predicted vs measured" in out and "+25.0%" in out and "largest gap: compute" in out
    # which measured parts are timed and which derived; the work outside the layers the plan priced in compute
    assert "derived: step - sync - comm - data" in out and "measured: pipeline receives (pp)" in out
    assert "of it outside the layers (ends + optimizer step)" in out and "70.0 ms" in out
    assert "kernels ran at a different FLOP/s" in v["largest_gap"]
    # a plan that found the layers host-bound (on a GPU: DISPATCH_BOUND) names the host, not the kernels' rate
    plan["prediction"]["dispatch_s"] = 0.2
    (run / "plan.json").write_text(json.dumps(plan))
    v = analyze(load_run(run))["step_vs_plan"]
    assert v["largest_gap"].startswith("compute took 100 ms longer than predicted")
    assert "host-bound (200 ms of its step is the GPU waiting for the host" in v["largest_gap"]
    assert "FLOP/s" not in v["largest_gap"]
    # the pipeline's drain (30 ms of the plan's 100 ms bubble) is waited out in the later stages' sync: it moves
    # from the pipeline's row to the sync's, and the plan's parts still make its step
    plan["prediction"]["pipeline_drain_s"] = 0.03
    (run / "plan.json").write_text(json.dumps(plan))
    got = {x["component"]: x["predicted_s"] for x in analyze(load_run(run))["step_vs_plan"]["rows"]}
    assert got["pipeline bubble + point-to-point"] == pytest.approx(0.09)
    assert got["DP gradient sync (exposed)"] == pytest.approx(0.11) and sum(got.values()) == pytest.approx(0.8)
    # a run whose plan has no step time (a CPU without a calibration profile) still shows what was measured
    plan["prediction"] = {"mfu": None, "step_time_s": None}
    (run / "plan.json").write_text(json.dumps(plan))
    v = analyze(load_run(run))["step_vs_plan"]
    assert v["prediction"] is None and "no step-time prediction" in v["no_prediction"]
    assert v["measured"]["components_s"]["compute"] == pytest.approx(0.6) and v["largest_gap"] is None


def test_timeline_puts_every_lost_second_where_goodput_counts_it(tmp_path):
    """The wall-clock timeline (mfu-report --json "timeline", drawn by --plot) adds up to goodput's table, each
    span where it happened: start-up before step 1, steps 5-6 of attempt 0 replayed, the blocking save between
    steps 4 and 5 (logged with step 5, as the trainer logs it), the restart gap, the shutdown; no overlaps."""
    r = analyze(load_run(interrupted_run(tmp_path)))
    tl, lost = r["timeline"], r["goodput"]["lost_s"]
    by_kind = tl["seconds_by_kind"]
    assert by_kind["productive"] == pytest.approx(r["goodput"]["productive_s"])
    for kind, cause in (("replayed", "replayed_steps"), ("checkpoint", "checkpoint_stalls"),
                        ("startup", "startup"), ("restart", "restarts"), ("shutdown", "shutdown")):
        assert by_kind[kind] == pytest.approx(lost[cause]), kind
    spans = sorted(tl["spans"], key=lambda s: s["start"])
    assert all(a["end"] <= b["start"] + 1e-9 for a, b in zip(spans, spans[1:], strict=False))
    (stall,) = [s for s in spans if s["kind"] == "checkpoint"]
    assert (stall["start"], stall["end"]) == pytest.approx((9.0, 9.2))
    assert [s["step"] for s in spans if s["kind"] == "replayed"] == [5, 6]
    (restart,) = tl["restarts"]
    assert restart["attempt"] == 1 and restart["at_s"] == pytest.approx(16.0)
    assert restart["cause"] == "rank 1 failed: InjectedFailure: boom"
    assert [p["kept"] for p in r["series"]] == [True] * 4 + [False] * 2 + [True] * 6


def test_plot_draws_replayed_steps_dashed_and_restart_labels_apart(tmp_path):
    """--plot: only the steps a later attempt ran again are dashed (the kept part of a failed attempt is
    solid); restart labels at the same step in two runs do not sit on top of each other; the timeline lane
    of each run has bars of each kind as wide as its seconds."""
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_rgba

    from trainctl.report.plot import KIND_STYLE, figure

    a, b = interrupted_run(tmp_path / "a"), interrupted_run(tmp_path / "b")
    fig = figure(build_report([a, b]))
    try:
        loss, *_, timeline = fig.axes
        dashed = [ln for ln in loss.get_lines() if ln.get_linestyle() == "--"]
        assert sorted(tuple(ln.get_xdata()) for ln in dashed) == [(5, 6), (5, 6)]
        solid_steps = sorted(x for ln in loss.get_lines() if ln.get_linestyle() == "-" for x in ln.get_xdata())
        assert solid_steps == sorted(list(range(1, 11)) * 2)
        fig.canvas.draw()
        boxes = [t.get_window_extent() for t in loss.texts if t.get_text().startswith("restart")]
        assert len(boxes) == 2 and not boxes[0].overlaps(boxes[1])
        report = build_report([a])["runs"][0]["timeline"]["seconds_by_kind"]
        for kind, (colour, _name) in KIND_STYLE.items():
            widths = [w for c in timeline.collections if tuple(c.get_facecolor()[0]) == to_rgba(colour)
                      for p in c.get_paths() for w in [p.get_extents().width]]
            assert sum(widths) == pytest.approx(2 * report[kind], abs=1e-6), kind
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_scaling_efficiency_between_two_runs_of_one_model(tmp_path):
    """mfu-report RUN_A RUN_B: the same model on 2 and then 4 GPUs. Same global batch (strong scaling), per-GPU
    throughput 512 -> 350 tokens/s: 350/512 = 68% < 80%, a warning; the per-GPU batch kept (weak scaling) at
    460 tokens/s per GPU: 90%, no warning; another model is not compared."""
    def run(name: str, world: int, tokens: int, per_gpu: float, model: str = "{preset: gpt2-124m}") -> Path:
        m = [_step(k, 2.0 + k, world_size=world, tokens=tokens, tokens_per_s_per_gpu=per_gpu) for k in range(1, 5)]
        path = _write(tmp_path / name, m, [{"time": 0.0, "event": "launch"}, {"time": 1.5, "event": "start"}])
        (path / "spec.yaml").write_text(f"name: {name}\nmodel: {model}\ntrain: {{log_every: 1}}\n")
        return path

    base = run("base", 2, 1024, 512.0)
    strong, weak, other = run("strong", 4, 1024, 350.0), run("weak", 4, 2048, 460.0), run("other", 4, 1024, 1.0,
                                                                                          "{preset: llama3-8b}")
    report = build_report([base, strong, weak, other])
    (s, w) = report["scaling"]
    assert (s["run"], s["kind"], s["gpus"], s["baseline_gpus"]) == ("strong", "strong", 4, 2)
    assert s["efficiency"] == pytest.approx(350 / 512) and s["warning"]
    assert (w["kind"], w["efficiency"], w["warning"]) == ("weak", pytest.approx(460 / 512), False)
    out = io.StringIO()
    render(report, Console(file=out, width=200))
    assert "warning: strong on 4 GPUs against base on 2: strong scaling efficiency 68%" in out.getvalue()
    assert "scaling: weak on 4 GPUs against base on 2: weak scaling efficiency 90%" in out.getvalue()
    # named larger run first: the smaller one is still the baseline (it read 146%, a speed-up, of base on 2)
    (flipped,) = build_report([strong, base])["scaling"]
    assert (flipped["run"], flipped["baseline"], flipped["gpus"], flipped["baseline_gpus"]) == ("strong", "base", 4, 2)
    assert flipped["efficiency"] == pytest.approx(350 / 512) and flipped["warning"]


def test_plot_marks_skipped_and_nan_steps(tmp_path):
    """A diverged run's loss panel has one finite point: the skipped (NaN/inf) steps get a red x along the
    bottom of every panel, so the gap reads as steps that ran and were skipped, not as steps that never ran."""
    pytest.importorskip("matplotlib")
    from trainctl.report.plot import figure

    m = [_step(1, 1.0)] + [_step(k, float(k), loss=float("nan"), skipped=True) for k in range(2, 6)]
    run = _write(tmp_path / "diverged", m, [{"time": 0.0, "event": "launch"}, {"time": 0.5, "event": "start"}])
    fig = figure(build_report([run]))
    for ax in fig.axes[:3]:
        (marks,) = [c for c in ax.collections if c.get_offsets().shape[0] == 4]
        assert sorted(x for x, _ in marks.get_offsets()) == [2, 3, 4, 5]
    assert "skipped step (NaN/inf)" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]

"""`trainctl calibrate` and the planner that prices layouts with its profile, as a user runs them.

Real processes, the documentation's own: the calibration of the tiny recipe (8 ranks under torchrun) of
docs/plan-and-calibrate.md and the README's quick run (launched for 3 steps, resumed to 6) are shared by the
tests of this module (tests/conftest.py `readme_walkthrough`, which follows the README and the docs/ pages
once per session). No timing thresholds: the figures only have to exist, be positive and be used.
Contract: docs/design/calibration.md, "Calibration profile"; exit codes 0 ok, 1 failed, 2 usage (one line).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_utils import trainctl
from paths import REPO as ROOT

from trainctl.plan.calibration.fit import fit_latency_bandwidth, fit_rate

TINY = str(ROOT / "recipes" / "tiny-cpu.yaml")
OPS = {"all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all"}


def plan_json(*args: str) -> dict[str, Any]:
    out = trainctl("plan", TINY, "--json", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


CALIBRATE = "trainctl calibrate recipes/tiny-cpu.yaml"  # docs/plan-and-calibrate.md's, and the profile it writes
PROFILE = "calibration-tiny-cpu.json"


@pytest.fixture(scope="module")
def calibrated(readme_walkthrough) -> tuple[Path, str, int]:
    """The walkthrough's calibration of the tiny recipe: (profile, its output, its exit code)."""
    r = readme_walkthrough.result(CALIBRATE)
    return readme_walkthrough.cwd / PROFILE, r.output, r.returncode


@pytest.fixture(scope="module")
def finished_run(readme_walkthrough) -> Path:
    """The README's quick run of the tiny recipe (launched uncalibrated for 3 steps, resumed to 6)."""
    return (readme_walkthrough.cwd / "runs" / "quick").resolve()


# --- the profile ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_calibrate_writes_a_complete_profile_and_shows_each_phase(calibrated) -> None:
    path, out, code = calibrated
    assert code == 0, out
    for phase in ("[1/5] matmul", "[2/5] collectives", "[3/5] layer forward+backward", "[4/5] all-reduce after",
                  "[5/5] embedding, LM head + loss, optimizer step"):
        assert phase in out
    assert f"profile {path.name}" in out
    p = json.loads(path.read_text())
    assert p["kind"] == "trainctl-calibration" and p["schema"] == 3 and p["source"] == "micro-benchmarks"
    assert p["cluster"] == {"gpu": "cpu", "nodes": 1, "ranks_per_node": 8, "ranks": 8, "backend": "local"}
    assert p["precision"] == "fp32" and p["device"]["type"] == "cpu" and p["device"]["name"]
    for key in ("created", "trainctl_version", "torch_version", "peak_flops_per_rank", "model", "micro_batch"):
        assert p[key], key
    raw, fits = p["raw"], p["fits"]
    assert {r["name"] for r in raw["matmul"]} == {"qkv", "attn_out", "mlp_up", "mlp_down", "lm_head"}
    assert {r["tp"] for r in raw["matmul"]} == {1, 2, 4}  # every tp --auto may pick for 4 heads on 8 ranks
    assert all(len(r["seconds"]) == 8 and min(r["seconds"]) > 0 for r in raw["matmul"])  # every rank's figure
    assert {r["op"] for r in raw["collectives"]} == OPS
    assert {r["group_size"] for r in raw["collectives"] if r["op"] == "all_reduce"} == {2, 4, 8}
    assert len(raw["layer"]["seconds"]) == 8 and raw["layer"]["flops"] > 0
    # the layer on its chunks in CP groups of every size in the node (64 tokens: 2 x cp chunks of 4 or more)
    assert [(r["cp"], len(r["seconds"])) for r in raw["layer"]["cp"]] == [(2, 8), (4, 8), (8, 8)]
    assert sorted(fits["layer"]["cp_seconds"]) == ["2", "4", "8"] and min(fits["layer"]["cp_seconds"].values()) > 0
    assert "cp 2/4/8 in CP groups" in out
    # the all-reduce between forwards on every rank; the pipeline hop on the first rank of each of the 4 pairs
    assert [(r["op"], r["link"], r["group_size"], len(r["seconds"])) for r in raw["load"]] == [
        ("all_reduce", "intra_node", 2, 8), ("send_recv", "intra_node", 2, 4)]
    # a gradient bucket's all-reduce behind the layer's forward + backward, each alone: every rank's figures,
    # and the share hidden recomputed from their medians
    [ov] = raw["overlap"]
    assert (ov["link"], ov["group_size"]) == ("intra_node", 2) and ov["bytes"] > 0
    medians = {k: statistics.median(ov[k]) for k in ("compute_s", "collective_s", "together_s")}
    assert all(len(ov[k]) == 8 and min(ov[k]) > 0 for k in medians)
    hidden = (medians["compute_s"] + medians["collective_s"] - medians["together_s"]) / medians["collective_s"]
    assert fits["dp_overlap"] == {"intra_node": pytest.approx(min(1.0, max(0.0, hidden)))}
    assert "intra-node DP reduction" in out
    assert all(v["flops_per_s"] > 0 for v in fits["matmul"].values())
    assert fits["layer"]["flops_per_s"] > 0 and set(fits["compute"]) == {"1", "2", "4"}
    assert set(fits["links"]) == {"intra_node"}  # one node: nothing crosses nodes
    assert "per ring step" in out and "worst measured point off by" in out  # the summary's residual
    assert set(fits["links"]["intra_node"]) == OPS
    for op, f in fits["links"]["intra_node"].items():  # every kind over groups of 2, 4 and 8 (send/recv: pairs)
        assert f["groups"] == ([2] if op == "send_recv" else [2, 4, 8]) and f["op"] == op
        assert f["bytes_per_s"] > 0 and f["points"] >= 5
        assert f["load_excess_s"] >= 0 and f["latency_s"] == pytest.approx(f["idle_latency_s"] + f["load_excess_s"])
        _fit_holds_to_its_points(op, f, [r for r in raw["collectives"] if r["op"] == op])
        # the wait for a busy peer: send/recv's from the pipeline hop, every other kind's from the all-reduce
        load = next(r for r in raw["load"] if r["op"] == ("send_recv" if op == "send_recv" else "all_reduce"))
        own = fits["links"]["intra_node"][load["op"]]
        idle = own["idle_latency_s"] + own["step_latency_s"] * (2 if load["op"] == "all_reduce" else 1)
        waited = statistics.median(load["seconds"]) - idle - load["bus_bytes"] / own["bytes_per_s"]
        assert f["load_excess_s"] == pytest.approx(max(0.0, waited), rel=1e-6, abs=1e-12)
    fixed = raw["fixed"]  # the work outside the layers, every rank's figure
    for key in ("embedding_s", "head_s"):
        assert len(fixed[key]) == 8 and min(fixed[key]) > 0
    assert [o["tensors"] for o in fixed["optimizer"]][1:] == [1, 1] and fixed["optimizer"][0]["tensors"] > 1
    assert fixed["fsdp"]["group_size"] == 2 and len(fixed["fsdp"]["sharded_s"]) == 8
    f = fits["fixed"]
    assert f["element_s"] > 0 and f["tensor_s"] >= 0 and f["fsdp_unit_s"] >= 0 and f["layer_tensors"] > 0
    assert not [f for f in path.parent.iterdir() if f.name.startswith(f".{path.name}")]  # no temporary left


def _fit_holds_to_its_points(op: str, f: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """A kind's fit against the points it was fitted to (median over ranks), recomputed here from the fit's
    own terms (per call + per ring step x steps + bus bytes / bandwidth; idle, as measured): every point is
    within the worst residual the fit reports (`max_rel_error`, its stated tolerance) and the rms it reports
    is true; and the fit is the least relative error: moving any of its three terms by 5% (up only, for a
    term at 0) makes the rms no smaller. All relative to the fit's own points, not to wall-clock: a loaded
    machine moves the points and the fit together (on 2 shared cores the rms is 0.3-0.6, the latency growing
    faster than the ring's steps as more ranks wait to be scheduled)."""
    steps = {"all_reduce": lambda n: 2 * (n - 1), "send_recv": lambda n: 1}.get(op, lambda n: n - 1)
    assert f["groups"] == sorted({r["group_size"] for r in rows}) and f["points"] == len(rows)
    points = [(steps(r["group_size"]), r["bus_bytes"], statistics.median(r["seconds"])) for r in rows]

    def errors(call: float, step: float, per_byte: float) -> list[float]:
        return [(call + step * k + x * per_byte - t) / t for k, x, t in points]

    def rms(e: list[float]) -> float:
        return math.sqrt(sum(v * v for v in e) / len(e))

    terms = [f["idle_latency_s"], f["step_latency_s"], 1 / f["bytes_per_s"]]
    mine = errors(*terms)
    assert max(map(abs, mine)) == pytest.approx(f["max_rel_error"], rel=1e-6)
    assert rms(mine) == pytest.approx(f["rms_rel_error"], rel=1e-6)
    for i, term in enumerate(terms):
        for moved in {term * 1.05, term * 0.95} if term > 0 else {1e-6 if i < 2 else terms[2] * 0.05}:
            assert rms(errors(*[moved if j == i else v for j, v in enumerate(terms)])) >= rms(mine) * (1 - 1e-9)


def test_fit_recovers_a_line_and_stays_positive() -> None:
    line = [(x, 2e-4 + x / 1e9) for x in (1e3, 1e4, 1e5, 1e6, 1e7)]
    f = fit_latency_bandwidth(line)
    assert f.latency_s == pytest.approx(2e-4, rel=1e-6) and f.bytes_per_s == pytest.approx(1e9, rel=1e-6)
    flat = fit_latency_bandwidth([(1e3, 1e-3), (1e6, 9e-4), (4e6, 1e-3)])  # latency-bound noise
    assert flat.bytes_per_s > 0 and flat.latency_s > 0
    origin = fit_latency_bandwidth([(1e3, 1e-9), (1e6, 1e-3), (4e6, 4e-3)])  # would cross below zero
    assert origin.latency_s == 0 and origin.bytes_per_s > 0
    rate, err = fit_rate([(2e9, 1.0), (4e9, 2.0)])
    assert rate == pytest.approx(2e9) and err == pytest.approx(0, abs=1e-12)


# --- the planner with a profile ------------------------------------------------------------------------

@pytest.mark.slow
def test_plan_predicts_a_cpu_step_time_only_with_a_profile(calibrated) -> None:
    path, _, _ = calibrated
    before = plan_json()
    assert before["prediction"]["step_time_s"] is None and before["calibration"]["calibrated"] is False
    after = plan_json("--calibration", str(path))
    pred = after["prediction"]
    assert pred["step_time_s"] > 0 and pred["tokens_per_s"] > 0 and 0 < pred["mfu"] < 1
    assert pred["breakdown_s"]["optimizer step"] > 0  # the profile's fixed work is priced, and shown
    outside = pred["outside_layers"]  # the ends per micro-batch (on the slowest pipeline rank) + the optimizer
    assert outside["total_s"] == pytest.approx(outside["micro_batches_s"] + outside["optimizer_step_s"])
    assert outside["optimizer_step_s"] == pred["breakdown_s"]["optimizer step"]
    # the head's work beyond its FLOPs can measure as none on a loaded host (clamped at 0); the embedding's not
    assert outside["micro_batches_s"] >= 0 and json.loads(path.read_text())["fits"]["fixed"]["embedding_s"] > 0
    assert after["calibration"]["calibrated"] is True and after["calibration"]["path"] == str(path)
    assert after["hardware"]["peak_flops"] == json.loads(path.read_text())["peak_flops_per_rank"]
    assert not [w for w in after["warnings"] if w["code"] == "CALIBRATION_DIFFERS"]  # same machine, just made
    # the spec field does the same
    assert plan_json("--set", f"cluster.calibration={path}")["prediction"]["step_time_s"] == pred["step_time_s"]
    text = trainctl("plan", TINY, "--calibration", str(path)).stdout
    assert "measured: " in text and "uncalibrated" not in text
    assert "uncalibrated" in trainctl("plan", TINY).stdout


@pytest.mark.slow
def test_plan_auto_ranks_cpu_layouts_by_the_measured_step_time(calibrated) -> None:
    path, _, _ = calibrated
    out = trainctl("plan", TINY, "--auto", "--json", "--calibration", str(path))
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["peak_known"] is True and res["calibration"]["calibrated"] is True
    steps = [r["step_time_s"] for r in res["top"]]
    assert all(s > 0 for s in steps) and steps == sorted(steps)


def test_plan_with_a_profile_does_not_import_torch(calibrated) -> None:
    path, _, _ = calibrated
    code = ("import sys\nfrom trainctl.cli.app import main\n"
            f"for argv in (['plan', {TINY!r}, '--calibration', {str(path)!r}, '--json'], ['calibrate', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code in (0, None), e.code\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\nassert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# --- refused and warned profiles -----------------------------------------------------------------------

def _refused(profile: Path, *extra: str) -> str:
    out = trainctl("plan", TINY, "--calibration", str(profile), *extra)
    assert out.returncode == 2, out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    return errors[0]


@pytest.mark.slow
def test_corrupt_truncated_and_foreign_profiles_are_refused(calibrated, tmp_path: Path) -> None:
    path, _, _ = calibrated
    text = path.read_text()
    (tmp_path / "truncated.json").write_text(text[: len(text) // 2])
    assert "not valid JSON" in _refused(tmp_path / "truncated.json")
    (tmp_path / "corrupt.json").write_bytes(b"\x00\xff\xfe garbage")
    assert "corrupt" in _refused(tmp_path / "corrupt.json")
    plan = trainctl("plan", TINY, "--json").stdout
    (tmp_path / "plan.json").write_text(plan)  # a JSON file, but someone else's
    assert "not a trainctl calibration profile" in _refused(tmp_path / "plan.json")
    assert "cannot read" in _refused(tmp_path / "missing.json")
    data = json.loads(text)
    del data["fits"]["compute"]
    (tmp_path / "incomplete.json").write_text(json.dumps(data))
    assert "incomplete" in _refused(tmp_path / "incomplete.json")
    schema1 = json.loads(text)  # a profile of the trainctl before the fixed work was measured
    schema1["schema"] = 1
    del schema1["fits"]["fixed"]
    (tmp_path / "schema1.json").write_text(json.dumps(schema1))
    assert "schema 1; this trainctl reads schema 3 (it also measures the work outside the layers; it fits" in _refused(
        tmp_path / "schema1.json")
    other_gpu = json.loads(text)
    other_gpu["cluster"]["gpu"] = "h100-sxm"
    (tmp_path / "gpu.json").write_text(json.dumps(other_gpu))
    assert "cluster.gpu = h100-sxm" in _refused(tmp_path / "gpu.json")

@pytest.mark.slow
def test_a_profile_prices_other_sizes_on_the_same_hardware_with_its_extrapolations(calibrated) -> None:
    """Measured on one node of 8 ranks: a 4-rank spec and the 2-node Slurm cluster are priced from it, the
    second naming the inter-node links it did not measure."""
    path, _, _ = calibrated

    def differs(*sets: str) -> str:
        j = plan_json("--calibration", str(path), *sets)
        assert j["prediction"]["step_time_s"] > 0
        return " ".join(w["message"] for w in j["warnings"] if w["code"] == "CALIBRATION_DIFFERS")

    assert "measured with 8 ranks per node, the spec has 4" in differs(
        "--set", "cluster.gpus_per_node=4", "--set", "parallel.dp=1")
    assert "inter-node links: not calibrated (measured on one node), priced from the catalog's fabric" in differs(
        "--set", "cluster.gpus_per_node=4", "--set", "cluster.nodes=2", "--set", "launcher.backend=slurm")


@pytest.mark.slow
def test_an_old_profile_of_another_version_or_compile_is_used_with_a_warning(calibrated, tmp_path: Path) -> None:
    path, _, _ = calibrated
    data = json.loads(path.read_text())
    assert data["compile"] is None  # the layers ran as the spec runs them: eager
    data.update(created="2020-01-01T00:00:00+00:00", trainctl_version="0.0.1", compile="inductor")
    (tmp_path / "old.json").write_text(json.dumps(data))
    j = plan_json("--calibration", str(tmp_path / "old.json"))
    assert j["prediction"]["step_time_s"] > 0
    differs = " ".join(w["message"] for w in j["warnings"] if w["code"] == "CALIBRATION_DIFFERS")
    assert "days ago" in differs and "trainctl 0.0.1" in differs
    assert "its layers ran compiled with inductor, the run's eager" in differs


# --- refit from a finished run -------------------------------------------------------------------------

@pytest.mark.slow
def test_from_run_refits_the_compute_rate(finished_run: Path, calibrated, tmp_path: Path) -> None:
    out = trainctl("calibrate", "--from-run", str(finished_run), "--out", str(tmp_path / "run.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    p = json.loads((tmp_path / "run.json").read_text())
    assert p["source"] == "run" and p["cluster"]["ranks"] == 8
    assert p["fits"]["run"]["flops_per_s"] > 0 and p["fits"]["run"]["points"] >= 8  # 8 ranks x 2 steps
    assert p["fits"]["compute"] == {"2": p["fits"]["run"]["flops_per_s"]} and p["fits"]["links"] == {}
    assert plan_json("--calibration", str(tmp_path / "run.json"))["prediction"]["step_time_s"] > 0
    # with a measured profile as the base: its links, its per-TP shape re-levelled to the run
    base, _, _ = calibrated
    out = trainctl("calibrate", "--from-run", str(finished_run), "--base", str(base), "--out",
                   str(tmp_path / "both.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    both = json.loads((tmp_path / "both.json").read_text())
    assert set(both["fits"]["compute"]) == {"1", "2", "4"} and both["fits"]["links"]["intra_node"]
    assert both["fits"]["compute"]["2"] == pytest.approx(both["fits"]["run"]["flops_per_s"])
    # per part of the step the report measures, the latency per call of its own collectives that makes the
    # plan's part the run's measured one (unless the plan is slower even without it): tp 2 with SP on the TP
    # link's reduce-scatter + all-gather, the pipeline's waits on its send/recv. ZeRO-1's DP reduce-scatters and
    # all-gathers too, on the same link: both are TP's already, so DP's gradient sync is fitted on the tied
    # embedding's all-reduce alone
    kinds, links = both["fits"]["run"]["kinds"], both["fits"]["links"]["intra_node"]
    assert kinds["tp"]["collectives"] == ["intra_node.all_gather", "intra_node.reduce_scatter"]
    assert kinds["pp"]["collectives"] == ["intra_node.send_recv"]
    assert kinds["dp"]["collectives"] == ["intra_node.all_reduce"] and kinds["dp"]["measured_s"] > 0
    steps = [json.loads(line) for f in sorted((finished_run / "logs").glob("steptimes-rank*.jsonl"))
             for line in f.read_text().splitlines()]
    for kind, figure in (("tp", lambda r: r["comm_s"] - r["pp_s"]),):
        k = kinds[kind]
        assert k["fitted"] and k["load_excess_s"] >= 0
        assert min(map(figure, (r for r in steps if "step" in r))) <= k["measured_s"]
        assert k["planned_s"] == pytest.approx(k["measured_s"], rel=1e-3) or k["load_excess_s"] == 0
        for name in k["collectives"]:
            fit = links[name.split(".")[1]]
            assert fit["latency_s"] == pytest.approx(fit["idle_latency_s"] + k["load_excess_s"])
    assert links["all_to_all"] == json.loads(base.read_text())["fits"]["links"]["intra_node"]["all_to_all"]  # kept
    assert trainctl("calibrate", TINY, "--from-run", str(finished_run)).returncode == 2  # spec comes from the run


@pytest.mark.slow
def test_from_run_never_replaces_its_base_profile(finished_run: Path, calibrated, tmp_path: Path) -> None:
    """The walkthrough's profile as the base of a refit in the directory it was written to: the default --out
    (once the base's own name) names the refit after the run; --out the base itself is refused."""
    base = tmp_path / PROFILE
    base.write_bytes(calibrated[0].read_bytes())
    out = trainctl("calibrate", "--from-run", str(finished_run), "--base", PROFILE, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert base.read_bytes() == calibrated[0].read_bytes()
    refit = tmp_path / "calibration-tiny-cpu-from-quick.json"
    assert json.loads(refit.read_text())["source"] == "run" and f"profile {refit.name}" in out.stdout
    out = trainctl("calibrate", "--from-run", str(finished_run), "--base", PROFILE, "--out", str(base), cwd=tmp_path)
    assert out.returncode == 2 and "is the --base profile" in out.stderr
    assert base.read_bytes() == calibrated[0].read_bytes()


# --- a finished run held against a profile measured after it -------------------------------------------

@pytest.mark.slow
def test_mfu_report_prices_a_finished_run_with_a_profile(finished_run: Path, calibrated, tmp_path: Path) -> None:
    """The run launched uncalibrated: its report has no predicted step; with --calibration the report's
    prediction is exactly what `plan --calibration` predicts for the run's spec, part by part beside the
    measured ones; a foreign profile is refused with one line, as by `plan`."""
    path, _, _ = calibrated

    def report(*extra: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
        out = trainctl("mfu-report", str(finished_run), *extra)
        assert out.returncode == 0, out.stdout + out.stderr
        js = trainctl("mfu-report", str(finished_run), "--json", *extra)
        return json.loads(js.stdout)["runs"][0], out

    before, _ = report()
    assert before["prediction"] is None and "calibration profile" in before["step_vs_plan"]["no_prediction"]
    after, text = report("--calibration", str(path))
    planned = plan_json("--calibration", str(path), "--set", "train.steps=6")["prediction"]  # as resumed
    assert after["prediction"]["step_time_s"] == pytest.approx(planned["step_time_s"])
    assert sum(after["prediction"]["components_s"].values()) == pytest.approx(planned["step_time_s"])
    assert after["measured"]["step_time_s"] > 0 and after["step_vs_plan"]["step_error"] is not None
    assert after["step_vs_plan"]["priced_with"].startswith(f"measured: {path} (micro-benchmarks, ")
    assert "times priced with: measured:" in " ".join(text.stdout.split())
    assert not (finished_run / "plan.json").read_text().count('"calibrated": true')  # the run's own plan is kept
    other = json.loads(path.read_text())
    other["cluster"]["gpu"] = "h100-sxm"
    (tmp_path / "gpu.json").write_text(json.dumps(other))
    out = trainctl("mfu-report", str(finished_run), "--calibration", str(tmp_path / "gpu.json"))
    assert out.returncode == 2 and len([x for x in out.stderr.splitlines() if x.startswith("error:")]) == 1, out.stderr


# --- a run launched with a profile: on track against its plan's whole run ---------------------------------

@pytest.fixture(scope="module")
def calibrated_run(calibrated, tmp_path_factory) -> dict[str, Any]:
    """The tiny recipe at DP2 launched for 6 steps with the walkthrough's profile (measured on 8 ranks, priced
    for 2 with a warning): its plan.json has a whole run, which a CPU plan without a profile lacks. Returns
    the plan's whole run, `status` and `mfu-report`, each as JSON and as text."""
    path, out, code = calibrated
    assert code == 0, out
    run = tmp_path_factory.mktemp("calibrated") / "run"
    sets = ("parallel.tp=1", "parallel.pp=1", "cluster.gpus_per_node=2", "train.steps=6", "checkpoint.every_steps=3",
            f"cluster.calibration={path}")
    launched = trainctl("launch", TINY, "--run-dir", str(run), *[a for s in sets for a in ("--set", s)])
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    got: dict[str, Any] = {"whole_run": json.loads((run / "plan.json").read_text())["checkpoint"]["whole_run"]}
    for command in ("status", "mfu-report"):
        js, text = trainctl(command, str(run), "--json"), trainctl(command, str(run), env={"COLUMNS": "200"})
        assert js.returncode == 0 and text.returncode == 0, js.stderr + text.stderr
        j = json.loads(js.stdout)
        got[command] = (j["runs"][0] if command == "mfu-report" else j)["projection"], " ".join(text.stdout.split())
    return got


@pytest.mark.slow
@pytest.mark.parametrize("command", ["status", "mfu-report"])
def test_a_calibrated_run_is_held_against_its_plans_whole_run(calibrated_run, command) -> None:
    """`status` and `mfu-report` hold the finished run's measured total against the whole run its plan.json
    priced: for the plan's own 6 steps the plan's side is that whole run's expected wall clock, its step and
    save stall per step are plan.json's over 6, and the gap, split into causes that add up to it, is the
    measured total less the plan's (figures from plan.json, not from the projection's code)."""
    from trainctl.units import dur

    w = calibrated_run["whole_run"]
    p, text = calibrated_run[command]
    assert w is not None and w["steps"] == 6  # a CPU plan has a whole run only when priced with a profile
    g = p["vs_plan"]
    assert g is not None and p["vs_plan_note"] is None, p
    assert p["total_is"] == "measured" and p["steps"] == {"done": 6, "total": 6, "lost": 0}
    assert g["planned_total_s"] == pytest.approx(w["wall_days"]["mean"] * 86400, rel=1e-9)
    planned = g["planned"]
    assert planned["step_s"] == pytest.approx(w["compute_s"] / 6, rel=1e-9)
    assert planned["save_per_step_s"] == pytest.approx(w["save_blocking_s"] / 6, rel=1e-9)
    assert planned["failures_per_compute_hour"] == pytest.approx(w["expected_interruptions"] / w["compute_s"] * 3600,
                                                                 rel=1e-9)
    assert g["gap_s"] == pytest.approx(p["total_s"] - w["wall_days"]["mean"] * 86400, rel=1e-9)
    m, causes = p["measured"], g["causes_s"]
    assert causes["steps"] == pytest.approx(6 * (m["step_s"] - w["compute_s"] / 6), rel=1e-9)
    assert causes["saves"] == pytest.approx(6 * (m["save_per_step_s"] - w["save_blocking_s"] / 6), rel=1e-9, abs=1e-12)
    assert sum(causes.values()) == pytest.approx(g["gap_s"], rel=1e-9)
    late = "behind" if g["gap_s"] >= 0 else "ahead of"
    assert (f"measured {dur(abs(g['gap_s']))} {late} the plan's {dur(g['planned_total_s'])}; largest cause: "
            f"{g['largest']}") in text
    assert "vs plan:" not in text  # the line that says there is no plan to be held against

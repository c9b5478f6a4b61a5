"""`trainctl calibrate --from-run RUN --base PROFILE` on a real pipeline run: the refit predicts the run it was
fitted on better than its base did, and its summary says how good each link's fit is.

One calibration and one launch, shared by the tests of this module: the tiny recipe as PP 2 on 2 CPU ranks (tp
1, dp 1: the pipeline's waits and the tied embedding's all-reduce are the run's communication), 10 steps. On a
CPU the pipeline ranks wait for each other far longer than the schedule's bubble says (the base under-predicts
the step), which is what the refit has to take in. No timing thresholds: the errors compared are mfu-report's,
of one run, in one process (the refit's relative to the base's), and the fitted parts against the report's own
measured parts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_utils import trainctl
from paths import REPO

pytestmark = pytest.mark.slow

TINY = REPO / "recipes" / "tiny-cpu.yaml"
PP2 = [x for s in ("parallel.tp=1", "parallel.pp=2", "parallel.dp=1", "parallel.sequence_parallel=false",
                   "cluster.gpus_per_node=2") for x in ("--set", s)]
PIPELINE = "pipeline bubble + point-to-point"
SAME_STEP = 0.02  # two predictions this close to the run's mean step are equally good on 10 CPU steps


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The calibration (its profile and output), the run, and the refit of the run on that profile."""
    d = tmp_path_factory.mktemp("refit")
    base, run, refit = d / "base.json", d / "run", d / "refit.json"
    calibrated = trainctl("calibrate", str(TINY), *PP2, "--out", str(base), "--run-dir", str(d / "calibrate"),
                          env={"COLUMNS": "400"})
    assert calibrated.returncode == 0, calibrated.stdout[-3000:] + calibrated.stderr[-3000:]
    launched = trainctl("launch", str(TINY), *PP2, "--set", "train.steps=10", "--run-dir", str(run))
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    refitted = trainctl("calibrate", "--from-run", str(run), "--base", str(base), "--out", str(refit),
                        env={"COLUMNS": "400"})
    assert refitted.returncode == 0, refitted.stdout[-3000:] + refitted.stderr[-3000:]
    return {"base": base, "run": run, "refit": refit, "calibrate_out": calibrated.stdout,
            "refit_out": refitted.stdout}


def report(run: Path, profile: Path) -> dict[str, Any]:
    out = trainctl("mfu-report", str(run), "--json", "--calibration", str(profile))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)["runs"][0]


def test_a_refit_predicts_its_run_better_than_its_base(measured: dict[str, Any]) -> None:
    """The refit used to fit one FLOP/s rate to every rank's busy time per step, weighted toward the shortest
    steps, drop the base's work outside the layers and leave the pipeline waits unfitted: its plan moved away
    from the run (here 163 ms base, 86 ms refit, 229 ms measured). Now each part of the step the report
    measures is fitted through the planner: compute by the rate (the work outside the layers kept), the
    pipeline waits by the send/recv latency, the gradient sync by the tied embedding's all-reduce."""
    before = report(measured["run"], measured["base"])
    after = report(measured["run"], measured["refit"])
    assert after["measured"] == before["measured"]  # the same run, the same steps
    base_error, refit_error = before["step_vs_plan"]["step_error"], after["step_vs_plan"]["step_error"]
    # A base already within a step's noise of the run leaves the refit nothing to improve (a fresh-clone CI once
    # measured the base at -0.5% and the refit at +0.5%): the refit is then held to that band instead.
    assert abs(refit_error) < max(abs(base_error), SAME_STEP), (base_error, refit_error)
    # each fitted part is the report's measured part, and the work outside the layers is priced again
    fitted = json.loads(measured["refit"].read_text())["fits"]
    parts = {r["component"]: r for r in after["step_vs_plan"]["rows"]}
    kinds = fitted["run"]["kinds"]
    assert kinds["pp"]["collectives"] == ["intra_node.send_recv"] and kinds["pp"]["fitted"]
    assert kinds["dp"]["collectives"] == ["intra_node.all_reduce"]  # the tied embedding's (dp 1: no DP traffic)
    for part, figure in (("compute", fitted["run"]["compute"]), (PIPELINE, kinds["pp"]),
                         ("DP gradient sync (exposed)", kinds["dp"])):
        assert figure["measured_s"] == pytest.approx(parts[part]["measured_s"], rel=1e-9), part
        if figure.get("fitted", True) and figure.get("load_excess_s", 1) > 0:
            assert parts[part]["predicted_s"] == pytest.approx(parts[part]["measured_s"], rel=1e-3), part
    assert after["prediction"]["outside_layers"]["total_s"] > 0  # the base's fits.fixed, kept
    assert fitted["fixed"] == json.loads(measured["base"].read_text())["fits"]["fixed"]
    print(f"step error against the run: base {base_error:+.1%}, refit {refit_error:+.1%}")


def test_calibrate_says_how_far_off_each_fit_is(measured: dict[str, Any]) -> None:
    """The summary's fit line reads as the error it is ("worst measured point off by N%"), flagged as a poor fit
    above 25%, not "fits within N% of every measured point"; the same for the refit, whose links are the
    base's."""
    links = json.loads(measured["base"].read_text())["fits"]["links"]["intra_node"]
    worst = max(links.values(), key=lambda f: f["max_rel_error"])
    said = f"(fit of {worst['op'].replace('_', '-')}: worst measured point off by {worst['max_rel_error']:.0%}"
    poor = " - a poor fit: the times priced from it are rough)"
    for out in (measured["calibrate_out"], measured["refit_out"]):
        assert "fits within" not in out
        line = next(ln for ln in out.splitlines() if ln.startswith("profile "))
        assert said in line, line
        assert (poor in line) == (worst["max_rel_error"] > 0.25), line

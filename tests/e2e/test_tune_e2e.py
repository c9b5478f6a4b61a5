"""`trainctl tune`: the top 3 layouts `plan --auto` ranks for the tiny CPU recipe on 4 ranks, each run for a few
steps, measured, and the measured fastest written as a spec. One tune, stopped by Ctrl-C in its first run and
finished by `trainctl resume TUNE`, checked several ways; and a tune whose only layout fails."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
from pathlib import Path

import pytest
import slurm_fixtures
import yaml
from cli_utils import TRAINCTL, trainctl
from paths import REPO

from trainctl.rundir.paths import read_jsonl

pytestmark = pytest.mark.slow

STEPS = 5
# 4 CPU ranks, dp chosen by the plan; a peak so the plan predicts times (ranked at it; a claim, not a measurement)
SETS = ["parallel.dp=auto", "cluster.gpus_per_node=4", "cluster.peak_tflops=0.05", "train.global_batch=8"]
SET_ARGS = [w for s in SETS for w in ("--set", s)]
SLOW = {"TRAINCTL_FAULTS": "slow_rank=0:1.5"}  # the first run's steps take >= 1.5 s: time to press Ctrl-C in it
LAYOUT = ("tp", "cp", "pp", "dp", "ep", "zero", "offload", "micro_batch", "sequence_parallel", "schedule",
          "virtual_stages")


def wait_for(pred, what: str, timeout: float = 240):
    return slurm_fixtures.wait_for(pred, what, timeout, 0.5)


def has_steps(run: Path) -> bool:
    return (run / "metrics.jsonl").is_file() and len(read_jsonl(run / "metrics.jsonl")) >= 1


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tune, Ctrl-C'd in run-0 (the launcher alone signalled, as a terminal's Ctrl-C reaches it), then resumed."""
    root = tmp_path_factory.mktemp("tune") / "t"
    proc = subprocess.Popen([*TRAINCTL, "tune", *SET_ARGS, "--top", "3", "--steps", str(STEPS), "--tune-dir",
                             str(root)], cwd=REPO, env={**os.environ, **SLOW}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: has_steps(root / "run-0"), "run-0's first step")
        proc.send_signal(signal.SIGINT)
        stopped_out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped_states = [r["state"] for r in json.loads(trainctl("status", str(root), "--json").stdout)["runs"]]
    resumed = trainctl("resume", str(root), timeout=600)
    return {"root": root, "stopped_rc": proc.returncode, "stopped_out": stopped_out,
            "stopped_states": stopped_states, "resumed": resumed,
            "result": json.loads((root / "tune-result.json").read_text()) if resumed.returncode == 0 else None}


def test_ctrl_c_stops_the_tune_resumably(tuned: dict) -> None:
    assert tuned["stopped_rc"] == 75, tuned["stopped_out"]
    # run-0 stopped after a checkpoint; the other layouts never started; nothing was written yet
    assert tuned["stopped_states"] == ["STOPPED", "PENDING", "PENDING"], tuned["stopped_out"]
    assert "not started run-1" in tuned["stopped_out"] and "trainctl resume" in tuned["stopped_out"]
    assert tuned["resumed"].returncode == 0, tuned["resumed"].stdout + tuned["resumed"].stderr


def test_table_holds_predicted_and_measured_per_layout(tuned: dict) -> None:
    res, out = tuned["result"], tuned["resumed"].stdout
    rows = res["rows"]
    assert [r["dir"] for r in rows] == ["run-0", "run-1", "run-2"] and [r["predicted_rank"] for r in rows] == [1, 2, 3]
    assert sorted(r["measured_rank"] for r in rows) == [1, 2, 3]
    for r in rows:
        assert r["state"] == "COMPLETED"
        assert r["predicted"]["step_time_s"] > 0 and r["predicted"]["tokens_per_s"] > 0
        assert r["measured"]["step_time_s"] > 0 and r["measured"]["tokens_per_s"] > 0 and 0 < r["measured"]["mfu"] < 1
        assert f" {r['dir']} " in out  # the printed table has its row
    # the predictions are plan --auto's own top 3, in its order
    plan = trainctl("plan", *SET_ARGS, "--auto", "--top", "3", "--json")
    assert plan.returncode == 0, plan.stderr
    top = json.loads(plan.stdout)["top"]
    for r, p in zip(rows, top, strict=True):
        assert r["predicted"]["step_time_s"] == pytest.approx(p["step_time_s"], rel=1e-9)
        assert r["predicted"]["tokens_per_s"] == pytest.approx(p["tokens_per_s"], rel=1e-9)
        spec = yaml.safe_load((tuned["root"] / r["dir"] / "spec.yaml").read_text())
        assert {k: spec["parallel"][k] for k in ("tp", "pp", "dp", "zero", "micro_batch", "schedule")} == {
            k: p[k] for k in ("tp", "pp", "dp", "zero", "micro_batch", "schedule")}
        assert spec["train"]["steps"] == STEPS


def measured_step(run: Path) -> float:
    """The median step time of a run's steps without the first of each trainer start (worked out here from
    metrics.jsonl and events.jsonl, not by the report's code)."""
    starts = [e["time"] for e in read_jsonl(run / "events.jsonl") if e.get("event") in ("launch", "resume")]
    latest: dict[int, float] = {}
    seen = set()
    for m in read_jsonl(run / "metrics.jsonl"):
        attempt = sum(1 for t in starts if t <= m["time"])
        if attempt in seen:
            latest[m["step"]] = m["step_time_s"]  # a step run again after a resume counts once, as run last
        seen.add(attempt)  # the first step of each start is warm-up
    assert len(latest) >= 3
    return statistics.median(latest.values())


def test_written_spec_is_the_measured_fastest_and_validates(tuned: dict) -> None:
    root, res = tuned["root"], tuned["result"]
    best = root / "best.yaml"
    assert res["written"] == str(best)
    text = best.read_text()
    assert text.startswith("# Layout measured by `trainctl tune`") and str(root) in text
    assert trainctl("validate", str(best)).returncode == 0
    fastest = min(("run-0", "run-1", "run-2"), key=lambda d: measured_step(root / d))
    assert res["best"]["dir"] == fastest
    for d in ("run-0", "run-1", "run-2"):
        row = next(r for r in res["rows"] if r["dir"] == d)
        assert row["measured"]["step_time_s"] == pytest.approx(measured_step(root / d), rel=1e-9)
    written = yaml.safe_load(text)
    ran = yaml.safe_load((root / fastest / "spec.yaml").read_text())
    assert {k: written["parallel"][k] for k in LAYOUT} == {k: ran["parallel"][k] for k in LAYOUT}
    assert written["train"]["recompute"] == ran["train"]["recompute"]
    assert written["train"]["steps"] == 20  # the recipe's own length, not the tune's
    assert written["cluster"]["gpus_per_node"] == 4  # the --set overrides the tune ran with are kept


def test_status_takes_the_tune_directory(tuned: dict) -> None:
    r = trainctl("status", str(tuned["root"]))
    assert r.returncode == 0 and r.stdout.count("COMPLETED") == 3, r.stdout + r.stderr


def test_a_failing_layout_is_a_row(tmp_path: Path) -> None:
    root = tmp_path / "t"
    one_rank = ["--set", "parallel.tp=1", "--set", "parallel.pp=1", "--set", "parallel.dp=auto",
                "--set", "cluster.gpus_per_node=1", "--set", "train.global_batch=4",
                "--set", "parallel.sequence_parallel=false"]
    r = trainctl("tune", *one_rank, "--top", "1", "--steps", "3", "--tune-dir", str(root),
                 env={"TRAINCTL_FAULTS": "fail_at_step=2"})
    assert r.returncode == 1, r.stdout + r.stderr  # no layout completed: no spec, and no traceback
    assert "Traceback" not in r.stdout + r.stderr
    assert "no layout completed" in r.stdout and not (root / "best.yaml").exists()
    (row,) = json.loads((root / "tune-result.json").read_text())["rows"]
    assert row["state"] == "FAILED" and row["measured"] is None and row["reason"]


def test_slurm_tune_is_one_job_array(slurm_cluster, tmp_path: Path) -> None:
    """On the local Slurm cluster: the three layouts (2 ranks on one node) are one job array run one element at a
    time (so no two layouts share the node while measured); tune waits for it, then writes the measured best."""
    root = tmp_path / "t"
    sets = ["launcher.backend=slurm", "parallel.tp=1", "parallel.pp=1", "parallel.sequence_parallel=false",
            "parallel.dp=auto", "cluster.gpus_per_node=2", "cluster.peak_tflops=0.05", "train.global_batch=4"]
    r = trainctl("tune", *[w for s in sets for w in ("--set", s)], "--top", "3", "--steps", "4", "--tune-dir",
                 str(root), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads((root / "sweep.json").read_text())
    assert "--array=0-2%1" in record["array"]["submit_command"]
    res = json.loads((root / "tune-result.json").read_text())
    assert [row["state"] for row in res["rows"]] == ["COMPLETED"] * 3
    assert all(row["measured"]["step_time_s"] > 0 and row["predicted"]["step_time_s"] > 0 for row in res["rows"])
    fastest = min(res["rows"], key=lambda row: row["measured"]["step_time_s"])
    assert res["best"]["dir"] == fastest["dir"] and fastest["measured_rank"] == 1
    best = yaml.safe_load((root / "best.yaml").read_text())
    assert best["launcher"]["backend"] == "slurm" and trainctl("validate", str(root / "best.yaml")).returncode == 0

"""`trainctl launch recipes/tiny-moe-cpu.yaml` (TP 2 + SP x DP 2 with the experts over EP 2, ZeRO-1, 4 ranks):
one launch checked several ways: it trains and its loss falls, every step records its routing, the
parameters built are the planned ones, the measured memory is the planned memory, the EP all-to-all sends
what the planner counts, checkpoints record ep, and mfu-report shows the routing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_utils import trainctl
from paths import RECIPES

from trainctl.checkpoint import list_checkpoints
from trainctl.rundir.paths import RunPaths, read_jsonl
from trainctl.spec import load_spec

pytestmark = pytest.mark.slow

TINY_MOE = RECIPES / "tiny-moe-cpu.yaml"


def test_launch_tiny_moe_recipe(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = trainctl("launch", str(TINY_MOE), "--run-dir", str(run_dir), timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    paths = RunPaths(run_dir.resolve())
    spec = load_spec(paths.spec)
    metrics = read_jsonl(paths.metrics)
    assert [m["step"] for m in metrics] == list(range(1, spec.train.steps + 1))
    losses = [m["loss"] for m in metrics]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05, losses  # it learns
    assert "imbalance" in r.stdout  # the routing is on the console line

    # routing per step: every assignment counted once (16 sequences x 64 tokens x top-2 over 4 experts)
    for m in metrics:
        moe = m["moe"]
        assert moe["tokens_per_expert"]["mean"] == 16 * 64 * 2 / 4
        assert moe["imbalance"] >= 1.0 and moe["dropped"] == 0 and moe["aux_loss"] > 0 and moe["a2a_s"] > 0

    # the parameters built (experts gathered over the EP group) are the planned ones
    plan = json.loads(trainctl("plan", str(paths.spec), "--json").stdout)
    (start,) = [e for e in read_jsonl(paths.events) if e["event"] == "start"]
    assert start["params"] == {"total": plan["params"]["total"], "per_rank": plan["params"]["per_rank"]}
    assert start["ep"] == 2

    # the EP all-to-all: the planner counts (ep-1)/ep of every rank's dispatched rows leaving it (even
    # routing); the trainer measures the rows that really left. Per rank and step, bytes sent off-rank =
    # the plan's count with the measured share in place of (ep-1)/ep: same tokens per rank (s*b/tp under
    # SP), top_k copies, hidden x 4 bytes (fp32), 4 exchanges per layer and micro-batch, 4 layers, 2
    # micro-batches (tests/unit/test_moe_plan.py holds the plan's 1,048,576 bytes against a hand count).
    planned = plan["communication"]["per_kind"]["ep"]["bytes"]
    assert planned == 1_048_576
    for m in metrics:
        share = m["moe"]["a2a_off_rank"]
        assert 0 < share < 1
        assert m["moe"]["a2a_bytes"] == pytest.approx(planned * share / (1 / 2), rel=1e-12)

    # memory: model states as planned (up to bucket padding and AdamW's step counters), activations within 10%
    report = json.loads(trainctl("mfu-report", str(run_dir), "--json").stdout)["runs"][0]
    mem = report["memory"]
    assert mem["available"]
    for row in mem["rows"]:
        limit = 0.10 if row["component"] == "activations" else 0.01
        assert abs(row["error"]) <= limit, row

    # mfu-report: routing over the run and the all-to-all's share of the step
    routing = report["routing"]
    assert routing["available"] and routing["imbalance"]["median"] >= 1.0 and 0 < routing["a2a_share"] < 1
    assert any(i["name"] == "EP all-to-all (measured)" for i in report["time_breakdown"]["items"])
    text = trainctl("mfu-report", str(run_dir)).stdout
    assert "Mixture-of-experts routing" in text

    # checkpoints record ep in their layout
    saved = [c for c in list_checkpoints(paths.root / "checkpoints") if c.valid]
    assert saved and all(c.meta["layout"]["ep"] == 2 for c in saved)

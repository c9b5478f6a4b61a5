"""What a rank records as DP sync (`sync_s` in RUN/logs/steptimes-rank<r>.jsonl, mfu-report's "DP gradient sync"
row) is what the plan's DP time prices: under ZeRO-1 that includes the all-gather of the updated weights after
the optimizer step, which was counted as the rank's own compute (a ZeRO-1 run's report then blamed compute for a
third more time than predicted, and DP sync for less). The `slow_gather_s` fault makes that all-gather wait
0.3 s on every rank: each step's sync must hold it, a ZeRO-0 run (no all-gather) must not."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cli_utils import TRAINCTL
from spec_utils import write_spec
from trainer_utils import ROOT

from trainctl.runtime.train import faults

SLOW = 0.3


def step_records(run: Path, rank: int) -> list[dict]:
    lines = (run / "logs" / f"steptimes-rank{rank}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step" in r]


@pytest.mark.parametrize("zero", [1, 0])
def test_zeros_weight_all_gather_is_counted_as_dp_sync(tmp_path: Path, zero: int) -> None:
    spec = write_spec(tmp_path / "spec.yaml", {"parallel": {"dp": 2, "zero": zero}, "cluster": {"gpus_per_node": 2},
                                                "train": {"steps": 3}})
    run = tmp_path / "run"
    r = subprocess.run([*TRAINCTL, "launch", str(spec), "--run-dir", str(run)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, **faults.encode(slow_gather_s=SLOW)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for rank in (0, 1):
        steps = step_records(run, rank)
        assert len(steps) == 3
        for s in steps:
            assert s["step_s"] >= s["sync_s"] + s["comm_s"]  # the rank's own work stays what is left
        # ZeRO-1: the wait is in every step's sync (a sleep never ends early). ZeRO-0: one step's sync shorter
        # than the wait shows it is not there (it would be in every step), however slow a loaded host makes the
        # all-reduce of the others
        if zero == 1:
            assert all(s["sync_s"] >= SLOW for s in steps), steps
        else:
            assert min(s["sync_s"] for s in steps) < SLOW, steps

"""`trainctl preflight` with the local backend, as a user runs it: 2 CPU ranks on this machine (real torchrun
and gloo). What a user reads to trust the verdict: the ratio to three digits, the spread it was judged with,
and every window's measurement kept in the preflight's run directory. (The Slurm preflight, a slow node
named and excluded: tests/e2e/test_preflight_e2e.py.)"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from cli_utils import trainctl
from paths import REPO

from trainctl.launch.node_health import Thresholds, judge
from trainctl.runtime.workers.preflight import WINDOWS

pytestmark = pytest.mark.slow

TWO_RANKS = ["--set", "cluster.gpus_per_node=2", "--set", "parallel.tp=1", "--set", "parallel.pp=1",
             "--set", "parallel.dp=2"]


def test_local_preflight_shows_the_ratio_with_its_spread_and_keeps_every_window(tmp_path: Path) -> None:
    run_dir = tmp_path / "pf"
    r = trainctl("preflight", str(REPO / "recipes" / "tiny-cpu.yaml"), *TWO_RANKS, "--run-dir", str(run_dir),
                 cwd=tmp_path, env={"COLUMNS": "160", "PATH": str(Path(sys.executable).parent)}, inherit_env=False)
    assert r.returncode in (0, 1), r.stdout + r.stderr  # 1: this host's load made a rank clearly slower
    measured = json.loads((run_dir / "preflight.json").read_text())
    assert [len(rank["matmul_windows"]) for rank in measured["ranks"]] == [WINDOWS, WINDOWS]
    assert all(rank["matmul_flops"] == max(rank["matmul_windows"]) for rank in measured["ranks"])
    row = next(line for line in r.stdout.splitlines() if line.startswith("│ ") and "│ 2 " in line)
    verdict = judge(measured, Thresholds())[0]
    ratio, spread = verdict.matmul_ratio, verdict.matmul_spread
    shown = f"{ratio:.3f} ±{spread:.0%}" if spread else f"{ratio:.3f}"
    assert f"│ {shown} " in row, (shown, row)  # the verdict the table shows is the measurement's, 3 digits
    assert re.search(r"│ \d\.\d{3}", row)

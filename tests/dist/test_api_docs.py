"""docs/api.md's example runs as written (a real 1-rank launch through trainctl.api), and the API's plan is
`trainctl plan --json`'s."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_utils import trainctl
from paths import REPO

pytestmark = pytest.mark.slow

PAGE = REPO / "docs" / "api.md"


def example() -> str:
    (code,) = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    return code


def test_the_documented_example_runs(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", example()], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fits in memory: True" in r.stdout
    run = tmp_path / "runs" / "api-example"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert f"COMPLETED 4 loss {metrics[-1]['loss']:.4f}" in r.stdout  # the status is the run's own last step
    assert "4 steps measured; MFU median 0." in r.stdout


def test_plan_is_plan_json() -> None:
    sets = ["train.steps=4", "parallel.dp=auto"]
    r = trainctl("plan", *[w for s in sets for w in ("--set", s)], "--json")
    assert r.returncode == 0, r.stderr
    code = ("import json, sys, trainctl.api as tc\n"
            f"print(json.dumps(tc.plan(tc.load(overrides={sets!r}))))\n"
            "assert 'torch' not in sys.modules\n")
    api = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert api.returncode == 0, api.stderr
    assert json.loads(api.stdout) == json.loads(r.stdout)

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


def examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def run_example(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_the_page_has_its_examples() -> None:
    assert len(examples()) == 2  # a new example on the page needs its own checks below


def test_the_documented_example_runs(tmp_path: Path) -> None:
    r = run_example(examples()[0], tmp_path)
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


def test_the_sweep_and_tune_example_runs(tmp_path: Path) -> None:
    r = run_example(examples()[1], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "['COMPLETED', 'COMPLETED']" in r.stdout
    losses = [f"{read_last(tmp_path / 'runs' / 'api-sweep' / f'run-{i}')['loss']:.4f}" for i in (0, 1)]
    assert str(losses) in r.stdout  # each run's own last step
    result = json.loads((tmp_path / "runs" / "api-tune" / "tune-result.json").read_text())
    assert len(result["rows"]) == 2 and f"measured best: {result['best']['dir']} -> {result['written']}" in r.stdout


def read_last(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])

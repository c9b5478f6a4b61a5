"""What the trainer benchmarks share: run the bundled trainer on a spec under torchrun, read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def train_run(spec: dict[str, Any], run: Path, nproc: int, what: str) -> list[dict[str, Any]]:
    """Train `spec` in the new directory `run` on `nproc` local ranks (one OpenMP thread each); its
    metrics.jsonl records. Exits with the ranks' stderr when they fail."""
    run.mkdir(parents=True)
    (run / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "-m", "trainctl.runtime", str(run)],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{what} failed:\n{r.stderr[-3000:]}")
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

"""Benchmark: the planner's predicted step time against measured runs, for several layouts of one recipe.

Calibrates this machine once (`trainctl calibrate`), launches each layout of recipes/tiny-cpu.yaml for a few
steps (`trainctl launch`, every layout on the same 8 ranks), and prints the plan's predicted step time with
the micro-benchmark profile next to the measured median step time (steps after the first two), and the
relative error. With --refit, also the prediction from a profile refitted from the first layout's run
(`trainctl calibrate --from-run`, links from the micro-benchmark profile): does one run's rate carry over?

    .venv/bin/python bench/bench_prediction.py [--steps 8] [--refit] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-cpu.yaml")

# name -> --set overrides of the tiny recipe (8 ranks: global batch 16, micro-batch 2)
LAYOUTS: dict[str, list[str]] = {
    "TP2 x PP2 x DP2 (recipe)": [],
    "DP8": ["parallel.tp=1", "parallel.pp=1", "parallel.dp=8", "parallel.zero=0", "parallel.sequence_parallel=false"],
    "DP8 ZeRO-1": ["parallel.tp=1", "parallel.pp=1", "parallel.dp=8", "parallel.zero=1",
                   "parallel.sequence_parallel=false"],
    "DP8 ZeRO-3": ["parallel.tp=1", "parallel.pp=1", "parallel.dp=8", "parallel.zero=3",
                   "parallel.sequence_parallel=false"],
    "TP2+SP x DP4": ["parallel.tp=2", "parallel.pp=1", "parallel.dp=4", "parallel.sequence_parallel=true"],
    "PP2 1F1B x DP4": ["parallel.tp=1", "parallel.pp=2", "parallel.dp=4", "parallel.sequence_parallel=false"],
    "PP2 interleaved v2 x DP4": ["parallel.tp=1", "parallel.pp=2", "parallel.dp=4", "parallel.schedule=interleaved",
                                 "parallel.virtual_stages=2", "parallel.sequence_parallel=false"],
    "PP2 GPipe x DP4": ["parallel.tp=1", "parallel.pp=2", "parallel.dp=4", "parallel.schedule=gpipe",
                        "parallel.sequence_parallel=false"],
}


def trainctl(*args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "trainctl", *args], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"trainctl {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def sets(overrides: list[str]) -> list[str]:
    return [w for o in overrides for w in ("--set", o)]


def predicted(overrides: list[str], profile: Path) -> float:
    j = json.loads(trainctl("plan", TINY, "--json", "--calibration", str(profile), *sets(overrides)).stdout)
    return float(j["prediction"]["step_time_s"])


def measured(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step_time_s"] for r in rows if isinstance(r.get("step"), int)]
    return statistics.median(steps[2:] or steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--refit", action="store_true", help="also predict from a profile refitted from the first run")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-prediction-"))
    profile = work / "profile.json"
    t0 = time.perf_counter()
    trainctl("calibrate", TINY, "--out", str(profile), "--run-dir", str(work / "calibrate"))
    print(f"calibrated in {time.perf_counter() - t0:.1f} s: {profile}")
    results: list[dict[str, Any]] = []
    for i, (name, overrides) in enumerate(LAYOUTS.items()):
        run = work / f"run-{i}"
        trainctl("launch", TINY, "--run-dir", str(run), "--set", f"train.steps={args.steps}", *sets(overrides))
        results.append({"layout": name, "overrides": overrides, "run": str(run),
                        "predicted_s": predicted(overrides, profile), "measured_s": measured(run)})
        print(f"  {name}: measured {results[-1]['measured_s'] * 1e3:.1f} ms", flush=True)
    cols = ["predicted"]
    if args.refit:
        refit = work / "refit.json"
        trainctl("calibrate", "--from-run", results[0]["run"], "--base", str(profile), "--out", str(refit))
        for r in results:
            r["refit_s"] = predicted(r["overrides"], refit)
        cols.append(f"refit from {results[0]['layout']}")
    print(f"\ncpus {os.cpu_count()}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{args.steps} steps per run, median of steps 3..{args.steps}")
    head = f"{'layout':28} {'measured':>10} {'predicted':>10} {'error':>8}"
    if args.refit:
        head += f" {'refit':>10} {'error':>8}"
    print(head)
    for r in results:
        line = (f"{r['layout']:28} {r['measured_s'] * 1e3:8.1f}ms {r['predicted_s'] * 1e3:8.1f}ms "
                f"{r['predicted_s'] / r['measured_s'] - 1:+8.0%}")
        if args.refit:
            line += f" {r['refit_s'] * 1e3:8.1f}ms {r['refit_s'] / r['measured_s'] - 1:+8.0%}"
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"profile": str(profile), "results": results, "columns": cols}, indent=1))


if __name__ == "__main__":
    main()

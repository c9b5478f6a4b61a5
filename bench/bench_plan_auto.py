"""Benchmark: `trainctl plan --auto` on the Llama 3 405B recipe (16,384 H100s) as a whole process.

Target: under 1 s wall time on a 2-core machine. Each run is a fresh `python -m trainctl`
process, so the figure includes interpreter start-up and every import, as a user sees it; the
`trainctl --help` time beside it is the floor that start-up alone costs.

    .venv/bin/python bench/bench_plan_auto.py [--repeats 7] [--spec recipes/llama3-405b.yaml]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Used when recipes/llama3-405b.yaml is missing: the Llama 3 paper's 405B run, 2048 nodes x 8 H100 SXM.
FALLBACK_SPEC = """\
name: llama3-405b-bench
model: {preset: llama3-405b}
parallel: {tp: 8, pp: 16, dp: auto, zero: 1, sequence_parallel: true, micro_batch: 1,
           schedule: interleaved, virtual_stages: 2}
train: {global_batch: 2048, steps: 1000, precision: bf16, recompute: full}
data: {synthetic: true}
cluster: {nodes: 2048, gpus_per_node: 8, gpu: h100-sxm, interconnect: ndr}
launcher: {backend: slurm}
"""


def wall(cmd: list[str], cpu: list[float] | None = None) -> float:
    """Wall seconds of one run; its CPU seconds (user + sys, which other load barely changes) go to `cpu`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}")
    if cpu is not None:
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--spec", default=str(ROOT / "recipes" / "llama3-405b.yaml"))
    args = ap.parse_args()

    spec = Path(args.spec)
    if not spec.exists():
        spec = Path(tempfile.mkdtemp()) / "llama3-405b-bench.yaml"
        spec.write_text(FALLBACK_SPEC)
        print(f"{args.spec} not found; using a built-in 405B spec at 16,384 H100s")

    py = sys.executable
    auto = [py, "-m", "trainctl", "plan", "--auto", str(spec)]
    helpcmd = [py, "-m", "trainctl", "--help"]
    info = json.loads(subprocess.run([*auto, "--json"], cwd=ROOT, capture_output=True, text=True,
                                     check=True).stdout)
    wall(auto)  # warm the file cache and .pyc files once
    wall(helpcmd)
    runs_auto, runs_help, cpu_auto, cpu_help = [], [], [], []
    for _ in range(args.repeats):  # interleaved, so load changes hit both alike
        runs_auto.append(wall(auto, cpu_auto))
        runs_help.append(wall(helpcmd, cpu_help))

    med_auto, med_help = statistics.median(runs_auto), statistics.median(runs_help)
    print(f"spec: {spec} ({info['world_size']:,} GPUs), {info['evaluated']:,} layouts evaluated, "
          f"{info['fitting']:,} fit; search itself {info['elapsed_s'] * 1e3:.0f} ms in-process")
    print(f"cpus: {os.cpu_count()}, load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'command':24} {'median':>8} {'min':>8} {'max':>8} {'cpu':>8}   (wall seconds, {args.repeats} runs "
          "each; cpu = median user+sys seconds)")
    print(f"{'trainctl plan --auto':24} {med_auto:8.3f} {min(runs_auto):8.3f} {max(runs_auto):8.3f} "
          f"{statistics.median(cpu_auto):8.3f}")
    print(f"{'trainctl --help':24} {med_help:8.3f} {min(runs_help):8.3f} {max(runs_help):8.3f} "
          f"{statistics.median(cpu_help):8.3f}")
    verdict = "meets" if med_auto < 1.0 else "MISSES"
    print(f"target < 1 s for plan --auto: {verdict} ({med_auto:.3f} s median)")


if __name__ == "__main__":
    main()

"""Benchmark: the planner's predicted step time against measured runs, 10 layouts of two model sizes.

For each model size (recipes/tiny-cpu.yaml as shipped, hidden 64; and the same at hidden 256) and each rank
count the layouts use, calibrates the cluster once (`trainctl calibrate` with that size and those ranks: the
profile must describe the ranks it prices), launches each layout for a few steps (`trainctl launch`) and
prints the plan's predicted step time (`plan --calibration`) next to the measured median step time (steps
after the first two) and the relative error, with the 1-minute load average when the run ended and rank 0's
median CPU seconds per step (on a machine shared with other work, wall time minus CPU time is time off-core).

Each layout runs --repeats times (3 by default), in rounds (every layout of a calibration once, then again),
so that a slow minute of the host hits single runs of several layouts rather than all of one: its measured
step is the median of the runs' medians, its spread (max - min) / median over the runs, and it counts as
predicted when the error is within 10% or within its own spread, whichever is larger; per model size the mean
absolute error and the worst are printed.
Beside each, "held": the step as it would have been at the host speed calibrate saw, each run's step scaled by
a one-second GEMM probe's time around calibrate over its time around the run (HOST_PROBE): how much of an
error is the host running faster or slower than when it was calibrated, and how much is the model.

Rank counts: every layout that two ranks can express runs on two (DP, ZeRO-1, ZeRO-3, TP+SP, the three
pipeline schedules, context parallelism CP2, and the MoE model with its experts split EP2 over DP2, priced
from the dense model's profile: one profile per machine, the plan's "another model" extrapolation): one rank
per core on the 2-core machines here, as one rank per GPU on a cluster;
TP x PP x DP needs eight, so it runs oversubscribed here and its profile is measured oversubscribed too.
With --slurm, two layouts more (DP ZeRO-1 and PP 1F1B) run across the two nodes of the local Slurm cluster
(`slurm/local-cluster.sh up`), one rank per node, calibrated through Slurm too. With --refit, also the
prediction from a profile refitted from each group's first run (`trainctl calibrate --from-run`, links
from the micro-benchmark profile): does one run's rate carry over to the other layouts?

    .venv/bin/python bench/bench_prediction.py [--steps 8] [--sizes h64,h256] [--slurm] [--refit] [--json F]
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-cpu.yaml")

# model sizes: --set overrides of the tiny recipe's model (h64 is the recipe itself)
SIZES: dict[str, list[str]] = {
    "h64": [],
    "h256": ["model.hidden=256", "model.ffn_hidden=1024", "model.heads=8"],
}
ONE_D = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "parallel.sequence_parallel=false", "parallel.zero=1"]


@dataclass(frozen=True)
class Cluster:
    """Where a layout runs; one calibration per (model size, cluster)."""

    name: str
    overrides: tuple[str, ...]


LOCAL2 = Cluster("local, 2 ranks", ("cluster.nodes=1", "cluster.gpus_per_node=2", "launcher.backend=local"))
LOCAL8 = Cluster("local, 8 ranks", ("cluster.nodes=1", "cluster.gpus_per_node=8", "launcher.backend=local"))
SLURM2 = Cluster("Slurm, 2 nodes x 1", ("cluster.nodes=2", "cluster.gpus_per_node=1", "launcher.backend=slurm",
                                        "launcher.mode=srun"))


@dataclass
class Layout:
    name: str
    cluster: Cluster
    overrides: list[str] = field(default_factory=list)


LOCAL_LAYOUTS = [
    Layout("DP2", LOCAL2, [*ONE_D, "parallel.dp=2", "parallel.zero=0"]),
    Layout("DP2 ZeRO-1", LOCAL2, [*ONE_D, "parallel.dp=2", "parallel.zero=1"]),
    Layout("DP2 ZeRO-3", LOCAL2, [*ONE_D, "parallel.dp=2", "parallel.zero=3"]),
    Layout("TP2+SP", LOCAL2, [*ONE_D, "parallel.tp=2", "parallel.sequence_parallel=true"]),
    Layout("PP2 1F1B", LOCAL2, [*ONE_D, "parallel.pp=2"]),
    Layout("PP2 interleaved v2", LOCAL2, [*ONE_D, "parallel.pp=2", "parallel.schedule=interleaved",
                                          "parallel.virtual_stages=2"]),
    Layout("PP2 GPipe", LOCAL2, [*ONE_D, "parallel.pp=2", "parallel.schedule=gpipe"]),
    Layout("CP2", LOCAL2, [*ONE_D, "parallel.cp=2"]),
    Layout("MoE EP2 x DP2", LOCAL2, [*ONE_D, "parallel.dp=2", "parallel.ep=2", "model.preset=tiny-moe",
                                     "model.moe.expert_ffn_hidden=384"]),
    Layout("TP2+SP x PP2 x DP2", LOCAL8, []),  # the recipe's own layout
]
SLURM_LAYOUTS = [
    Layout("DP2 ZeRO-1 (2 nodes)", SLURM2, [*ONE_D, "parallel.dp=2"]),
    Layout("PP2 1F1B (2 nodes)", SLURM2, [*ONE_D, "parallel.pp=2"]),
]


def trainctl(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "trainctl", *args], capture_output=True, text=True, cwd=ROOT,
                         timeout=timeout)
    if out.returncode != 0:
        sys.exit(f"trainctl {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def sets(*overrides: list[str] | tuple[str, ...]) -> list[str]:
    return [w for group in overrides for o in group for w in ("--set", o)]


def predicted(overrides: list[str], profile: Path) -> float:
    j = json.loads(trainctl("plan", TINY, "--json", "--calibration", str(profile), *overrides).stdout)
    return float(j["prediction"]["step_time_s"])


def wait_until_done(run: Path, timeout: float = 900) -> None:
    """A Slurm launch returns once the job is submitted: follow `trainctl status` until it ends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = json.loads(trainctl("status", str(run), "--json").stdout)["state"]
        if state == "COMPLETED":
            return
        if state in ("FAILED", "CANCELLED", "DIVERGED", "STOPPED"):
            sys.exit(f"{run}: {state}; see `trainctl logs {run}`")
        time.sleep(1.0)
    sys.exit(f"{run}: not done after {timeout:.0f} s")


def measured(run: Path) -> tuple[float, float]:
    """(median step time, rank 0's median CPU seconds per step) over the steps after the first two. On a
    shared machine the CPU time shows how much of the wall time the ranks were on a core."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if isinstance(r.get("step"), int)]
    rows = rows[2:] or rows
    return (statistics.median(r["step_time_s"] for r in rows),
            statistics.median(r.get("cpu_time_s", 0.0) for r in rows))


# The host's speed now: the h256 model's MLP GEMM on one thread, for a second, in one process per core at once.
# A 2-core VM's cores run the same work 10-20% faster or slower from one minute to the next (DP2 launched five
# times in a row: 198-237 ms a step, its CPU seconds per step moving with it, no steal time); this probe moved
# with it (the slowest launch had the slowest probe), so the bench can say which part of an error is the host.
HOST_PROBE = """
import time, torch
torch.set_num_threads(1)
a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
for _ in range(5):
    a @ b
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < 1.0:
    a @ b
    n += 1
print((time.perf_counter() - t0) / n)
"""


def host_speed() -> float:
    """Seconds per probe GEMM, the mean over one process per core running at once (HOST_PROBE)."""
    procs = [subprocess.Popen([sys.executable, "-c", HOST_PROBE], stdout=subprocess.PIPE, text=True)
             for _ in range(os.cpu_count() or 1)]
    return statistics.mean(float(p.communicate()[0]) for p in procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="launches of each layout (the spread is theirs)")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--slurm", action="store_true", help="also two layouts across the local Slurm cluster's nodes")
    ap.add_argument("--refit", action="store_true", help="also predict from a profile refitted from a run")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args()
    layouts = LOCAL_LAYOUTS + (SLURM_LAYOUTS if args.slurm else [])
    work = Path(tempfile.mkdtemp(prefix="bench-prediction-"))
    results: list[dict[str, Any]] = []
    for size in args.sizes.split(","):
        for cluster in dict.fromkeys(la.cluster for la in layouts):
            base = sets(SIZES[size], cluster.overrides)
            group = f"{size}-{len(results)}"
            profile = work / f"profile-{group}.json"
            mine = [la for la in layouts if la.cluster == cluster]
            t0 = time.perf_counter()  # a valid spec on these ranks: the group's first layout
            before = host_speed()
            trainctl("calibrate", TINY, *base, *sets(mine[0].overrides), "--out", str(profile),
                     "--run-dir", str(work / f"calibrate-{group}"))
            speed_calibrated = (before + host_speed()) / 2
            print(f"{size}, {cluster.name}: calibrated in {time.perf_counter() - t0:.1f} s", flush=True)
            first_run: Path | None = None
            figures: dict[str, dict[str, list[Any]]] = {la.name: {"runs": [], "walls": [], "cpus": [], "held": []}
                                                         for la in mine}
            # in rounds, each layout once a round: a slow minute of the host lands on single runs of several
            # layouts, not on every run of one, so each layout's spread shows it and its median drops it
            first = len(results)
            for i in range(args.repeats):
                for k, layout in enumerate(mine):
                    run = work / f"run-{first + k}-{i}"
                    before = host_speed()
                    trainctl("launch", TINY, "--run-dir", str(run), "--set", f"train.steps={args.steps}", *base,
                             *sets(layout.overrides))
                    if "launcher.backend=slurm" in cluster.overrides:
                        wait_until_done(run)
                    speed = (before + host_speed()) / 2
                    wall, cpu = measured(run)
                    got = figures[layout.name]
                    got["runs"].append(run)
                    got["walls"].append(wall)
                    got["cpus"].append(cpu)
                    got["held"].append(wall * speed_calibrated / speed)
            for layout in mine:
                overrides = [*base, *sets(layout.overrides)]
                got = figures[layout.name]
                runs, walls, cpus, at_calibration_speed = got["runs"], got["walls"], got["cpus"], got["held"]
                run = runs[0]
                wall, held = statistics.median(walls), statistics.median(at_calibration_speed)
                r = {"size": size, "layout": layout.name, "cluster": cluster.name, "runs": [str(x) for x in runs],
                     "predicted_s": predicted(overrides, profile), "measured_s": wall, "measured_runs_s": walls,
                     "spread": (max(walls) - min(walls)) / wall, "cpu_s": statistics.median(cpus),
                     "load1": os.getloadavg()[0],
                     # the step as it would have been at the host speed calibrate saw (HOST_PROBE)
                     "at_calibration_speed_s": held, "at_calibration_speed_runs_s": at_calibration_speed,
                     "at_calibration_speed_spread": (max(at_calibration_speed) - min(at_calibration_speed)) / held}
                if args.refit:
                    first_run = first_run or run
                    refit = work / f"refit-{group}.json"
                    if first_run == run:
                        trainctl("calibrate", "--from-run", str(run), "--base", str(profile), "--out", str(refit))
                    r["refit_s"] = predicted(overrides, refit)
                results.append(r)
                print(f"  {size} {layout.name}: measured {r['measured_s'] * 1e3:.1f} ms (spread "
                      f"{r['spread']:.0%}), predicted {r['predicted_s'] * 1e3:.1f} ms", flush=True)
    print(f"\ncpus {os.cpu_count()}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{args.steps} steps per run, median of steps 3..{args.steps}, {args.repeats} runs per layout")
    head = (f"{'size':5} {'layout':22} {'ranks':20} {'load1':>5} {'cpu':>8} {'measured':>10} {'spread':>6} "
            f"{'predicted':>10} {'error':>7} {'held':>10} {'spread':>6} {'error':>7}")
    print("held: the measured step at the host speed calibrate saw (each run scaled by HOST_PROBE's ratio)")
    print(head + (f" {'refit':>10} {'error':>7}" if args.refit else ""))
    for r in results:
        line = (f"{r['size']:5} {r['layout']:22} {r['cluster']:20} {r['load1']:5.1f} {r['cpu_s'] * 1e3:6.1f}ms "
                f"{r['measured_s'] * 1e3:8.1f}ms {r['spread']:6.0%} "
                f"{r['predicted_s'] * 1e3:8.1f}ms {r['predicted_s'] / r['measured_s'] - 1:+7.0%} "
                f"{r['at_calibration_speed_s'] * 1e3:8.1f}ms {r['at_calibration_speed_spread']:6.0%} "
                f"{r['predicted_s'] / r['at_calibration_speed_s'] - 1:+7.0%}")
        if args.refit:
            line += f" {r['refit_s'] * 1e3:8.1f}ms {r['refit_s'] / r['measured_s'] - 1:+7.0%}"
        print(line)
    for size in dict.fromkeys(r["size"] for r in results):
        mine = [r for r in results if r["size"] == size]
        errors = [r["predicted_s"] / r["measured_s"] - 1 for r in mine]
        within = sum(abs(e) <= max(0.10, r["spread"]) for e, r in zip(errors, mine, strict=True))
        worst = max(zip(errors, mine, strict=True), key=lambda er: abs(er[0]))
        print(f"{size}: mean absolute error {statistics.mean(map(abs, errors)):.1%}, worst {worst[0]:+.0%} "
              f"({worst[1]['layout']}); {within} of {len(mine)} within 10% or their own spread")
        held = [r["predicted_s"] / r["at_calibration_speed_s"] - 1 for r in mine]
        within = sum(abs(e) <= max(0.10, r["at_calibration_speed_spread"]) for e, r in zip(held, mine, strict=True))
        worst = max(zip(held, mine, strict=True), key=lambda er: abs(er[0]))
        print(f"{size}, held at calibrate's host speed: mean absolute error {statistics.mean(map(abs, held)):.1%}, "
              f"worst {worst[0]:+.0%} ({worst[1]['layout']}); {within} of {len(mine)} within 10% or their spread")
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=1))


if __name__ == "__main__":
    main()

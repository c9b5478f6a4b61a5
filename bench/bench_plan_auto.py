"""Benchmark: how fast the CLI starts, as whole processes side by side: the bare import of typer, rich and
pydantic (the floor any typer + pydantic CLI pays); a one-command typer app with one path argument (typer 0.29
converts a command's arguments through pydantic, so this is the floor of any typer command that takes a
spec); the same app validating a one-field pydantic model from that YAML file (the floor of any typer +
pydantic command that reads a file: what `plan` pays before it reads a single field of the spec); `trainctl
--help`; `trainctl validate` (what any command that reads a spec pays); `trainctl plan` of the Llama 3 405B
recipe (16,384 H100s), its `plan --auto`, and the node-count sweep `plan --auto --nodes 256..16384` (64
geometric node counts, each searched for its best layout); then, in this process, the search's candidates per
second: `plan --auto`'s exhaustive scoring and the pruned best-layout search the sweep runs at each count.

Each run is a fresh process, so the figures include interpreter start-up and every import, as a user sees
them; runs are interleaved so load changes hit all alike, and the ratios are of CPU time (user + sys), which
other load barely changes. Targets: --help at most 1.3x the bare import, plan at most 1.3x --help, plan --auto
at most 1.5x --help, the 64-count sweep at most 3x plan --auto.

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
# The least a typer command with one path argument pays (typer converts its arguments through pydantic), and
# the least one that also reads that YAML file into a pydantic model pays: no trainctl code in either.
TYPER_FLOOR = """
from pathlib import Path
import typer


def main(spec: Path) -> None:
    print(spec)


typer.run(main)
"""
READ_FLOOR = """
from pathlib import Path
import pydantic, typer, yaml


class Spec(pydantic.BaseModel):
    name: str


def main(spec: Path) -> None:
    print(Spec.model_validate(yaml.load(spec.read_text(), Loader=yaml.CSafeLoader)).name)


typer.run(main)
"""

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


def candidates_per_second(spec: Path) -> str:
    """In this process: plan --auto's exhaustive scoring and the pruned best-layout search, candidates per second
    of the enumerated ones (the pruned search scores fewer; its rate counts every candidate it settled)."""
    sys.path.insert(0, str(ROOT))
    from trainctl.plan.auto import best_layout, enumerate_candidates, search, search_context
    from trainctl.plan.estimate import Evaluator
    from trainctl.spec.loader import load_spec

    run = load_spec(spec)
    t0 = time.process_time()
    full = search(run)
    t_full = time.process_time() - t0
    t0 = time.process_time()
    _, scored = best_layout(run, Evaluator(search_context(run)[0]))  # enumerates the layout shapes itself
    t_best = time.process_time() - t0
    cands = enumerate_candidates(run, {})
    return (f"candidates per CPU second: exhaustive {full.evaluated / t_full:,.0f} ({full.evaluated:,} in "
            f"{t_full:.2f} s), pruned {len(cands) / t_best:,.0f} ({scored:,} of {len(cands):,} scored in "
            f"{t_best:.2f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--spec", default=str(ROOT / "recipes" / "llama3-405b.yaml"))
    ap.add_argument("--nodes", default="256..16384", help="the sweep's node range (64 counts by default)")
    args = ap.parse_args()

    spec = Path(args.spec)
    if not spec.exists():
        spec = Path(tempfile.mkdtemp()) / "llama3-405b-bench.yaml"
        spec.write_text(FALLBACK_SPEC)
        print(f"{args.spec} not found; using a built-in 405B spec at 16,384 H100s")

    py = sys.executable
    commands = {
        "import typer+rich+pydantic": [py, "-c", "import typer, rich, pydantic"],
        "typer one-argument floor": [py, "-c", TYPER_FLOOR, str(spec)],
        "typer+pydantic read floor": [py, "-c", READ_FLOOR, str(spec)],
        "trainctl --help": [py, "-m", "trainctl", "--help"],
        # what any command that reads a spec pays: typer's parsing of a command's options (it builds a pydantic
        # adapter per option), the spec's pydantic models, YAML; plan adds the planner and its tables to this
        "trainctl validate": [py, "-m", "trainctl", "validate", str(spec)],
        "trainctl plan": [py, "-m", "trainctl", "plan", str(spec)],
        "trainctl plan --auto": [py, "-m", "trainctl", "plan", "--auto", str(spec)],
        "plan --auto --nodes (sweep)": [py, "-m", "trainctl", "plan", "--auto", str(spec), "--nodes", args.nodes],
    }
    info = json.loads(subprocess.run([*commands["trainctl plan --auto"], "--json"], cwd=ROOT, capture_output=True,
                                     text=True, check=True).stdout)
    swept = json.loads(subprocess.run([*commands["plan --auto --nodes (sweep)"], "--json"], cwd=ROOT,
                                      capture_output=True, text=True, check=True).stdout)
    for cmd in commands.values():  # warm the file cache and .pyc files once
        wall(cmd)
    walls: dict[str, list[float]] = {name: [] for name in commands}
    cpus: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeats):
        for name, cmd in commands.items():
            walls[name].append(wall(cmd, cpus[name]))

    print(f"spec: {spec} ({info['world_size']:,} GPUs), {info['evaluated']:,} layouts evaluated, "
          f"{info['fitting']:,} fit; search itself {info['elapsed_s'] * 1e3:.0f} ms in-process")
    print(f"sweep {args.nodes}: {len(swept['points'])} node counts with a layout, {len(swept['no_layout'])} without; "
          f"{swept['candidates_scored']:,} of {swept['candidates']:,} layouts scored; answer "
          f"{swept['answer']['nodes']:,} nodes; {swept['elapsed_s']:.2f} s in-process")
    print(candidates_per_second(spec))
    print(f"cpus: {os.cpu_count()}, load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'command':28} {'median':>8} {'min':>8} {'max':>8} {'cpu':>8}   (wall seconds, {args.repeats} runs "
          "each; cpu = median user+sys seconds)")
    cpu = {name: statistics.median(v) for name, v in cpus.items()}
    for name, runs in walls.items():
        print(f"{name:28} {statistics.median(runs):8.3f} {min(runs):8.3f} {max(runs):8.3f} {cpu[name]:8.3f}")
    for what, name in (("typer floor / --help", "typer one-argument floor"),
                       ("read floor / --help", "typer+pydantic read floor")):
        floor = cpu[name] / cpu["trainctl --help"]
        reads = "" if name.startswith("typer one") else "and reads it "
        print(f"{what:28} {floor:6.2f}x CPU  (no typer command that takes a spec {reads}can start below this: "
              f"plan's 1.3x is {'within' if floor <= 1.3 else 'beyond'} reach)")
    for what, num, den, target in (("--help / bare import", "trainctl --help", "import typer+rich+pydantic", 1.3),
                                   ("plan / --help", "trainctl plan", "trainctl --help", 1.3),
                                   ("plan / read floor", "trainctl plan", "typer+pydantic read floor", None),
                                   ("plan --auto / --help", "trainctl plan --auto", "trainctl --help", 1.5),
                                   ("sweep / plan --auto", "plan --auto --nodes (sweep)", "trainctl plan --auto", 3.0)):
        ratio = cpu[num] / cpu[den]
        verdict = "no target" if target is None else f"target <= {target}x: {'meets' if ratio <= target else 'MISSES'}"
        print(f"{what:28} {ratio:6.2f}x CPU  ({verdict})")
    for what, num in (("plan - validate", "trainctl plan"), ("plan --auto - validate", "trainctl plan --auto")):
        print(f"{what:28} {(cpu[num] - cpu['trainctl validate']) * 1e3:6.0f} ms CPU  (what planning adds to "
              "reading the spec)")


if __name__ == "__main__":
    main()

"""Pipeline schedules side by side: step time of 1F1B, interleaved 1F1B, interleaved zero-bubble and ZBV at PP=2
and PP=4, on one model and batch, with the planner's bubble for each.

Zero-bubble (Qi et al. 2023) splits each backward into an input-gradient pass (on the critical path) and a
weight-gradient pass that fills what would be the bubble. Interleaved is the fair baseline for it: both run
2 model chunks per rank here, so the difference is the split backward alone. ZBV also runs 2 chunks per rank,
placed in a V (rank r: stages r and 2*pp-1-r). On this 2-core machine PP=4
runs 4 ranks on 2 cores, so its step times carry contention; each rank's own CPU time per step is printed
beside them (less disturbed by other load). Ratios are measured in one run, side by side, schedules
alternated per repetition.

    .venv/bin/python bench/bench_pipeline_schedules.py                 # hidden 256, 8 layers, 8 micro-batches
    .venv/bin/python bench/bench_pipeline_schedules.py --pp 2 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchlib import ROOT, train_run  # bench/ is sys.path[0]: the script's own directory

sys.path.insert(0, str(ROOT))
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zero-bubble", 2), ("zbv", 2))  # (schedule, model chunks per rank)


def make_spec(a: argparse.Namespace, pp: int, schedule: str, chunks: int) -> dict:
    return {
        "name": f"bench-pp{pp}-{schedule}",
        "model": {"layers": a.layers, "hidden": a.hidden, "heads": 4, "vocab": 256, "seq_len": a.seq,
                  "norm": "rmsnorm", "position": "rope", "activation": "swiglu", "tied_embeddings": False},
        "parallel": {"tp": 1, "pp": pp, "dp": 1, "micro_batch": 1, "schedule": schedule, "virtual_stages": chunks},
        "train": {"global_batch": a.micro_batches, "steps": a.steps, "lr": 3e-4, "warmup": 1, "precision": "fp32",
                  "seed": 1},
        "data": {"synthetic": True},
        "cluster": {"nodes": 1, "gpus_per_node": pp, "gpu": "cpu"},
        "launcher": {"backend": "local"},
    }


def train(a: argparse.Namespace, pp: int, schedule: str, chunks: int, run: Path) -> dict:
    from trainctl.plan.plan import build_plan
    from trainctl.spec.loader import validate_spec

    spec = make_spec(a, pp, schedule, chunks)
    recs = train_run(spec, run, pp, f"pp{pp} {schedule}")
    steps = recs[2:] or recs  # the first steps also run start-up work
    plan = build_plan(validate_spec(spec)).to_json()["pipeline"]
    return {"step_s": statistics.median(x["step_time_s"] for x in steps),
            "cpu_s": statistics.median(x["cpu_time_s"] for x in steps),
            "bubble": plan["bubble_fraction"], "loss": recs[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    results: dict[tuple[int, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for pp in a.pp:
                order = SCHEDULES if rep % 2 == 0 else tuple(reversed(SCHEDULES))
                for schedule, chunks in order:
                    run = Path(tmp) / f"r{rep}-pp{pp}-{schedule}"
                    results.setdefault((pp, schedule), []).append(train(a, pp, schedule, chunks, run))
    print(f"model: {a.layers} layers, hidden {a.hidden}, seq {a.seq}; {a.micro_batches} micro-batches; "
          f"median of {a.reps} runs x {max(1, a.steps - 2)} steps")
    print(f"{'pp':>3} {'schedule':<12} {'step':>9} {'cpu/step':>9} {'vs 1f1b':>8} {'vs interleaved':>15} "
          f"{'planned bubble':>15} {'final loss':>11}")
    for pp in a.pp:
        med = {s: statistics.median(r["step_s"] for r in results[(pp, s)]) for s, _ in SCHEDULES}
        for s, _ in SCHEDULES:
            rs = results[(pp, s)]
            print(f"{pp:>3} {s:<12} {med[s] * 1e3:>7.1f}ms "
                  f"{statistics.median(r['cpu_s'] for r in rs) * 1e3:>7.1f}ms {med[s] / med['1f1b']:>8.2f} "
                  f"{med[s] / med['interleaved']:>15.2f} {rs[0]['bubble']:>14.1%} {rs[-1]['loss']:>11.4f}")


if __name__ == "__main__":
    main()

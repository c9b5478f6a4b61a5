"""ZeRO stages and precisions side by side on the tiny recipe's model: step time and bytes per parameter.

Each layout is a real trainer run (torchrun, gloo, one thread per rank) of the tiny model at dp = 2 with
several micro-batches per replica; rounds alternate the layouts (and the baseline tree, if given), and the
best median of each is kept, since a busy shared machine slows whichever runs at the time. Prints, per
layout, the median step time and CPU time per rank, their ratio to ZeRO-0 in the same precision, the model
states the trainer measured (bytes per parameter), and with --baseline the same layout run from another
source tree (e.g. `git worktree add /tmp/base main`) with the new/old ratio.

    .venv/bin/python bench/bench_zero.py
    .venv/bin/python bench/bench_zero.py --baseline /tmp/base --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [(zero, prec) for prec in ("fp32", "bf16") for zero in (0, 1, 2, 3)]


def make_spec(a: argparse.Namespace, zero: int, precision: str) -> dict:
    return {
        "name": "bench-zero",
        "model": {"preset": "tiny"},
        "parallel": {"tp": 1, "pp": 1, "dp": a.dp, "zero": zero, "micro_batch": a.micro_batch},
        "train": {"global_batch": a.global_batch, "steps": a.steps, "lr": 1e-3, "warmup": 2, "precision": precision,
                  "low_precision_on_cpu": precision != "fp32", "seed": 1, "grad_clip": 1.0},
        "data": {"synthetic": True},
        "cluster": {"nodes": 1, "gpus_per_node": a.dp, "gpu": "cpu"},
    }


def run(tree: Path, spec: dict, tmp: Path, a: argparse.Namespace) -> dict:
    """One trainer run from source tree `tree`: medians over the steps after the warm-up, and the memory line."""
    run_dir = tmp / "run"
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir()
    (run_dir / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree), "TRAINCTL_BUCKET_NUMEL": str(a.bucket_numel)}
    torchrun = str(Path(sys.executable).parent / "torchrun")
    r = subprocess.run([torchrun, "--standalone", f"--nproc-per-node={a.dp}", "-m", "trainctl.runtime", str(run_dir)],
                       cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"trainer failed ({tree}):\n{r.stderr[-3000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = next(json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
                 if json.loads(line)["event"] == "start")
    mem = next((x["memory"]["max"] for x in recs if "memory" in x), None)
    w = a.warmup_steps
    return {"step": statistics.median(x["step_time_s"] for x in recs[w:]),
            "cpu": statistics.median(x["cpu_time_s"] for x in recs[w:]),
            "params": start["params"]["per_rank"][0], "memory": mem, "loss": recs[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=16, help="micro-batches per replica: global/(mb*dp)")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup-steps", type=int, default=4, help="steps left out of the medians")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best median is kept")
    ap.add_argument("--bucket-numel", type=int, default=20000,
                    help="DP bucket size: several buckets in the tiny model, as on a real one (ZeRO-2's two bucket "
                         "buffers are then small beside the model, not two copies of it)")
    ap.add_argument("--baseline", type=Path, help="another source tree to run the same layouts from")
    ap.add_argument("--layouts", default=",".join(f"{z}:{p}" for z, p in LAYOUTS),
                    help="ZERO:PRECISION,... (ZeRO-0 of a precision always runs: the ratios' reference)")
    a = ap.parse_args()
    wanted = [(int(z), p) for z, p in (x.split(":") for x in a.layouts.split(","))]
    layouts = [(z, p) for z, p in LAYOUTS if (z, p) in wanted or (z == 0 and any(q == p for _, q in wanted))]
    trees = {"new": ROOT, **({"old": a.baseline.resolve()} if a.baseline else {})}
    best: dict[tuple[str, int, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for zero, prec in layouts:
                for name, tree in trees.items():
                    got = run(tree, make_spec(a, zero, prec), Path(tmp), a)
                    key = (name, zero, prec)
                    print(f"round {i + 1}: {name} ZeRO-{zero} {prec}: {got['step'] * 1e3:.1f} ms", file=sys.stderr)
                    if key in best:
                        got.update(step=min(got["step"], best[key]["step"]), cpu=min(got["cpu"], best[key]["cpu"]))
                    best[key] = got
    m = a.global_batch // (a.micro_batch * a.dp)
    print(f"tiny model, dp {a.dp}, {m} micro-batches of {a.micro_batch} per replica, buckets of {a.bucket_numel}, "
          f"{a.steps} steps (medians after {a.warmup_steps}), best of {a.rounds} rounds; bytes per parameter as "
          "measured (w: weights, g: gradients, opt: optimizer)")
    head = f"{'layout':<14}{'step ms':>9}{'cpu ms':>8}{'vs ZeRO-0':>10}{'w':>6}{'g':>6}{'opt':>6}{'total':>7}"
    print(head + ("  old ms  old cpu  new/old (step, cpu)  old B/param" if "old" in trees else ""))
    for zero, prec in layouts:
        r, base = best[("new", zero, prec)], best[("new", 0, prec)]
        mem = r["memory"]
        per = [mem[k] / r["params"] for k in ("weights", "gradients", "optimizer")]
        line = (f"ZeRO-{zero} {prec:<7}{r['step'] * 1e3:>9.1f}{r['cpu'] * 1e3:>8.1f}{r['step'] / base['step']:>10.2f}"
                + "".join(f"{x:>6.2f}" for x in per) + f"{sum(per):>7.2f}")
        if "old" in trees:
            o = best[("old", zero, prec)]
            old_per = sum(o["memory"][k] for k in ("weights", "gradients", "optimizer")) / o["params"]
            line += (f"{o['step'] * 1e3:>8.1f}{o['cpu'] * 1e3:>9.1f}{r['step'] / o['step']:>11.2f}"
                     f"{r['cpu'] / o['cpu']:>6.2f}{old_per:>15.2f}")
        print(line)


if __name__ == "__main__":
    main()

"""Benchmark: what resharding costs at load, against loading a checkpoint already in the target layout.

Two layouts on two ranks, TP=2 and TP=1 x DP=2 ZeRO-1. Each trains two steps and checkpoints. Then every
checkpoint is resumed into every layout, each from its own copy of the run directory, one after the other
in this process tree (interleaved, `--repeat` times). The trainer records the time from looking for a
checkpoint to the restored state (checksums, DCP read, TP resharding) as `load_s` in the `resume_from`
event; for each target layout this prints the resharded load against the same-layout load and their ratio.
The target layout fixes how much each rank must hold (TP=1 holds every weight), so the same-layout load
of the target is the fair baseline, not the source's.

    .venv/bin/python bench/bench_resume_reshard.py                       # hidden 512, 8 layers
    .venv/bin/python bench/bench_resume_reshard.py --hidden 1024 --layers 8 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
sys.path.insert(0, str(ROOT))
from trainctl.runtime.train import faults  # noqa: E402  (no torch: this process only launches torchrun)

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tp": 2, "dp": 1, "zero": 0},
    "tp1 x dp2 zero1": {"tp": 1, "dp": 2, "zero": 1},
}


def spec(a: argparse.Namespace, parallel: dict[str, Any]) -> dict[str, Any]:
    world = parallel["tp"] * parallel["dp"]
    return {
        "name": "bench-reshard",
        "model": {"layers": a.layers, "hidden": a.hidden, "heads": 8, "vocab": 8000, "seq_len": 64,
                  "activation": "swiglu", "tied_embeddings": False},
        "parallel": {"pp": 1, "micro_batch": 1, **parallel},
        "train": {"global_batch": 2, "steps": 3, "lr": 1e-3, "warmup": 1, "precision": "fp32", "seed": 1},
        "data": {"synthetic": True},
        "checkpoint": {"every_steps": 2, "async_save": False},
        "cluster": {"nodes": 1, "gpus_per_node": world, "gpu": "cpu"},
        "launcher": {"backend": "local"},
    }


def run(run_dir: Path, nproc: int, env: dict[str, str] | None = None) -> None:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "-m", "trainctl.runtime", str(run_dir)]
    r = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        sys.exit(f"{run_dir.name}: trainer failed ({r.returncode})\n{r.stderr[-3000:]}")


def load_seconds(run_dir: Path) -> float:
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    return float(next(e for e in reversed(events) if e["event"] == "resume_from")["load_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2, help="resumes per (source, target) pair (median shown)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-reshard-") as tmp:
        sources: dict[str, Path] = {}
        for name, layout in LAYOUTS.items():
            d = Path(tmp) / f"source-{layout['tp']}-{layout['dp']}"
            d.mkdir()
            (d / "spec.yaml").write_text(yaml.safe_dump(spec(a, layout)))
            run(d, layout["tp"] * layout["dp"], faults.encode(stop_after_step=2))
            ck = next((d / "checkpoints").glob("step-*"))
            print(f"checkpoint written by {name}: {sum(f.stat().st_size for f in ck.iterdir()) / 1e6:.1f} MB "
                  f"(hidden {a.hidden}, {a.layers} layers, weights + AdamW moments)")
            sources[name] = d
        times: dict[tuple[str, str], list[float]] = {(s, t): [] for s in LAYOUTS for t in LAYOUTS}
        for i in range(a.repeat):
            for (src, tgt), ts in times.items():
                d = Path(tmp) / f"resume-{i}"
                shutil.copytree(sources[src], d)
                layout = LAYOUTS[tgt]
                (d / "spec.yaml").write_text(yaml.safe_dump(spec(a, layout)))
                run(d, layout["tp"] * layout["dp"])
                ts.append(load_seconds(d))
                shutil.rmtree(d)
        for tgt in LAYOUTS:
            same = statistics.median(times[(tgt, tgt)])
            for src in LAYOUTS:
                med = statistics.median(times[(src, tgt)])
                what = "same layout" if src == tgt else f"from {src}"
                print(f"into {tgt:16s} {what:22s} load {med * 1e3:7.1f} ms   ratio {med / same:5.2f}   "
                      f"({', '.join(f'{t * 1e3:.0f}' for t in times[(src, tgt)])} ms)")


if __name__ == "__main__":
    main()

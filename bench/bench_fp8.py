"""FP8 against bf16 on one GPU (train.precision fp8; docs/design/trainer.md, "FP8 training"): one command, about
8 minutes on an H100 or H200, that prints the table and writes JSON.

For each model, a compiled bf16 run and a compiled fp8 run (tensorwise, the default recipe; --rowwise adds a
rowwise run), each launched through the CLI a user types (`python -m trainctl launch`), same data, seed and
schedule:
  1b       a ~0.9B Llama-style model (bench_gpu.py's "big": 16 x 2048, GQA 16/8, SwiGLU, seq 2048), 200 steps:
           tokens/s, MFU (against the dense BF16 peak, the convention mfu-report states), peak memory, and the
           loss curves side by side (every 20th step, and the largest gap of a 20-step window mean)
  largest  the largest of LARGEST_CANDIDATES the plan says fits this GPU in bf16 with selective recompute
           (`trainctl plan --json`, memory fits), 60 steps: tokens/s and MFU of both
and the plan's predicted FP8/bf16 step ratio beside the measured one.

It cannot run without a CUDA GPU with FP8 tensor cores (compute capability 8.9+: L4, L40S, H100, H200, B200):
the spec rule refuses fp8 elsewhere, and a CPU only emulates FP8 (slowly). It was written on a machine without
one and has not run on a GPU yet; `--cpu-smoke` runs the same flow at toy size on the CPU to check the script.

    python3 bench/bench_fp8.py --out DIR            # on the GPU machine; exits 0 with a note where none is
    python3 bench/bench_fp8.py --cpu-smoke --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_gpu import LLAMA, Bench, check_env  # noqa: E402  (the repository on sys.path first)
from bench_gpu import model as bench_model  # noqa: E402

# Llama 3.2 3B's shape, then a 2B and 1.5B cut of it: the first the plan fits on the GPU is "largest"
LARGEST_CANDIDATES: dict[str, dict[str, Any]] = {
    "3b": {**LLAMA, "layers": 28, "hidden": 3072, "heads": 24, "kv_heads": 8, "ffn_hidden": 8192, "vocab": 128256,
           "seq_len": 2048},
    "2b": {**LLAMA, "layers": 20, "hidden": 2560, "heads": 20, "kv_heads": 4, "ffn_hidden": 6912, "vocab": 32000,
           "seq_len": 2048},
    "1.5b": {**LLAMA, "layers": 24, "hidden": 2048, "heads": 16, "kv_heads": 8, "ffn_hidden": 5632, "vocab": 32000,
             "seq_len": 2048},
}
WINDOW = 20


def fp8_spec(name: str, model: dict[str, Any], gpu: str, *, precision: str, recipe: str, steps: int,
             micro_batch: int, recompute: str, compile: bool) -> dict[str, Any]:
    return {
        "name": name, "model": model,
        "parallel": {"tp": 1, "pp": 1, "dp": 1, "micro_batch": micro_batch},
        "train": {"global_batch": micro_batch, "steps": steps, "lr": 3e-4, "warmup": min(10, steps // 2),
                  "precision": precision, "fp8_recipe": recipe, "seed": 1234, "grad_clip": 1.0, "compile": compile,
                  "recompute": recompute, "log_every": 1},
        "data": {"synthetic": True},
        "checkpoint": {"every_steps": None},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": gpu},
        "launcher": {"backend": "local", "mode": "torchrun"},
    }


def measured(recs: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Steady figures of a run's metrics (the first `skip` steps, compilation among them, left out)."""
    steady = recs[skip:] or recs
    step = statistics.median(r["step_time_s"] for r in steady)
    return {"steps": len(recs), "step_s": round(step, 4), "tokens_per_s": round(recs[-1]["tokens"] / step),
            "mfu": round(statistics.median(r["mfu"] for r in steady if r.get("mfu") is not None), 4)
            if any(r.get("mfu") is not None for r in steady) else None,
            "peak_mem_gb": round(max(r.get("peak_mem_bytes") or 0 for r in recs) / 1e9, 2),
            "loss": [round(r["loss"], 4) for r in recs]}


def planned_step(b: Bench, spec_path: Path) -> tuple[float | None, bool | None]:
    r = b.trainctl("plan", str(spec_path), "--json", timeout=60)
    if r.returncode not in (0, 1):
        return None, None
    pj = json.loads(r.stdout)
    return (pj.get("prediction") or {}).get("step_time_s"), (pj.get("memory") or {}).get("fits")


def pair(b: Bench, size: str, model: dict[str, Any], *, steps: int, micro_batch: int, recompute: str,
         recipes: list[str]) -> dict[str, Any]:
    """bf16 and fp8 (each recipe) of one model, compiled: measured and planned figures."""
    out: dict[str, Any] = {"model": {k: model[k] for k in ("layers", "hidden", "ffn_hidden", "vocab", "seq_len")}}
    compile = not b.a.cpu_smoke
    for precision, recipe in [("bf16", "tensorwise"), *(("fp8", r) for r in recipes)]:
        key = precision if precision == "bf16" else f"fp8-{recipe}"
        sp = fp8_spec(f"fp8-bench-{size}-{key}", model, b.gpu, precision=precision, recipe=recipe, steps=steps,
                      micro_batch=micro_batch, recompute=recompute, compile=compile)
        run, recs = b.launch(f"{size}-{key}", sp, timeout=b.a.run_timeout_s)
        res = measured(recs, skip=min(10, steps // 4))
        res["plan_step_s"], _ = planned_step(b, run / "spec.yaml")
        out[key] = res
    base = out["bf16"]
    for key in [k for k in out if k.startswith("fp8-")]:
        f8 = out[key]
        f8["speedup_measured"] = round(base["step_s"] / f8["step_s"], 3)
        if f8["plan_step_s"] and base["plan_step_s"]:
            f8["speedup_planned"] = round(base["plan_step_s"] / f8["plan_step_s"], 3)
        n = len(base["loss"]) // WINDOW * WINDOW
        gaps = [abs(statistics.mean(f8["loss"][i:i + WINDOW]) - statistics.mean(base["loss"][i:i + WINDOW]))
                / statistics.mean(base["loss"][i:i + WINDOW]) for i in range(0, n, WINDOW)]
        f8["worst_window_loss_gap"] = round(max(gaps), 4) if gaps else None
    return out


def largest(b: Bench) -> tuple[str, dict[str, Any]]:
    """The largest candidate the plan fits on this GPU in bf16 (selective recompute, micro-batch 1)."""
    if b.a.cpu_smoke:
        return "smoke-large", {**bench_model("big", True), "layers": 3}
    for size, model in LARGEST_CANDIDATES.items():
        path = b.work / f"plan-{size}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(fp8_spec(f"plan-{size}", model, b.gpu, precision="bf16", recipe="tensorwise",
                                                steps=10, micro_batch=1, recompute="selective", compile=True)))
        _, fits = planned_step(b, path)
        if fits:
            return size, model
    return "1.5b", LARGEST_CANDIDATES["1.5b"]


def table(results: dict[str, Any]) -> str:
    rows = [f"{'model':<10} {'run':<16} {'step s':>8} {'tokens/s':>10} {'MFU (bf16 peak)':>16} {'mem GB':>7} "
            f"{'x bf16':>7} {'plan x':>7} {'loss gap':>9}"]
    for size, res in results.items():
        if not isinstance(res, dict) or "bf16" not in res:
            continue
        for key, r in res.items():
            if key == "model" or not isinstance(r, dict):
                continue
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
            rows.append(f"{size:<10} {key:<16} {r['step_s']:>8.4f} {r['tokens_per_s']:>10,} {mfu:>16} "
                        f"{r['peak_mem_gb']:>7.2f} {r.get('speedup_measured', 1.0):>7.3f} "
                        f"{r.get('speedup_planned') or '-':>7} {r.get('worst_window_loss_gap') or '-':>9}")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench-fp8-out"))
    p.add_argument("--work", default="/tmp/trainctl-bench-fp8")
    p.add_argument("--cpu-smoke", action="store_true", help="toy models on the CPU (checks the script only)")
    p.add_argument("--rowwise", action="store_true", help="also an fp8 run with train.fp8_recipe rowwise")
    p.add_argument("--steps", type=int, default=200, help="steps of the ~1B runs (the loss curves)")
    p.add_argument("--large-steps", type=int, default=60)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--run-timeout-s", type=float, default=240)
    p.add_argument("--budget-s", type=float, default=570, help="stop starting new checks after this")
    a = p.parse_args()
    if a.cpu_smoke:
        a.steps, a.large_steps, a.micro_batch = min(a.steps, 8), min(a.large_steps, 4), 2
    a.out.mkdir(parents=True, exist_ok=True)
    b = Bench(a)
    import torch

    if not a.cpu_smoke and not (torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 9)):
        print("bench_fp8: no CUDA GPU with FP8 tensor cores here (compute capability 8.9+); nothing measured")
        return
    b.step("env", lambda: check_env(b))
    recipes = ["tensorwise", *(["rowwise"] if a.rowwise else [])]
    b.step("1b", lambda: pair(b, "1b", bench_model("big", a.cpu_smoke), steps=a.steps, micro_batch=a.micro_batch,
                              recompute="none", recipes=recipes))
    size, model = largest(b)
    b.step(size, lambda: pair(b, size, model, steps=a.large_steps, micro_batch=1, recompute="selective",
                              recipes=recipes))
    print(table(b.results))
    for key in ("1b",):
        res = b.results.get(key) or {}
        if "bf16" in res:
            print(f"\nloss every {WINDOW}th step ({key}): bf16 {res['bf16']['loss'][::WINDOW]}")
            for k in (k for k in res if k.startswith("fp8-")):
                print(f"  {k}: {res[k]['loss'][::WINDOW]}")
    print(f"\nwrote {a.out / 'bench_gpu.json'} in {time.monotonic() - b.t0:.0f} s (log: {b.log})")


if __name__ == "__main__":
    main()

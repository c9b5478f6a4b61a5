"""What one transformer layer costs on a GPU, timed the ways calibrate could time it: prints a table, writes JSON.

For each model (bench_gpu's big and mid), micro-batch, recompute mode and token count (the model's sequence, and
calibrate's dispatch-floor input of 64 tokens), the layer's forward + backward as the trainer builds it (bf16
autocast over fp32 weights, eager), timed
  one       one layer, a synchronize after each call (what calibrate timed until it had stacks)
  stack2/4  2 and 4 layers in one module, a synchronize after each call: (stackN - one) / (N - 1) is a layer
            without what each call pays once (the backward's start, the wait for the last kernels)
  queued    one layer called 20 times with one synchronize at the end: a layer with the GPU's queue kept full
Each figure is the median of 3 windows of at least 0.1 s. The step's own per-layer cost is what bench_gpu's grid
measures; this script says which probe comes closest to it.

    python3 bench/layer_probe.py --json OUT.json   # skips (exit 0) on a machine without a CUDA GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

WINDOW_S = 0.1
QUEUED_CALLS = 20


def per_call(fn: Callable[[], object], sync: Callable[[], None], calls_per_window: int | None = None) -> float:
    """Median seconds per call over 3 windows: a synchronize after each call, or (`calls_per_window`) after
    that many calls."""
    fn()
    sync()
    out = []
    for _ in range(3):
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < WINDOW_S or n == 0:
            if calls_per_window:
                for _ in range(calls_per_window):
                    fn()
                n += calls_per_window
            else:
                fn()
                n += 1
            sync()
        out.append(elapsed / n)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=120, help="stop starting new rows after this long")
    ap.add_argument("--models", default="big,mid", help="comma-separated, in this order")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("layer_probe: no CUDA GPU here; skipped")
        return
    from bench_gpu import model

    from trainctl.model_shape import ModelShape
    from trainctl.runtime.workers.microbench import Layer
    from trainctl.spec.models import ModelSpec

    device = torch.device("cuda")

    def sync() -> None:
        torch.cuda.synchronize(device)

    t_start = time.monotonic()
    rows = []
    for size in a.models.split(","):
        shape = ModelShape.from_spec(ModelSpec(**model(size, False)))
        for micro_batch, seq in ((1, shape.seq_len), (4, shape.seq_len), (1, 64)):
            for mode in ("none", "selective", "full"):
                if time.monotonic() - t_start > a.budget_s:
                    break
                row = {"model": size, "micro_batch": micro_batch, "tokens": seq, "recompute": mode}
                for depth in (1, 2, 4):
                    layer = Layer(shape, micro_batch, mode, torch.bfloat16, device, 1234, seq_len=seq, depth=depth)
                    row[f"stack{depth}" if depth > 1 else "one"] = per_call(layer.step, sync)
                    if depth == 1:
                        row["queued"] = per_call(layer.step, sync, QUEUED_CALLS)
                        row["flops"] = layer.flops
                    del layer
                torch.cuda.empty_cache()
                row["marginal2"] = row["stack2"] - row["one"]
                row["marginal4"] = (row["stack4"] - row["one"]) / 3
                rows.append(row)
                print(" ".join(f"{k}={v * 1e3:.3f}ms" if isinstance(v, float) and k != "flops" else f"{k}={v}"
                               for k, v in row.items() if k != "flops"), flush=True)
    a.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                  "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

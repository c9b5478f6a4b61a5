"""Burst against sustained: the bf16 GEMM rate a GPU gives for a moment (as a shape search or a microbenchmark
times it) and through minutes of back-to-back layers (as a training run keeps it), side by side in one run, with
the SM clock, board power and throttle reasons NVML reports meanwhile, and the plan's rate for each shape.

Why: the plan prices an H100's GEMMs at the rate that reproduces Transformer Engine's published layer time
(catalog gemm_efficiency 0.655, 64% of peak, where a short shape search finds 80.3%), which brings NVIDIA's own
tuned H100 runs whose layouts it knows exactly within 6% (docs/validation.md, the DGX Cloud rows). That layer was
timed over 100 iterations, seconds of work. This measures, on the card, whether a layer's GEMMs sustained for
minutes run slower than in a burst (a clock held down at the power limit), and how the plan's per-shape rate
compares with both. The shapes are one Llama 3.1 8B layer on 4096 tokens (the DGX Cloud 8B recipe's CP2 rank),
forward and both backward GEMMs, and the 8192^3 product bench_gpu.py times.

    python3 bench/bench_sustained_gemm.py --seconds 120 --out DIR   # about 3 minutes of a lent H100 or H200
    python3 bench/bench_sustained_gemm.py --cpu-smoke               # the flow at toy size on the CPU

It reads the card's state and never sets it (no clocks, no power limit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainctl.hardware.catalog import ACCELERATORS  # noqa: E402  (the repository on sys.path first)
from trainctl.plan import operators  # noqa: E402
from trainctl.plan.plan import operator_device  # noqa: E402

# One Llama 3.1 8B layer's linear layers on one rank's 4096 tokens: (name, tokens, out features, in features).
TOKENS = 4096
LAYER = (("qkv", TOKENS, 4096 + 2 * 1024, 4096), ("proj", TOKENS, 4096, 4096), ("gate_up", TOKENS, 2 * 14336, 4096),
         ("down", TOKENS, 4096, 14336))


def layer_gemms(layer: tuple[tuple[str, int, int, int], ...]) -> list[tuple[str, int, int, int]]:
    """Every GEMM a linear layer y = x W runs in training, as (name, m, n, k) of an m x k by k x n product:
    the forward, the input's gradient dy W^T and the weight's gradient x^T dy (operators._train_gemm's three)."""
    out = []
    for name, t, n, k in layer:
        out += [(f"{name} fwd", t, n, k), (f"{name} dgrad", t, k, n), (f"{name} wgrad", k, n, t)]
    return out


class Sampler(threading.Thread):
    """NVML samples of the first GPU every `every` seconds: SM clock (MHz), board power (W), throttle reasons."""

    def __init__(self, every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.every, self.samples, self.stop = every, [], threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML (the CPU smoke): no samples, the rates still come
            self.nvml = self.handle = None

    def run(self) -> None:
        while self.handle is not None and not self.stop.wait(self.every):
            n = self.nvml
            self.samples.append({"t": time.monotonic(),
                                 "sm_mhz": n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_SM),
                                 "power_w": n.nvmlDeviceGetPowerUsage(self.handle) / 1e3,
                                 "throttle": n.nvmlDeviceGetCurrentClocksThrottleReasons(self.handle)})

    def between(self, t0: float, t1: float) -> dict[str, Any]:
        s = [x for x in self.samples if t0 <= x["t"] <= t1]
        if not s:
            return {}
        reasons = 0
        for x in s:
            reasons |= x["throttle"]
        return {"sm_mhz_median": statistics.median(x["sm_mhz"] for x in s),
                "power_w_median": round(statistics.median(x["power_w"] for x in s), 1),
                "throttle_reasons": hex(reasons)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "sustained-gemm-out")))
    ap.add_argument("--seconds", type=float, default=120.0, help="how long the layers run back to back")
    ap.add_argument("--window", type=float, default=5.0, help="seconds per measured window of the sustained run")
    ap.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU: checks this script's flow")
    a = ap.parse_args()
    import torch

    if a.cpu_smoke:
        device, dtype, scale, a.seconds, a.window = "cpu", torch.float32, 64, min(a.seconds, 2.0), 0.5
    elif torch.cuda.is_available():
        device, dtype, scale = "cuda", torch.bfloat16, 1
    else:
        print("bench_sustained_gemm: no CUDA GPU here; skipped (--cpu-smoke runs the flow at toy size on the CPU)")
        return
    a.out.mkdir(parents=True, exist_ok=True)
    shapes = [(n, max(m // scale, 8), max(nn // scale, 8), max(k // scale, 8)) for n, m, nn, k in layer_gemms(LAYER)]
    square = 8192 // scale
    # operands per shape, random (never zeros), two sets to rotate so repeated runs do not measure the cache
    ops = {s: [(torch.randn(s[1], s[3], device=device, dtype=dtype), torch.randn(s[3], s[2], device=device,
                                                                                  dtype=dtype)) for _ in range(2)]
           for s in shapes + [("square", square, square, square)]}

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn, reps: int) -> float:
        """Median seconds of fn over reps calls, each synchronized (events would hide nothing on the CPU)."""
        times = []
        for i in range(reps):
            sync()
            t0 = time.perf_counter()
            fn(i)
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def run_layer(i: int) -> None:
        for s in shapes:
            x, w = ops[s][i % 2]
            x @ w

    layer_flops = sum(2 * m * n * k for _, m, n, k in shapes)
    gpu = "h100-sxm"
    if device == "cuda":
        from trainctl.hardware.detect import detect_gpus

        found = detect_gpus()
        gpu = found[0].catalog_key if found and found[0].catalog_key else gpu
    acc = ACCELERATORS[gpu]
    dev = operator_device(acc, acc.peak_bf16_tflops * 1e12, "flash2")
    sampler = Sampler()
    sampler.start()
    # burst: each shape warmed up, then timed over a few calls, as a microbenchmark or a shape search times it
    for s in ops:
        for i in range(3):
            ops[s][i % 2][0] @ ops[s][i % 2][1]
    sync()
    burst = {}
    for s in shapes + [("square", square, square, square)]:
        sec = timed(lambda i, s=s: ops[s][i % 2][0] @ ops[s][i % 2][1], reps=10)
        flops = 2 * s[1] * s[2] * s[3]
        plan_s = operators.gemm_seconds(dev, s[1], s[2], s[3], act=2)
        burst[s[0]] = {"mnk": s[1:], "tflops": round(flops / sec / 1e12, 1),
                       "plan_tflops": round(flops / plan_s / 1e12, 1)}
    layer_burst_s = timed(run_layer, reps=5)
    # sustained: the layer's GEMMs back to back for a.seconds, measured per window
    windows, t_start, i = [], time.monotonic(), 0
    while time.monotonic() - t_start < a.seconds:
        sync()
        w0, done = time.monotonic(), 0
        while time.monotonic() - w0 < a.window:
            run_layer(i)
            i, done = i + 1, done + 1
            if done % 8 == 0:
                sync()  # keep the queue short, so the window's end is the work's end
        sync()
        w1 = time.monotonic()
        windows.append({"t_s": round(w1 - t_start, 1), "tflops": round(done * layer_flops / (w1 - w0) / 1e12, 1),
                        **sampler.between(w0, w1)})
    sampler.stop.set()
    burst_layer_tflops = layer_flops / layer_burst_s / 1e12
    tail = windows[len(windows) // 2:]  # the second half: the card settled at its power limit
    sustained = statistics.median(w["tflops"] for w in tail)
    plan_layer_s = sum(operators.gemm_seconds(dev, m, n, k, act=2) for _, m, n, k in shapes)
    res = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "catalog": gpu,
           "peak_tflops": acc.peak_bf16_tflops, "torch": torch.__version__, "shapes": burst,
           "layer": {"burst_tflops": round(burst_layer_tflops, 1), "sustained_tflops": sustained,
                     "sustained_over_burst": round(sustained / burst_layer_tflops, 3),
                     "plan_tflops": round(layer_flops / plan_layer_s / 1e12, 1),
                     "plan_over_sustained": round(layer_flops / plan_layer_s / 1e12 / sustained, 3)},
           "windows": windows, "first_window": windows[0], "settled": sampler.between(time.monotonic() - a.seconds / 2,
                                                                                        time.monotonic())}
    (a.out / "bench_sustained_gemm.json").write_text(json.dumps(res, indent=1))
    print(f"{res['device']} (catalog {gpu}, peak {acc.peak_bf16_tflops} TFLOP/s), torch {torch.__version__}")
    print("\n| GEMM (m x n x k) | burst TFLOP/s | plan's TFLOP/s | plan / burst |\n|---|---|---|---|")
    for name, r in burst.items():
        print(f"| {name} {'x'.join(map(str, r['mnk']))} | {r['tflops']} | {r['plan_tflops']} | "
              f"{r['plan_tflops'] / r['tflops']:.3f} |")
    lay = res["layer"]
    print(f"\n| one layer's GEMMs | TFLOP/s |\n|---|---|\n| burst | {lay['burst_tflops']} |\n"
          f"| sustained ({a.seconds:g} s, median of the second half's windows) | {lay['sustained_tflops']} |\n"
          f"| sustained / burst | {lay['sustained_over_burst']} |\n| plan | {lay['plan_tflops']} |\n"
          f"| plan / sustained | {lay['plan_over_sustained']} |")
    print(f"\nfirst window {windows[0]}; settled {res['settled']}")


if __name__ == "__main__":
    main()

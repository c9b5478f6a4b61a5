"""Peak FLOP/s per rank for MFU: the catalog's dense BF16 peak on GPUs, a measured matmul rate on CPUs.

The CPU rate is measured once per CPU model, torch version and thread count (fp32 matmuls on one thread,
best of several) and cached in ~/.cache/trainctl/cpu_peak.json; a rank's peak is that rate times its
threads. A measured rate is what this machine can actually do, so MFU on CPU is meaningful (and a value
above 100% flags a FLOPs-accounting bug rather than a wrong datasheet number).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from trainctl.hardware.catalog import ACCELERATORS, peak_tflops_for
from trainctl.hardware.detect import catalog_key_for, detect_gpus
from trainctl.spec.models import RunSpec

MATMUL_SIZE = 768


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "trainctl" / "cpu_peak.json"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_matmul_flops(threads: int = 1, size: int = MATMUL_SIZE, repeats: int = 5) -> float:
    """Best fp32 matmul FLOP/s over a few timed rounds on `threads` threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(4):
                torch.mm(a, b)
            best = min(best, (time.perf_counter() - t0) / 4)
        return 2.0 * size**3 / best
    finally:
        torch.set_num_threads(old)


def cpu_single_thread_flops() -> float:
    """The cached (or freshly measured) single-thread fp32 matmul rate of this CPU."""
    key = f"{cpu_model()}|torch {torch.__version__}|threads 1|n {MATMUL_SIZE}"
    path = cache_path()
    try:
        cached = json.loads(path.read_text())
        if key in cached:
            return float(cached[key])
    except (OSError, ValueError):
        cached = {}
    rate = measure_matmul_flops(1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**cached, key: rate}, indent=1))
        os.replace(tmp, path)  # atomic: concurrent runs never read a torn file
    except OSError:
        pass
    return rate


def gpu_product_name(index: int) -> str | None:
    """The product name of CUDA device `index`: NVML's (the physical GPU CUDA_VISIBLE_DEVICES maps it to),
    else the CUDA runtime's, which is the same driver string."""
    visible = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    physical = int(visible[index]) if index < len(visible) and visible[index].isdigit() else index
    gpus = {g.index: g for g in detect_gpus()}
    if physical in gpus:
        return gpus[physical].name
    try:
        return torch.cuda.get_device_name(index)
    except (RuntimeError, AssertionError):
        return None


# fp8 runs report MFU against the BF16 peak (docs/design/memory.md, "MFU convention")
_KIND = {"bf16": "dense BF16", "fp16": "dense FP16", "fp32": "dense TF32", "fp8": "dense BF16"}


def gpu_peak(spec: RunSpec, index: int) -> tuple[float, str]:
    """The detected GPU's catalog peak for the run's precision (dense: never the 2:4-sparsity figure; fp32
    training runs matmuls in TF32). The detected part wins over cluster.gpu, which is the fallback."""
    name = gpu_product_name(index)
    key = catalog_key_for(name) if name else None
    how = f"{name} via NVML"
    if key is None:
        key, how = spec.cluster.gpu, f"spec cluster.gpu; detected {name or 'nothing'} is not in the catalog"
    elif key != spec.cluster.gpu:
        print(f"trainctl: warning: the spec says cluster.gpu={spec.cluster.gpu!r} but this is a {name} "
              f"({key}); MFU uses the {key} peak", file=sys.stderr, flush=True)
    acc = ACCELERATORS.get(key)
    peak = peak_tflops_for(acc, spec.train.precision) if acc is not None else None
    if acc is None or peak is None:
        raise RuntimeError(f"no peak FLOP/s for GPU {name!r} (cluster.gpu={spec.cluster.gpu!r}); set "
                           "cluster.peak_tflops")
    kind = _KIND[spec.train.precision] if spec.train.precision != "fp32" or acc.peak_tf32_tflops else "FP32"
    return peak * 1e12, f"catalog {key} {kind} {peak:g} TFLOP/s ({how})"


def peak_flops_per_rank(spec: RunSpec, device: torch.device) -> tuple[float, str]:
    """(FLOP/s, where it comes from) of one rank: cluster.peak_tflops, else the GPU's catalog peak, else
    (CPU) the measured matmul rate."""
    if spec.cluster.peak_tflops is not None:
        return spec.cluster.peak_tflops * 1e12, "spec cluster.peak_tflops"
    if device.type == "cuda":
        return gpu_peak(spec, device.index or 0)
    threads = torch.get_num_threads()
    return cpu_single_thread_flops() * threads, f"measured fp32 matmul rate x {threads} thread(s)"

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
import time
from pathlib import Path

import torch

from trainctl.hardware.catalog import ACCELERATORS
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


def peak_flops_per_rank(spec: RunSpec, device: torch.device) -> tuple[float, str]:
    """(FLOP/s, where it comes from) of one rank."""
    if spec.cluster.peak_tflops is not None:
        return spec.cluster.peak_tflops * 1e12, "spec cluster.peak_tflops"
    if device.type == "cuda":
        acc = ACCELERATORS.get(spec.cluster.gpu)
        if acc is not None and acc.peak_bf16_tflops:
            return acc.peak_bf16_tflops * 1e12, f"catalog {acc.key} dense BF16"
        raise RuntimeError(f"no peak FLOP/s for cluster.gpu={spec.cluster.gpu!r}; set cluster.peak_tflops")
    threads = torch.get_num_threads()
    return cpu_single_thread_flops() * threads, f"measured fp32 matmul rate x {threads} thread(s)"

"""Detect the local GPUs with NVML (nvidia-ml-py) and map their product names to catalog keys.

No torch: NVML is the driver's own management library, so this works (and is fast) on a login node
with a driver, and returns [] anywhere without one.
"""

from __future__ import annotations

import contextlib
import glob
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DetectedGPU:
    index: int
    name: str  # NVML product name, e.g. "NVIDIA H100 80GB HBM3"
    memory_gb: float  # total device memory, GB (10^9 bytes)
    catalog_key: str | None  # None: not a catalog part (use cluster.peak_tflops / memory_gb)


# Vendor prefixes NVML / amd-smi put before the model.
_PREFIX = re.compile(r"^(NVIDIA\s+|TESLA\s+|AMD\s+|INSTINCT\s+|GRID\s+)+")

# Ordered: the first match wins, so more specific names come first (H100 NVL before H100, L40S
# before L4). `\b` after the model keeps "A100" from matching "A10G", "H20" from "H200", "L40" from "L4".
_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^V100S?\b"), "v100"),
    (re.compile(r"^H100\b.*\bNVL\b"), "h100-nvl"),
    (re.compile(r"^H100\b.*\bPCIE\b"), "h100-pcie"),
    (re.compile(r"^H100\b"), "h100-sxm"),  # "H100 80GB HBM3", "H100 SXM5 80GB"
    (re.compile(r"^GH200\b"), "gh200"),
    (re.compile(r"^H200\b.*\bNVL\b"), "h200-nvl"),
    (re.compile(r"^H200\b"), "h200"),
    (re.compile(r"^GB200\b"), "gb200"),
    (re.compile(r"^B200\b"), "b200"),
    (re.compile(r"^L40S\b"), "l40s"),
    (re.compile(r"^L4\b"), "l4"),
    (re.compile(r"^A10G\b"), "a10g"),
    (re.compile(r"^MI300X\b"), "mi300x"),
]

# Parts whose names look like a catalog part but whose figures differ: export variants with cut
# NVLink (A800/H800 are caught by the rules not matching) and MIG slices (a fraction of the GPU).
_NOT_CATALOG = re.compile(r"\bMIG\b")


def catalog_key_for(product_name: str, memory_gb: float | None = None) -> str | None:
    """The catalog key for an NVML (or amd-smi) product name; None if the part is not in the catalog.

    `memory_gb` only breaks the A100 40/80 GB tie for names that do not carry the size.
    """
    name = " ".join(product_name.upper().replace("_", "-").split())
    name = _PREFIX.sub("", name)
    if _NOT_CATALOG.search(name):
        return None
    if re.match(r"^A100\b", name):
        if re.search(r"\b80\s*GB\b", name):
            return "a100-80gb"
        if re.search(r"\b40\s*GB\b", name):
            return "a100-40gb"
        if memory_gb is not None:
            return "a100-80gb" if memory_gb > 60 else "a100-40gb"
        return None
    for pattern, key in _RULES:
        if pattern.search(name):
            return key
    return None


def detect_gpus() -> list[DetectedGPU]:
    """The GPUs NVML sees on this machine; [] when nvidia-ml-py or the driver is absent."""
    try:
        import pynvml  # lazily: absent or driverless machines must still import trainctl
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError):  # no driver / libnvidia-ml.so not found
        return []
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            raw = pynvml.nvmlDeviceGetName(handle)
            name = raw.decode() if isinstance(raw, bytes) else str(raw)  # bytes in older bindings
            memory_gb = pynvml.nvmlDeviceGetMemoryInfo(handle).total / 1e9
            gpus.append(DetectedGPU(i, name, round(memory_gb, 1), catalog_key_for(name, memory_gb)))
        return gpus
    except pynvml.NVMLError:
        return []
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def has_gpu() -> bool:
    """Whether this machine has a GPU the trainer could use: NVML sees one, or an NVIDIA or AMD (ROCm's
    /dev/kfd) device node exists (a container may lack NVML but have the devices)."""
    return bool(detect_gpus()) or bool(glob.glob("/dev/nvidia[0-9]*")) or bool(glob.glob("/dev/kfd"))

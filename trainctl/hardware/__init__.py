"""The machine: accelerator and interconnect catalog, local GPU detection, this host's name, the kernel's
out-of-memory kill counters. No torch.

    catalog.py        accelerators and fabrics (dense peaks, memory, NVLink domain), with their sources
    detect.py         the local GPUs through NVML, mapped to catalog entries
    topology.py       NVLink-domain arithmetic shared by the spec rules and the placement
    hostname.py       the one name trainctl gives this host
    oom_kills.py      whether the kernel's out-of-memory killer ended a rank
"""

from trainctl.hardware.catalog import (
    ACCELERATORS,
    FABRICS,
    Accelerator,
    Fabric,
    accelerator_names,
    fabric_names,
    peak_tflops_for,
    resolve_accelerator,
    resolve_fabric,
)
from trainctl.hardware.detect import DetectedGPU, catalog_key_for, detect_gpus

__all__ = [
    "ACCELERATORS",
    "FABRICS",
    "Accelerator",
    "DetectedGPU",
    "Fabric",
    "accelerator_names",
    "catalog_key_for",
    "detect_gpus",
    "fabric_names",
    "peak_tflops_for",
    "resolve_accelerator",
    "resolve_fabric",
]

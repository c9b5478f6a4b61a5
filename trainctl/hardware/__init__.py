"""Accelerator and interconnect catalog, and local GPU detection (no torch)."""

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

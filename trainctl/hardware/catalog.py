"""Catalog of accelerators and inter-node fabrics.

All FLOP/s figures are *dense* (no 2:4 sparsity), per GPU, from the vendor datasheet cited beside
each entry. Bandwidths are per GPU, one direction, in GB/s (10^9 bytes/s).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    key: str  # the name a spec uses, e.g. "h100-sxm"
    name: str  # human-readable
    peak_bf16_tflops: float | None  # dense BF16 tensor-core peak; None = measured at run time (CPU)
    peak_tf32_tflops: float | None  # dense TF32 tensor-core peak (used for fp32 training on GPU)
    peak_fp32_tflops: float | None  # plain FP32 (non-tensor) peak
    memory_gb: float | None  # device memory, GB (10^9 bytes); None = unknown/host memory
    nvlink_domain: int  # GPUs sharing one NVLink/NVSwitch (or Infinity Fabric) domain; 0 = one node
    nvlink_gbps: float  # per-GPU, one direction, GB/s inside the domain
    source: str  # where the figures come from


@dataclass(frozen=True)
class Fabric:
    key: str
    name: str
    gbps_per_gpu: float  # per GPU, one direction, GB/s, assuming one NIC per GPU (rail-optimised)
    source: str


ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA H100 SXM5 datasheet: BF16 1,979 TFLOPS *with sparsity* -> 989.4 dense; TF32 494.7 dense;
    # FP32 67; 80 GB HBM3; NVLink 900 GB/s bidirectional -> 450 GB/s per direction; HGX: 8 GPUs.
    "h100-sxm": Accelerator("h100-sxm", "NVIDIA H100 SXM 80GB", 989.4, 494.7, 67.0, 80.0, 8, 450.0,
                            "NVIDIA H100 Tensor Core GPU datasheet"),
    # A host CPU: peak is measured at run time by a matmul micro-benchmark and cached.
    "cpu": Accelerator("cpu", "Host CPU (measured matmul rate)", None, None, None, None, 0, 10.0,
                       "measured on this machine at run time"),
}

FABRICS: dict[str, Fabric] = {
    # NVIDIA ConnectX-7 NDR InfiniBand: 400 Gb/s per port = 50 GB/s per direction.
    "ndr": Fabric("ndr", "InfiniBand NDR 400G", 50.0, "NVIDIA ConnectX-7 datasheet"),
}


def accelerator_names() -> list[str]:
    return sorted(ACCELERATORS)


def fabric_names() -> list[str]:
    return sorted(FABRICS)

"""`trainctl hardware`: the accelerator and fabric catalog, and the GPUs on this machine."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.table import Table

from trainctl.cli.app import app
from trainctl.cli.console import make_console
from trainctl.cli.jsonout import print_json
from trainctl.cli.options import JsonOpt
from trainctl.hardware.catalog import ACCELERATORS, FABRICS
from trainctl.hardware.detect import detect_gpus
from trainctl.prose import prose


def _num(x: float | None, digits: int = 2) -> str:
    # Datasheet precision, no trailing zeros: 989.4, 362.05, 2,250.
    if x is None:
        return "measured"
    text = f"{x:,.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def catalog_dict() -> dict[str, Any]:
    """Everything `--json` prints: plain units named in the keys' documentation."""
    return {
        "units": {
            "peak_*_tflops": "dense (no sparsity) TFLOP/s per GPU; null = measured at run time",
            "memory_gb": "10^9 bytes per GPU",
            "nvlink_domain": "GPUs in one NVLink/NVSwitch (or Infinity Fabric) domain; 0 = one node",
            "nvlink_gbps": "GB/s per GPU, one direction, inside the domain",
            "gbps_per_gpu": "GB/s per GPU, one direction, between nodes (one NIC per GPU)",
        },
        "accelerators": [asdict(a) for a in ACCELERATORS.values()],
        "fabrics": [{**asdict(f), "gbit_per_gpu": f.gbit_per_gpu} for f in FABRICS.values()],
        "detected": [asdict(g) for g in detect_gpus()],
    }


@app.command()
def hardware(as_json: bool = JsonOpt) -> None:
    """List the accelerator and interconnect catalog (dense peaks, memory, NVLink) and local GPUs."""
    if as_json:
        print_json(catalog_dict())
        return
    console = make_console()

    # Short headers and the long name last, so the numbers stay readable in an 80-column pipe.
    prose(console, "[italic]Accelerators per GPU: dense TFLOP/s (no sparsity), memory GB, NVLink domain (GPUs) "
                   "and GB/s one direction[/italic]")
    acc = Table()
    for col in ("key", "BF16", "TF32", "FP32", "mem", "domain", "GB/s", "name"):
        acc.add_column(col, justify="left" if col in ("key", "name") else "right", no_wrap=col != "name")
    for a in ACCELERATORS.values():
        domain = "node" if a.nvlink_domain == 0 else str(a.nvlink_domain)
        tf32 = "—" if a.peak_tf32_tflops is None and a.peak_bf16_tflops is not None else _num(a.peak_tf32_tflops)
        acc.add_row(a.key, _num(a.peak_bf16_tflops), tf32, _num(a.peak_fp32_tflops),
                    _num(a.memory_gb, 0), domain, f"{a.nvlink_gbps:,.0f} {a.link}", a.name)
    console.print(acc)
    prose(console, "[dim]V100 has no BF16/TF32: its BF16 column is the FP16 tensor peak. Override any figure in "
                   "the spec: cluster.peak_tflops, memory_gb, nvlink_domain, nvlink_gbps.[/dim]")

    fab = Table(title="Inter-node fabrics per GPU (one NIC per GPU), one direction")
    for col in ("key", "Gb/s", "GB/s", "name"):
        fab.add_column(col, justify="right" if "/s" in col else "left", no_wrap=col != "name")
    for f in FABRICS.values():
        fab.add_row(f.key, f"{f.gbit_per_gpu:,.0f}", f"{f.gbps_per_gpu:,.1f}", f.name)
    console.print(fab)

    gpus = detect_gpus()
    if not gpus:
        prose(console, "none detected (no NVIDIA driver / NVML on this machine).", "Local GPUs: ")
        return
    local = Table(title="Local GPUs (NVML)")
    for col in ("index", "name", "memory GB", "catalog key"):
        local.add_column(col)
    for g in gpus:
        local.add_row(str(g.index), g.name, f"{g.memory_gb:,.1f}", g.catalog_key or "— (not in catalog)")
    console.print(local)


__all__ = ["catalog_dict", "hardware"]

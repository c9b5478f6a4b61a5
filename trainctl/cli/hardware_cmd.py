"""`trainctl hardware`: the accelerator and fabric catalog, and the GPUs on this machine."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from trainctl.cli.app import app
from trainctl.cli.console import Col, fitted_table, make_console
from trainctl.cli.jsonout import print_json
from trainctl.cli.options import JsonOpt
from trainctl.terminal import prose

MEASURED = "*"  # a figure measured at run time (the CPU's), said under the table: a word here costs 80 columns


def _num(x: float | None, digits: int = 2) -> str:
    # Datasheet precision, no trailing zeros: 989.4, 362.05, 2,250.
    if x is None:
        return MEASURED
    text = f"{x:,.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def catalog_dict() -> dict[str, Any]:
    """Everything `--json` prints: plain units named in the keys' documentation."""
    from trainctl.hardware.catalog import ACCELERATORS, FABRICS
    from trainctl.hardware.detect import detect_gpus

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
    from trainctl.hardware.catalog import ACCELERATORS, FABRICS
    from trainctl.hardware.detect import detect_gpus

    if as_json:
        print_json(catalog_dict())
        return
    console = make_console()

    # Short headers and the long name last, so the numbers stay readable in an 80-column pipe.
    prose(console, "[italic]Accelerators per GPU: dense TFLOP/s (no sparsity), memory GB, NVLink domain (GPUs) "
                   "and GB/s one direction[/italic]")
    acc_columns = [Col("key", "key"), *(Col(h, justify="right") for h in ("BF16", "TF32", "FP32", "mem", "domain",
                                                                          "GB/s")), Col("name", "prose")]
    acc_rows = []
    for a in ACCELERATORS.values():
        domain = "node" if a.nvlink_domain == 0 else str(a.nvlink_domain)
        tf32 = "—" if a.peak_tf32_tflops is None and a.peak_bf16_tflops is not None else _num(a.peak_tf32_tflops)
        acc_rows.append([a.key, _num(a.peak_bf16_tflops), tf32, _num(a.peak_fp32_tflops), _num(a.memory_gb, 0),
                         domain, f"{a.nvlink_gbps:,.0f} {a.link}", a.name])
    acc = fitted_table(console, acc_columns, acc_rows)
    console.print(acc)
    prose(console, f"[dim]{MEASURED} measured at run time. V100 has no BF16/TF32: its BF16 column is the FP16 "
                   "tensor peak. Override any figure in the spec: cluster.peak_tflops, memory_gb, nvlink_domain, "
                   "nvlink_gbps.[/dim]")

    fab_columns = [Col("key", "key"), Col("Gb/s", justify="right"), Col("GB/s", justify="right"), Col("name", "prose")]
    fab = fitted_table(console, fab_columns,
                       [[f.key, f"{f.gbit_per_gpu:,.0f}", f"{f.gbps_per_gpu:,.1f}", f.name] for f in FABRICS.values()],
                       title="Inter-node fabrics per GPU (one NIC per GPU), one direction")
    console.print(fab)

    gpus = detect_gpus()
    if not gpus:
        prose(console, "none detected (no NVIDIA driver / NVML on this machine).", "Local GPUs: ")
        return
    local = fitted_table(console, [Col("index", "key"), Col("name", "prose"), Col("memory GB"), Col("catalog key")],
                         [[str(g.index), g.name, f"{g.memory_gb:,.1f}", g.catalog_key or "— (not in catalog)"]
                          for g in gpus],
                         title="Local GPUs (NVML)")
    console.print(local)


__all__ = ["catalog_dict", "hardware"]

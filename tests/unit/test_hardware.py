"""The hardware catalog, NVML product-name mapping, detection and `trainctl hardware`.

Datasheet figures are cited beside each check; NVIDIA headlines tensor-core FLOP/s *with* 2:4
sparsity, so a dense catalog must hold exactly half of those headlines.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
from cli_utils import trainctl

from trainctl.errors import SpecError
from trainctl.hardware import (
    ACCELERATORS,
    FABRICS,
    catalog_key_for,
    detect_gpus,
    peak_tflops_for,
    resolve_accelerator,
    resolve_fabric,
)
from trainctl.spec.models import ClusterSpec

GPU_KEYS = {"v100", "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h100-nvl", "h200", "h200-nvl", "gh200",
            "b200", "gb200", "l40s", "l4", "a10g", "mi300x"}
FABRIC_KEYS = {"hdr", "ndr", "xdr", "eth-100g", "eth-200g", "eth-400g", "efa"}


# --- the catalog ---------------------------------------------------------------------------------

def test_catalog_has_exactly_the_agreed_keys() -> None:
    # Other layers (planner, recipes, users' specs) name these keys.
    assert set(ACCELERATORS) == GPU_KEYS | {"cpu"}
    assert set(FABRICS) == FABRIC_KEYS
    for key, acc in ACCELERATORS.items():
        assert acc.key == key
    for key, fab in FABRICS.items():
        assert fab.key == key


@pytest.mark.parametrize("key", sorted(GPU_KEYS))
def test_every_gpu_has_positive_figures_and_a_source(key: str) -> None:
    a = ACCELERATORS[key]
    assert a.name and a.source
    assert a.peak_bf16_tflops is not None and a.peak_bf16_tflops > 0
    assert a.peak_fp32_tflops is not None and a.peak_fp32_tflops > 0
    assert a.memory_gb is not None and a.memory_gb > 0
    assert a.nvlink_domain >= 1
    assert a.nvlink_gbps > 0
    if key == "v100":
        assert a.peak_tf32_tflops is None  # Volta has no TF32 (and no BF16)
    else:
        assert a.peak_tf32_tflops is not None and a.peak_tf32_tflops > 0


def test_cpu_entry_is_measured_at_run_time() -> None:
    cpu = ACCELERATORS["cpu"]
    assert cpu.peak_bf16_tflops is None and cpu.memory_gb is None
    assert cpu.nvlink_domain == 0  # "one node"
    assert cpu.source


# (key, datasheet headline BF16 TFLOP/s *with sparsity* per GPU, citation)
SPARSE_HEADLINES = [
    ("a100-40gb", 624.0, "NVIDIA A100 datasheet: BF16 Tensor Core 312 | 624*"),
    ("a100-80gb", 624.0, "NVIDIA A100 datasheet: BF16 Tensor Core 312 | 624*"),
    ("h100-sxm", 1979.0, "NVIDIA H100 datasheet, SXM: BF16 Tensor Core 1,979 TFLOPS*"),
    ("h100-pcie", 1513.0, "NVIDIA H100 datasheet, PCIe: BF16 Tensor Core 1,513 TFLOPS*"),
    ("h100-nvl", 1671.0, "NVIDIA H100 datasheet, H100 NVL: BF16 Tensor Core 1,671 TFLOPS*"),
    ("h200", 1979.0, "NVIDIA H200 datasheet, SXM: BF16 Tensor Core 1,979 TFLOPS*"),
    ("h200-nvl", 1671.0, "NVIDIA H200 datasheet, H200 NVL: BF16 Tensor Core 1,671 TFLOPS*"),
    ("gh200", 1979.0, "NVIDIA GH200 datasheet: FP16/BF16 1,979 TFLOPS*"),
    ("b200", 36000.0 / 8, "NVIDIA HGX B200 datasheet: FP16/BF16 36 PFLOPS* for 8 GPUs"),
    ("gb200", 360000.0 / 72, "NVIDIA GB200 NVL72 datasheet: FP16/BF16 360 PFLOPS* for 72 GPUs"),
    ("l4", 242.0, "NVIDIA L4 datasheet: BF16 Tensor Core 242 TFLOPS*"),
]


@pytest.mark.parametrize(("key", "sparse", "cite"), SPARSE_HEADLINES)
def test_sparsity_trap_catalog_holds_half_the_sparse_headline(key: str, sparse: float, cite: str) -> None:
    # rel 1e-3: headlines are rounded (H100: 1,979 is 2 x 989.4 = 1,978.9).
    dense = ACCELERATORS[key].peak_bf16_tflops
    assert dense == pytest.approx(sparse / 2, rel=1e-3), cite
    assert ACCELERATORS[key].sparse_bf16_tflops == pytest.approx(sparse), cite


# (key, datasheet headline TF32 TFLOP/s with sparsity)
SPARSE_TF32 = [
    ("a100-80gb", 312.0),  # A100 datasheet: TF32 156 | 312*
    ("h100-sxm", 989.0),  # H100 SXM: TF32 989 TFLOPS* (989.4 rounded)
    ("h100-pcie", 756.0),  # H100 PCIe: TF32 756 TFLOPS*
    ("l4", 120.0),  # L4: TF32 120 TFLOPS*
    ("b200", 18000.0 / 8),  # HGX B200: TF32 18 PFLOPS* for 8 GPUs
]


@pytest.mark.parametrize(("key", "sparse"), SPARSE_TF32)
def test_sparsity_trap_tf32(key: str, sparse: float) -> None:
    assert ACCELERATORS[key].peak_tf32_tflops == pytest.approx(sparse / 2, abs=0.3)


@pytest.mark.parametrize(("key", "dense", "cite"), [
    ("h100-sxm", 989.4, "Llama 3 paper: 400 TFLOP/s per H100 = 41% BF16 MFU -> peak ~980"),
    ("a100-80gb", 312.0, "Narayanan et al. 2021: 141 TFLOP/s = 45% of the 312 TFLOP/s A100 peak"),
    ("mi300x", 1307.4, "AMD MI300X datasheet: BF16 1,307.4 TFLOPS (2,614.9 with sparsity)"),
    ("v100", 125.0, "NVIDIA V100 datasheet: 125 TFLOPS tensor (FP16; no BF16)"),
    ("l40s", 362.05, "NVIDIA L40S datasheet: BF16 362.05 | 733*"),
])
def test_known_dense_peaks(key: str, dense: float, cite: str) -> None:
    assert ACCELERATORS[key].peak_bf16_tflops == pytest.approx(dense), cite


def test_no_entry_holds_a_sparse_headline() -> None:
    for a in ACCELERATORS.values():
        if a.sparse_bf16_tflops is not None:
            assert a.peak_bf16_tflops == pytest.approx(a.sparse_bf16_tflops / 2, rel=1e-3), a.key


@pytest.mark.parametrize("key", sorted(GPU_KEYS))
def test_tensor_rates_are_ordered(key: str) -> None:
    a = ACCELERATORS[key]
    assert a.peak_bf16_tflops is not None and a.peak_fp32_tflops is not None
    if a.peak_tf32_tflops is not None:
        assert a.peak_bf16_tflops >= a.peak_tf32_tflops  # TF32 is half rate (or less) everywhere
        assert a.peak_tf32_tflops >= a.peak_fp32_tflops  # tensor cores beat CUDA cores
    assert a.peak_bf16_tflops > a.peak_fp32_tflops


@pytest.mark.parametrize(("key", "memory_gb", "domain", "gbps"), [
    ("v100", 32, 8, 150),  # NVLink 2: 300 GB/s total
    ("a100-40gb", 40, 8, 300),  # NVLink 3: 600 GB/s total
    ("a100-80gb", 80, 8, 300),
    ("h100-sxm", 80, 8, 450),  # NVLink 4: 900 GB/s total
    ("h100-pcie", 80, 2, 300),  # NVLink bridge: 600 GB/s
    ("h100-nvl", 94, 2, 300),
    ("h200", 141, 8, 450),
    ("h200-nvl", 141, 4, 450),  # 4-way NVLink bridge: 900 GB/s total
    ("b200", 180, 8, 900),  # NVLink 5: 1.8 TB/s total
    ("gb200", 186, 72, 900),  # NVL72: one domain of 72
    ("l40s", 48, 1, 32),  # no NVLink; PCIe Gen4 x16
    ("l4", 24, 1, 32),
    ("a10g", 24, 1, 32),
    ("mi300x", 192, 8, 448),  # 7 x 128 GB/s Infinity Fabric links, total both ways
])
def test_memory_and_nvlink(key: str, memory_gb: float, domain: int, gbps: float) -> None:
    a = ACCELERATORS[key]
    assert (a.memory_gb, a.nvlink_domain, a.nvlink_gbps) == (memory_gb, domain, gbps)


@pytest.mark.parametrize(("key", "gbit"), [
    ("hdr", 200), ("ndr", 400), ("xdr", 800), ("eth-100g", 100), ("eth-200g", 200), ("eth-400g", 400),
    ("efa", 400),  # p5: 3,200 Gbps per 8 GPUs
])
def test_fabric_line_rates(key: str, gbit: float) -> None:
    f = FABRICS[key]
    assert f.gbit_per_gpu == pytest.approx(gbit)
    assert f.gbps_per_gpu == pytest.approx(gbit / 8)
    assert f.name and f.source


# --- peaks per precision and spec overrides ------------------------------------------------------

def test_peak_tflops_for_precisions() -> None:
    h100 = ACCELERATORS["h100-sxm"]
    assert peak_tflops_for(h100, "bf16") == 989.4
    assert peak_tflops_for(h100, "fp16") == 989.4
    assert peak_tflops_for(h100, "fp32") == 494.7  # TF32 tensor cores
    assert peak_tflops_for(ACCELERATORS["v100"], "fp32") == 15.7  # no TF32: CUDA-core FP32
    assert peak_tflops_for(ACCELERATORS["cpu"], "bf16") is None
    assert peak_tflops_for(ACCELERATORS["cpu"], "fp32") is None
    with pytest.raises(ValueError):
        peak_tflops_for(h100, "int8")


def test_resolve_plain_catalog_entry() -> None:
    acc = resolve_accelerator(ClusterSpec(gpu="h100-sxm"))
    assert acc == ACCELERATORS["h100-sxm"]


def test_resolve_applies_overrides() -> None:
    c = ClusterSpec(gpu="h100-sxm", peak_tflops=900.0, memory_gb=64.0, nvlink_domain=4, nvlink_gbps=200.0)
    acc = resolve_accelerator(c)
    assert (acc.peak_bf16_tflops, acc.memory_gb, acc.nvlink_domain, acc.nvlink_gbps) == (900.0, 64.0, 4, 200.0)
    assert acc.peak_tf32_tflops == 494.7  # untouched
    assert ACCELERATORS["h100-sxm"].peak_bf16_tflops == 989.4  # the catalog is not mutated


def test_resolve_custom_accelerator() -> None:
    acc = resolve_accelerator(ClusterSpec(gpu="my-npu", peak_tflops=400.0, memory_gb=96.0, gpus_per_node=4))
    assert (acc.key, acc.peak_bf16_tflops, acc.memory_gb, acc.nvlink_domain) == ("my-npu", 400.0, 96.0, 4)
    assert peak_tflops_for(acc, "fp32") == 400.0  # the only figure we know


def test_resolve_unknown_gpu_without_figures_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"cluster\.gpu = 'my-npu'.*Fix:"):
        resolve_accelerator(ClusterSpec(gpu="my-npu", peak_tflops=400.0))


def test_resolve_nvlink_domain_is_concrete_and_clipped_to_the_node() -> None:
    # The CPU's "0 = one node" becomes gpus_per_node.
    assert resolve_accelerator(ClusterSpec(gpu="cpu", gpus_per_node=4)).nvlink_domain == 4
    # An HGX board's NVLink does not reach past the node: 4 GPUs per node -> domain 4.
    assert resolve_accelerator(ClusterSpec(gpu="h100-sxm", gpus_per_node=4)).nvlink_domain == 4
    # GB200 NVL72 spans 18 trays of 4 GPUs.
    assert resolve_accelerator(ClusterSpec(gpu="gb200", gpus_per_node=4)).nvlink_domain == 72
    # An explicit override is taken as given (e.g. an NVLink Switch system of 256 H100s).
    assert resolve_accelerator(ClusterSpec(gpu="h100-sxm", nvlink_domain=256)).nvlink_domain == 256


def test_resolve_fabric() -> None:
    assert resolve_fabric(ClusterSpec()) == FABRICS["ndr"]
    assert resolve_fabric(ClusterSpec(interconnect="efa")).gbps_per_gpu == 50.0
    assert resolve_fabric(ClusterSpec(interconnect="hdr", inter_node_gbps=12.0)).gbps_per_gpu == 12.0
    assert resolve_fabric(ClusterSpec(interconnect="slingshot", inter_node_gbps=25.0)).gbps_per_gpu == 25.0
    with pytest.raises(SpecError, match=r"cluster\.interconnect = 'slingshot'"):
        resolve_fabric(ClusterSpec(interconnect="slingshot"))


# --- NVML product names --------------------------------------------------------------------------

PRODUCT_NAMES = [
    # Strings as nvidia-smi / nvmlDeviceGetName report them.
    ("Tesla V100-SXM2-16GB", "v100"),
    ("Tesla V100-SXM2-32GB", "v100"),
    ("Tesla V100-PCIE-32GB", "v100"),
    ("Tesla V100S-PCIE-32GB", "v100"),
    ("Tesla V100-SXM3-32GB", "v100"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("A100-SXM4-40GB", "a100-40gb"),  # older drivers: no vendor prefix
    ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA H100 SXM5 80GB", "h100-sxm"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA H200 NVL", "h200-nvl"),  # the PCIe card: H100 NVL compute, 141 GB
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA GH200 144G HBM3e", "gh200"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA GB200", "gb200"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA A10G", "a10g"),
    ("AMD Instinct MI300X", "mi300x"),  # amd-smi
    ("AMD Instinct MI300X OAM", "mi300x"),
    ("  nvidia  h100  80gb  hbm3 ", "h100-sxm"),  # case and spacing do not matter
    # Look-alikes that are NOT catalog parts (different figures): must not be mapped.
    ("NVIDIA H20", None),  # not an H200
    ("NVIDIA H800", None),  # export H100: NVLink cut to 400 GB/s
    ("NVIDIA H800 PCIe", None),
    ("NVIDIA A800-SXM4-80GB", None),
    ("NVIDIA L40", None),  # not an L40S, not an L4
    ("NVIDIA A10", None),  # not the A10G (different tensor rate)
    ("NVIDIA A100X", None),
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None),  # a MIG slice is a fraction of the GPU
    ("NVIDIA GeForce RTX 4090", None),
    ("NVIDIA RTX 6000 Ada Generation", None),
    ("AMD Instinct MI300A", None),
    ("", None),
]


@pytest.mark.parametrize(("name", "key"), PRODUCT_NAMES)
def test_catalog_key_for_product_names(name: str, key: str | None) -> None:
    assert catalog_key_for(name) == key


def test_catalog_key_for_a100_without_size_uses_memory() -> None:
    assert catalog_key_for("NVIDIA A100") is None
    assert catalog_key_for("NVIDIA A100", memory_gb=85.1) == "a100-80gb"
    assert catalog_key_for("NVIDIA A100", memory_gb=42.3) == "a100-40gb"


def test_catalog_key_for_returns_only_catalog_keys() -> None:
    for name, _ in PRODUCT_NAMES:
        key = catalog_key_for(name)
        assert key is None or key in ACCELERATORS


# --- detection -----------------------------------------------------------------------------------

def _fake_pynvml(names: list[str], fail_init: bool = False) -> types.ModuleType:
    mod = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def nvml_init() -> None:
        if fail_init:
            raise NVMLError("Driver Not Loaded")

    mod.NVMLError = NVMLError  # type: ignore[attr-defined]
    mod.nvmlInit = nvml_init  # type: ignore[attr-defined]
    mod.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    mod.nvmlDeviceGetCount = lambda: len(names)  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    mod.nvmlDeviceGetName = lambda h: names[h].encode()  # type: ignore[attr-defined]  # old bindings: bytes
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=85_520_809_984)  # type: ignore[attr-defined]
    return mod


def test_detect_without_driver_returns_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([], fail_init=True))
    assert detect_gpus() == []


def test_detect_without_library_returns_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    assert detect_gpus() == []


def test_detect_maps_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(["NVIDIA H100 80GB HBM3", "NVIDIA H20"]))
    gpus = detect_gpus()
    assert [(g.index, g.name, g.catalog_key) for g in gpus] == [
        (0, "NVIDIA H100 80GB HBM3", "h100-sxm"), (1, "NVIDIA H20", None)]
    assert gpus[0].memory_gb == pytest.approx(85.5)


def test_detect_on_this_machine_does_not_raise() -> None:
    for g in detect_gpus():  # [] here (no driver); real GPUs elsewhere
        assert g.catalog_key is None or g.catalog_key in ACCELERATORS


# --- the command ---------------------------------------------------------------------------------

WIDE = {"COLUMNS": "200"}  # rich would wrap the table at 80 columns in a pipe


def test_hardware_json_lists_every_key() -> None:
    r = trainctl("hardware", "--json", env=WIDE)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert {a["key"] for a in data["accelerators"]} == set(ACCELERATORS)
    assert {f["key"] for f in data["fabrics"]} == set(FABRICS)
    assert isinstance(data["detected"], list)
    h100 = next(a for a in data["accelerators"] if a["key"] == "h100-sxm")
    assert h100["peak_bf16_tflops"] == 989.4 and h100["nvlink_domain"] == 8
    assert next(f for f in data["fabrics"] if f["key"] == "ndr")["gbit_per_gpu"] == 400


def test_hardware_table() -> None:
    r = trainctl("hardware", env=WIDE)
    assert r.returncode == 0, r.stderr
    for key in ("h100-sxm", "mi300x", "989.4", "xdr"):
        assert key in r.stdout


def test_hardware_layer_does_not_import_torch() -> None:
    code = ("import sys, trainctl.hardware, trainctl.cli.hardware_cmd; "
            "trainctl.hardware.detect_gpus(); sys.exit('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr

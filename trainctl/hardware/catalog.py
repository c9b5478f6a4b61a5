"""Catalog of accelerators and inter-node fabrics.

All FLOP/s figures are *dense* (no 2:4 sparsity), per GPU, from the vendor datasheet cited beside
each entry. NVIDIA's datasheets headline the tensor-core figures *with* sparsity (footnote "*With
sparsity"); the dense figure is half of it, and using the sparse one would halve every MFU we report.
Bandwidths are per GPU, one direction, in GB/s (10^9 bytes/s); datasheets quote NVLink as the
bidirectional total, so we halve it. Memory is the datasheet capacity in GB (10^9 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from trainctl.errors import SpecError


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
    # What carries the intra-domain traffic: "nvlink", "pcie" (no NVLink: domain 1 means TP goes
    # over PCIe through the host) or "xgmi" (AMD Infinity Fabric).
    link: str = "nvlink"
    # True when the NVLink domain spans several nodes (GB200 NVL72: 18 trays of 4 GPUs). Otherwise
    # the domain is clipped to the node, since NVLink does not leave an HGX board.
    multi_node_domain: bool = False
    # The datasheet headline (sparse) BF16 figure, kept so a test can check that we halved it.
    # None where the datasheet prints the dense figure itself (AMD, V100, L40S) or there is none (A10G).
    sparse_bf16_tflops: float | None = None
    # The datasheet's maximum board power (TDP / TBP), watts: plan's whole-run energy is this x GPU-hours, an
    # upper bound for the boards alone. None where no datasheet gives a per-GPU figure.
    board_power_w: float | None = None
    # The operator-level step model (plan/operators.py); sources above _OPERATOR_FIGURES below.
    hbm_gbps: float | None = None  # device memory bandwidth, GB/s (datasheet)
    sm_count: int | None = None  # streaming multiprocessors (compute units on AMD): GEMM wave quantization
    # 16-bit GEMM rate / dense peak, published: the best large GEMM of a shape search (MAMF), or a layer's GEMMs
    # at a training step's shapes where the part has that measurement (sources above _OPERATOR_FIGURES)
    gemm_efficiency: float | None = None
    # the measured flash-attention curves the part takes (hardware/attention_curves.py): "a100" or "h100", for
    # "flash2" (FlashAttention-2, what torch's SDPA flash backend runs) and, where the part runs it (Hopper),
    # "flash3" (the FlashAttention-3 / cuDNN class of kernels)
    attention_curves: str | None = None
    runs_flash3: bool = False
    # the part's measured GEMM throughput by shape (hardware/gemm_shapes.py TABLES), where one is published: the
    # share of gemm_efficiency each GEMM's shape reaches (plan/operators.py shape_factor); None: every shape at it
    gemm_shapes: str | None = None
    # Dense FP8 tensor-core peak (e4m3/e5m2 inputs); None = no FP8 tensor cores (V100, A100, A10G), where
    # train.precision fp8 is refused. From the datasheet cited beside the BF16 figure, halved like it.
    peak_fp8_tflops: float | None = None

    def attention(self, kernel: str) -> str | None:
        """The flash kernel this part runs for `kernel`: flash3 falls back to flash2 where the part has no
        FlashAttention-3 figures (it runs on Hopper only); None where the part has no attention figures."""
        if self.attention_curves is None:
            return None
        return "flash3" if kernel == "flash3" and self.runs_flash3 else "flash2"


@dataclass(frozen=True)
class Fabric:
    key: str
    name: str
    gbps_per_gpu: float  # per GPU, one direction, GB/s, assuming one NIC per GPU (rail-optimised)
    source: str

    @property
    def gbit_per_gpu(self) -> float:
        """Line rate in Gb/s, as NICs are sold."""
        return self.gbps_per_gpu * 8


ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA V100 SXM2 datasheet: 125 TFLOPS "Tensor Performance" (FP16 in, FP32 accumulate; dense,
    # Volta has no sparsity) -- V100 has NO BF16 and no TF32, so the "bf16" peak is the FP16 tensor
    # peak (train with precision fp16); FP32 15.7; 32 GB HBM2 (16 GB also sold: override memory_gb);
    # NVLink 2.0 300 GB/s total -> 150 per direction; DGX-1/HGX-1: 8 GPUs (hybrid cube-mesh, not
    # all-to-all: some pairs are 2 hops apart, so TP=8 on V100 is slower than the figure suggests).
    # Board power, same datasheet: max power 300 W (SXM2).
    "v100": Accelerator(key="v100", name="NVIDIA V100 SXM2 32GB", peak_bf16_tflops=125.0, peak_tf32_tflops=None,
                        peak_fp32_tflops=15.7, memory_gb=32.0, nvlink_domain=8, nvlink_gbps=150.0,
                        source="NVIDIA Tesla V100 datasheet (SXM2): 125 TFLOPS FP16 tensor, no BF16",
                        board_power_w=300.0),
    # NVIDIA A100 datasheet (SXM4 40GB): BF16 312 TFLOPS dense (624 with sparsity); TF32 156 (312*);
    # FP32 19.5; 40 GB HBM2; NVLink 3.0 600 GB/s -> 300 per direction; HGX A100: 8 GPUs, NVSwitch.
    # Board power, same datasheet: max TDP 400 W (SXM4).
    "a100-40gb": Accelerator(key="a100-40gb", name="NVIDIA A100 SXM4 40GB", peak_bf16_tflops=312.0,
                             peak_tf32_tflops=156.0, peak_fp32_tflops=19.5, memory_gb=40.0, nvlink_domain=8,
                             nvlink_gbps=300.0, source="NVIDIA A100 datasheet: BF16 312 dense / 624 sparse",
                             sparse_bf16_tflops=624.0,
                             board_power_w=400.0),
    # Same datasheet, 80GB HBM2e SXM4 column: compute identical to the 40 GB part.
    # Board power, same datasheet: max TDP 400 W (SXM4).
    "a100-80gb": Accelerator(key="a100-80gb", name="NVIDIA A100 SXM4 80GB", peak_bf16_tflops=312.0,
                             peak_tf32_tflops=156.0, peak_fp32_tflops=19.5, memory_gb=80.0, nvlink_domain=8,
                             nvlink_gbps=300.0, source="NVIDIA A100 datasheet: BF16 312 dense / 624 sparse",
                             sparse_bf16_tflops=624.0,
                             board_power_w=400.0),
    # NVIDIA H100 datasheet, SXM5 column: BF16 1,979 TFLOPS *with sparsity* -> 989.4 dense (132 SMs x
    # 4096 FLOP/clk x 1.83 GHz); TF32 989* -> 494.7; FP32 67; 80 GB HBM3; NVLink 4 900 GB/s -> 450
    # per direction; HGX H100: 8 GPUs on NVSwitch.
    # Board power, same datasheet: max TDP up to 700 W (configurable).
    "h100-sxm": Accelerator(key="h100-sxm", name="NVIDIA H100 SXM 80GB", peak_bf16_tflops=989.4, peak_tf32_tflops=494.7,
                            peak_fp32_tflops=67.0, memory_gb=80.0, nvlink_domain=8, nvlink_gbps=450.0,
                            source="NVIDIA H100 datasheet (SXM): BF16 1,979 sparse -> 989.4 dense",
                            sparse_bf16_tflops=1979.0,
                            peak_fp8_tflops=1979.0,  # FP8 3,958 sparse -> 1,979 dense
                            board_power_w=700.0),
    # NVIDIA H100 datasheet, PCIe column: BF16 1,513* -> 756.5 dense; TF32 756* -> 378; FP32 51;
    # 80 GB HBM2e; NVLink bridge pairs 2 cards at 600 GB/s -> 300 per direction (domain 2); without
    # the bridge, PCIe Gen5 64 GB/s per direction: set nvlink_domain 1, nvlink_gbps 64.
    # Board power, same datasheet: max TDP 300-350 W (configurable): the upper end.
    "h100-pcie": Accelerator(key="h100-pcie", name="NVIDIA H100 PCIe 80GB", peak_bf16_tflops=756.5,
                             peak_tf32_tflops=378.0, peak_fp32_tflops=51.0, memory_gb=80.0, nvlink_domain=2,
                             nvlink_gbps=300.0, source="NVIDIA H100 datasheet (PCIe): BF16 1,513 sparse -> 756.5 dense",
                             sparse_bf16_tflops=1513.0,
                             peak_fp8_tflops=1513.0,  # FP8 3,026 sparse -> 1,513 dense
                             board_power_w=350.0),
    # NVIDIA H100 datasheet, H100 NVL column (per card; early editions quoted the bridged pair):
    # BF16 1,671* -> 835.5 dense; TF32 835* -> 417.5; FP32 60; 94 GB HBM3; NVLink bridge 600 GB/s ->
    # 300 per direction between the 2 bridged cards.
    # Board power, same datasheet: max TDP 350-400 W (configurable): the upper end.
    "h100-nvl": Accelerator(key="h100-nvl", name="NVIDIA H100 NVL 94GB", peak_bf16_tflops=835.5, peak_tf32_tflops=417.5,
                            peak_fp32_tflops=60.0, memory_gb=94.0, nvlink_domain=2, nvlink_gbps=300.0,
                            source="NVIDIA H100 datasheet (H100 NVL): BF16 1,671 sparse -> 835.5 dense",
                            sparse_bf16_tflops=1671.0,
                            peak_fp8_tflops=1670.5,  # FP8 3,341 sparse -> 1,670.5 dense
                            board_power_w=400.0),
    # NVIDIA H200 datasheet, SXM column: same GH100 compute as H100 SXM: BF16 1,979* -> 989.4; TF32
    # 989* -> 494.7; FP32 67; 141 GB HBM3e; NVLink 900 GB/s -> 450; HGX H200: 8 GPUs.
    # Board power, same datasheet: max TDP up to 700 W (configurable).
    "h200": Accelerator(key="h200", name="NVIDIA H200 SXM 141GB", peak_bf16_tflops=989.4, peak_tf32_tflops=494.7,
                        peak_fp32_tflops=67.0, memory_gb=141.0, nvlink_domain=8, nvlink_gbps=450.0,
                        source="NVIDIA H200 datasheet (SXM): BF16 1,979 sparse -> 989.4 dense",
                        sparse_bf16_tflops=1979.0,
                        peak_fp8_tflops=1979.0,  # FP8 3,958 sparse -> 1,979 dense
                        board_power_w=700.0),
    # NVIDIA H200 datasheet, H200 NVL column (a PCIe card): BF16 1,671* -> 835.5 dense, the H100 NVL's compute;
    # TF32 835* -> 417.5; FP32 60; 141 GB HBM3e at 4.8 TB/s; 2- or 4-way NVLink bridge, 900 GB/s -> 450 per
    # direction: domain 4, the 4-way bridge (a 2-way bridged server: set nvlink_domain 2).
    # Board power, same datasheet: max TDP up to 600 W (configurable).
    "h200-nvl": Accelerator(key="h200-nvl", name="NVIDIA H200 NVL 141GB", peak_bf16_tflops=835.5,
                            peak_tf32_tflops=417.5, peak_fp32_tflops=60.0, memory_gb=141.0, nvlink_domain=4,
                            nvlink_gbps=450.0,
                            source="NVIDIA H200 datasheet (H200 NVL): BF16 1,671 sparse -> 835.5 dense",
                            sparse_bf16_tflops=1671.0,
                            peak_fp8_tflops=1670.5,  # FP8 3,341 sparse -> 1,670.5 dense
                            board_power_w=600.0),
    # NVIDIA GH200 Grace Hopper Superchip datasheet: GPU BF16 1,979* -> 989.4; TF32 989* -> 494.7;
    # FP32 67; 96 GB HBM3 (144 GB HBM3e version: override memory_gb). Domain 4: the common quad-GH200
    # node (HPE Cray EX254n, as in CSCS Alps / JUPITER), NVLink 4, 18 links x 25 GB/s = 450 per
    # direction per GPU. A GH200 NVL32 rack: set nvlink_domain 32.
    # Board power, same datasheet: module power configurable up to 1,000 W, Grace CPU and LPDDR5X included.
    "gh200": Accelerator(key="gh200", name="NVIDIA GH200 Grace Hopper 96GB", peak_bf16_tflops=989.4,
                         peak_tf32_tflops=494.7, peak_fp32_tflops=67.0, memory_gb=96.0, nvlink_domain=4,
                         nvlink_gbps=450.0, source="NVIDIA GH200 datasheet: BF16 1,979 sparse -> 989.4 dense",
                         sparse_bf16_tflops=1979.0,
                         peak_fp8_tflops=1979.0,  # FP8 3,958 sparse -> 1,979 dense
                         board_power_w=1000.0),
    # NVIDIA HGX B200 datasheet (8 GPUs): FP16/BF16 36 PFLOPS* -> 4.5 per GPU sparse -> 2,250 dense;
    # TF32 18 PFLOPS* -> 1,125 dense per GPU; FP32 600 TFLOPS -> 75 per GPU; 1,440 GB HBM3e -> 180
    # per GPU (sold as "192 GB"; 180 usable); NVLink 5 1.8 TB/s -> 900 per direction; 8 per board.
    # Board power, same datasheet: max TDP up to 1,000 W per GPU.
    "b200": Accelerator(key="b200", name="NVIDIA B200 SXM 180GB", peak_bf16_tflops=2250.0, peak_tf32_tflops=1125.0,
                        peak_fp32_tflops=75.0, memory_gb=180.0, nvlink_domain=8, nvlink_gbps=900.0,
                        source="NVIDIA HGX B200 datasheet: BF16 36 PF sparse / 8 GPUs -> 2,250 dense per GPU",
                        sparse_bf16_tflops=4500.0,
                        peak_fp8_tflops=4500.0,  # FP8 72 PF sparse / 8 GPUs -> 4,500 dense per GPU
                        board_power_w=1000.0),
    # NVIDIA GB200 NVL72 datasheet (72 GPUs): FP16/BF16 360 PFLOPS* -> 5,000 sparse per GPU -> 2,500
    # dense; TF32 180 PF* -> 1,250 dense; FP32 5,760 TFLOPS -> 80; HBM3e 13.4 TB -> 186 GB per GPU;
    # NVLink 5 130 TB/s / 72 = 1.8 TB/s -> 900 per direction; one NVLink domain across the 72-GPU rack
    # (18 compute trays of 4 GPUs: set gpus_per_node 4).
    # Board power: no per-GPU board power in the datasheet (it gives the rack's): energy is not priced.
    "gb200": Accelerator(key="gb200", name="NVIDIA GB200 (NVL72)", peak_bf16_tflops=2500.0, peak_tf32_tflops=1250.0,
                         peak_fp32_tflops=80.0, memory_gb=186.0, nvlink_domain=72, nvlink_gbps=900.0,
                         source="NVIDIA GB200 NVL72 datasheet: BF16 360 PF sparse / 72 GPUs -> 2,500 dense per GPU",
                         multi_node_domain=True, sparse_bf16_tflops=5000.0, peak_fp8_tflops=5000.0),
    # NVIDIA L40S datasheet: "BF16 Tensor Core 362.05 | 733*" -- the dense figure is printed, and the
    # sparse one is not exactly twice it, so we take 362.05 as printed; TF32 183 (366*); FP32 91.6;
    # 48 GB GDDR6; no NVLink: PCIe Gen4 x16 64 GB/s bidirectional -> 32 per direction.
    # Board power, same datasheet: max power 350 W.
    "l40s": Accelerator(key="l40s", name="NVIDIA L40S 48GB", peak_bf16_tflops=362.05, peak_tf32_tflops=183.0,
                        peak_fp32_tflops=91.6, memory_gb=48.0, nvlink_domain=1, nvlink_gbps=32.0,
                        source="NVIDIA L40S datasheet: BF16 362.05 dense / 733 sparse", link="pcie",
                        peak_fp8_tflops=733.0,  # FP8 tensor 733 dense / 1,466 sparse, as printed
                        board_power_w=350.0),
    # NVIDIA L4 datasheet: BF16 242* -> 121 dense; TF32 120* -> 60; FP32 30.3; 24 GB GDDR6; no NVLink,
    # PCIe Gen4 x16 64 GB/s -> 32 per direction.
    # Board power, same datasheet: max power 72 W.
    "l4": Accelerator(key="l4", name="NVIDIA L4 24GB", peak_bf16_tflops=121.0, peak_tf32_tflops=60.0,
                      peak_fp32_tflops=30.3, memory_gb=24.0, nvlink_domain=1, nvlink_gbps=32.0,
                      source="NVIDIA L4 datasheet: BF16 242 sparse -> 121 dense", link="pcie",
                      sparse_bf16_tflops=242.0,
                      peak_fp8_tflops=242.5,  # FP8 485 sparse -> 242.5 dense
                      board_power_w=72.0),
    # NVIDIA A10G (AWS G5 only; no public NVIDIA datasheet). Its tensor rate is below the A10's (A10
    # datasheet: BF16 125 dense); AWS/NVIDIA figures as compared by Baseten (2023): BF16 70 dense,
    # TF32 35, FP32 31.52; 24 GB GDDR6; no NVLink, PCIe Gen4 -> 32 per direction. Least certain entry.
    # Board power: no datasheet board power: energy is not priced.
    "a10g": Accelerator(key="a10g", name="NVIDIA A10G 24GB (AWS G5)", peak_bf16_tflops=70.0, peak_tf32_tflops=35.0,
                        peak_fp32_tflops=31.52, memory_gb=24.0, nvlink_domain=1, nvlink_gbps=32.0,
                        source="AWS G5 / NVIDIA A10G figures (no public datasheet): BF16 70 dense", link="pcie"),
    # AMD Instinct MI300X datasheet: BF16 1,307.4 TFLOPS dense (2,614.9 with sparsity, listed
    # separately, so the headline is already dense); TF32 653.7; FP32 163.4; 192 GB HBM3; platform of
    # 8 OAMs, 7 Infinity Fabric links x 128 GB/s bidirectional = 896 -> 448 per direction.
    # Board power, same datasheet: peak total board power 750 W.
    "mi300x": Accelerator(key="mi300x", name="AMD Instinct MI300X 192GB", peak_bf16_tflops=1307.4,
                          peak_tf32_tflops=653.7, peak_fp32_tflops=163.4, memory_gb=192.0, nvlink_domain=8,
                          nvlink_gbps=448.0, source="AMD Instinct MI300X datasheet: BF16 1,307.4 dense", link="xgmi",
                          # FP8 2,614.9 dense, but in AMD's fnuz formats, which the trainer's FP8 GEMMs do not
                          # produce (runtime/model/fp8.py): no peak_fp8_tflops, so fp8 is refused
                          board_power_w=750.0),
    # A host CPU: peak is measured at run time by a matmul micro-benchmark and cached.
    "cpu": Accelerator(key="cpu", name="Host CPU (measured matmul rate)", peak_bf16_tflops=None, peak_tf32_tflops=None,
                       peak_fp32_tflops=None, memory_gb=None, nvlink_domain=0, nvlink_gbps=10.0,
                       source="measured on this machine at run time", link="shm"),
}

# --- The operator-level step model's figures (plan/operators.py), each from the source named beside it. None of
# them is fitted to the published runs the plan is checked against (recipes/published/, docs/validation.md).
#
# hbm_gbps: the datasheet's memory bandwidth (the same datasheets as above): V100 SXM2 900 GB/s; A100 40GB 1,555;
#   A100 80GB SXM 2,039; H100 SXM 3.35 TB/s; H100 PCIe 2.0 TB/s; H100 NVL 3.9 TB/s; H200 and H200 NVL 4.8 TB/s;
#   GH200 (96 GB HBM3) 4 TB/s; HGX B200 64 TB/s / 8; GB200 NVL72 576 TB/s / 72; L40S 864 GB/s; L4 300 GB/s;
#   A10G 600 GB/s (AWS G5 page); MI300X 5.3 TB/s.
# sm_count: the architecture whitepapers: V100 80 SMs (Volta whitepaper), A100 108 (Ampere GA100 whitepaper),
#   H100 SXM5 132 / PCIe 114 (Hopper whitepaper; H200, H200 NVL, GH200 and H100 NVL carry the SXM5's 132), B200
#   148 (Blackwell datasheet's GPU), L40S 142 and L4 58 (Ada whitepaper), A10G 80 (GA102), MI300X 304 CUs (CDNA 3
#   whitepaper).
# gemm_efficiency: the best 16-bit matmul found by a shape search over M, N, K, divided by the dense peak: Stas
#   Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
#   comparison table" (BF16, torch 2.6-2.7 with CUDA 12.6; mamf-finder.py): A100 SXM 271.2 / 312 = 86.9%, GH200
#   828.6 / 989 = 83.8%, H100 SXM 794.5 / 989 = 80.3%, B200 1,745 / 2,250 = 77.6%, MI300X 781.9 / 1,300 = 60.1%
#   (v1 table, ROCm 6.2). Parts the table lacks take the measured part of the same die; the rest (V100, Ada,
#   A10G) take 0.80, the median of the table's NVIDIA parts (an assumption, printed as the catalog's source).
#   Four families have a measurement at a training step's shapes, which the catalog takes over the best shape:
#   A100 SXM (40 and 80 GB, the same die): Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
#   Transformer Models" (arXiv 2205.05198), Table 4, times one layer of their 22B model on A100 80GB GPUs (Selene):
#   hidden 6144, 64 heads, 4 sequences of 2048, GELU, LayerNorm, biases, dropout 0.1, TP8, Megatron-LM's unfused
#   attention, forward 7.7 ms and backward 11.9 ms, 19.6 ms in all. That layer's two forward all-reduces are exposed
#   and its two backward ones run beside the weight-gradient GEMMs (Megatron's async TP all-reduce). The efficiency
#   at which plan/operators.py's layer_seconds plus the two all-reduces at NCCL's model below give 19.6 ms is 0.684
#   (the GEMMs, wave-quantized, at 206 TFLOP/s, 66% of peak; the best-shape search found 86.9%). The same table's
#   four other rows (sequence parallelism, full and selective recomputation) are not fitted to and land within
#   -2.1% .. +1.0% (tests/unit/test_plan_operators.py recomputes all five).
#   H100 SXM: Transformer Engine's documentation, "Getting Started" (docs/getting_started/, its PyTorch benchmark
#   and the .out it printed, 2026-01), times one layer of hidden 4096, FFN 16384, 32 heads, batch 8 x 2048 tokens,
#   GELU, LayerNorm, biases, dropout 0.1, causal, BF16, forward and backward, with TE's Linear and LayerNorm and
#   its fused attention ("TE Unfused + TE Attention") at 35.709 ms, the mean of 100 iterations after 10. The
#   efficiency at which plan/operators.py's layer_seconds gives those 35.709 ms, its attention as the flash3 kernel
#   below and every other figure as this catalog has it (its GEMMs' shapes too, below), is 0.671: the GEMMs at 647
#   TFLOP/s, 65% of peak (tests/unit/test_plan_operators.py recomputes it; the same page's JAX layer, 35.054 ms,
#   gives 0.686). The page says "an NVIDIA H100 GPU"; the SXM is inferred: priced the same way, the layer would put
#   a 400 W H100 NVL's GEMMs at 0.795 and a PCIe card's at 0.938, above the 0.736 of the H200 NVL below (the same
#   compute at 600 W).
#   H100 PCIe, H100 NVL and H200 (the same die) take it.
#   H200 NVL: Transformer Engine's documentation, "GEMM Profiling Tutorial" ("Worked Example: 5B Model on H200",
#   BF16, CUDA events), times the 12 GEMMs of one layer of hidden 4096, FFN 16384, 15,872 tokens (forward, data
#   and weight gradients) at 32.014 ms on an H200 NVL: 599 TFLOP/s, 71.7% of its peak; the efficiency at which
#   plan/operators.py's wave-quantized gemm_seconds gives those 32.014 ms is 0.736 (the same test file).
#   B200 and GB200: the same tutorial ("GEMM Benchmark (Model Config Mode) on NVIDIA B300 SXM6 AC", the same layer
#   and mode) times those 12 GEMMs in BF16 at 12.758 ms on a B300: 1,503 TFLOP/s. Blackwell Ultra's datasheet gives
#   the B200's BF16 tensor rate (HGX B300 and HGX B200 both 36 PFLOPS sparse for 8 GPUs: 2,250 dense each); the
#   efficiency at which gemm_seconds gives 12.758 ms on a B200 is 0.674 (the same test file), where the best-shape
#   search found 77.6%. GB200 takes it against its own 2,500 peak (the same die at its higher power), as the
#   Hopper parts above take the H100's.
# gemm_shapes: the share of that figure a GEMM's shape reaches, from a measured table where one is published
#   (hardware/gemm_shapes.py, plan/operators.py shape_factor): Hopper parts take OpenXLA's sm_90 BF16 table (375
#   shapes, m, n, k 256-4096, batch 1-4), relative to its plateau (4 x 4096^3, 789 TFLOP/s): 4096 x 4096 x 2048
#   reaches 93% of it, 4096 x 4096 x 1024 87%, 4096 x 2048 x 1024 77%. The layer figures above are derived with
#   it (their training shapes sit at or near the plateau). Other parts have no
#   such table: every shape at their figure, less its wave quantization.
# attention_curves: the causal flash-attention kernels' measured throughput by head dim and sequence length, from
#   the FlashAttention repository's published benchmarks (hardware/attention_curves.py, which cites each figure):
#   "h100" (H100 SXM5: FlashAttention-2 and FlashAttention-3) and "a100" (A100 SXM4: FlashAttention-2); at head dim
#   128 and 4K tokens FlashAttention-3 runs its forward at 579 TFLOP/s (59% of peak; its best, 740-756 at head dim
#   256 without the causal mask, is the 75% of the paper's abstract) and its backward at 428 (43%),
#   FlashAttention-2 at 319 and 285 on H100 and at 57% and 49% of peak on A100. Hopper parts take the H100's
#   curves, Ampere and Ada parts the A100's, Blackwell the H100's FlashAttention-2 curves (no published Blackwell
#   figure: an assumption); V100 has no flash kernel (torch runs its memory-efficient kernel) and MI300X no figure
#   here: the A100's curves, an assumption.
_MEDIAN_GEMM = 0.80
_A100_GEMM = 0.684  # Korthikanti et al. 2022's A100 layer (above); the A100 SXM's MAMF figure was 0.869
_H100_GEMM = 0.671  # Transformer Engine's H100 layer (above), with the sm_90 shape table; the MAMF figure was 0.803
_BLACKWELL_GEMM = 0.674  # Transformer Engine's B300 layer's GEMMs (above); the B200's MAMF figure was 0.776
_HOPPER = dict(attention_curves="h100", runs_flash3=True, gemm_shapes="sm90")
_OPERATOR_FIGURES: dict[str, dict[str, Any]] = {
    "v100": dict(hbm_gbps=900.0, sm_count=80, gemm_efficiency=_MEDIAN_GEMM, attention_curves="a100"),
    "a100-40gb": dict(hbm_gbps=1555.0, sm_count=108, gemm_efficiency=_A100_GEMM, attention_curves="a100"),
    "a100-80gb": dict(hbm_gbps=2039.0, sm_count=108, gemm_efficiency=_A100_GEMM, attention_curves="a100"),
    "h100-sxm": dict(hbm_gbps=3350.0, sm_count=132, gemm_efficiency=_H100_GEMM, **_HOPPER),
    "h100-pcie": dict(hbm_gbps=2000.0, sm_count=114, gemm_efficiency=_H100_GEMM, **_HOPPER),
    "h100-nvl": dict(hbm_gbps=3900.0, sm_count=132, gemm_efficiency=_H100_GEMM, **_HOPPER),
    "h200": dict(hbm_gbps=4800.0, sm_count=132, gemm_efficiency=_H100_GEMM, **_HOPPER),
    "h200-nvl": dict(hbm_gbps=4800.0, sm_count=132, gemm_efficiency=0.736, **_HOPPER),
    "gh200": dict(hbm_gbps=4000.0, sm_count=132, gemm_efficiency=0.838, **_HOPPER),
    "b200": dict(hbm_gbps=8000.0, sm_count=148, gemm_efficiency=_BLACKWELL_GEMM, attention_curves="h100"),
    "gb200": dict(hbm_gbps=8000.0, sm_count=148, gemm_efficiency=_BLACKWELL_GEMM, attention_curves="h100"),
    "l40s": dict(hbm_gbps=864.0, sm_count=142, gemm_efficiency=_MEDIAN_GEMM, attention_curves="a100"),
    "l4": dict(hbm_gbps=300.0, sm_count=58, gemm_efficiency=_MEDIAN_GEMM, attention_curves="a100"),
    "a10g": dict(hbm_gbps=600.0, sm_count=80, gemm_efficiency=_MEDIAN_GEMM, attention_curves="a100"),
    "mi300x": dict(hbm_gbps=5300.0, sm_count=304, gemm_efficiency=0.601, attention_curves="a100"),
}
ACCELERATORS = {k: replace(a, **_OPERATOR_FIGURES.get(k, {})) for k, a in ACCELERATORS.items()}

# --- Collectives as NCCL prices them (plan/rates.py `AssumedRates.comm`).
# Latency: NCCL's own cost model, src/graph/tuning.cc (NVIDIA/nccl, default tuner constants), Simple protocol:
#   a base latency of 8.4 us per call (ring and tree), plus a per-step hardware latency: ring 3.4 us on NVLink,
#   5.7 on PCIe, 14 on the network; tree 4.0 on NVLink and PCIe, 14 on the network. A ring all-reduce over n ranks
#   takes 2(n-1) steps (n-1 for a reduce-scatter or an all-gather), a tree all-reduce 2 x (the node's ranks - 1)
#   intra-node steps plus 2 log2(nodes) network steps; NCCL's tree bandwidth is 0.92 x the ring's (same file).
NCCL_BASE_LATENCY_S = 8.4e-6
NCCL_STEP_LATENCY_S = {"ring": {"nvlink": 3.4e-6, "pcie": 5.7e-6, "net": 14e-6},
                       "tree": {"nvlink": 4.0e-6, "pcie": 4.0e-6, "net": 14e-6}}
NCCL_TREE_BANDWIDTH = 0.92
# Bus bandwidth reached, over the link's one-direction rate: NVLink 370 of 450 GB/s measured for an H100 node's
# all-reduce without SHARP (Austin et al. 2025, "How to Scale Your Model", the GPU chapter's measurement) = 0.82;
# the network 340 of 400 Gb/s measured with all_reduce_bench.py on AWS EFA (Bekman, "Machine Learning
# Engineering", training/performance, the IDEFICS-80B estimate) = 0.85.
BUS_EFFICIENCY = {"nvlink": 370 / 450, "pcie": 370 / 450, "xgmi": 370 / 450, "shm": 1.0, "net": 340 / 400}

FABRICS: dict[str, Fabric] = {
    # Line rate / 8 = GB/s per direction; one NIC (port) per GPU as on rail-optimised HGX clusters.
    # NVIDIA ConnectX-6 HDR InfiniBand: 200 Gb/s per port = 25 GB/s per direction.
    "hdr": Fabric(key="hdr", name="InfiniBand HDR 200G", gbps_per_gpu=25.0,
                  source="NVIDIA ConnectX-6 datasheet: HDR 200 Gb/s"),
    # NVIDIA ConnectX-7 NDR InfiniBand: 400 Gb/s per port = 50 GB/s per direction.
    "ndr": Fabric(key="ndr", name="InfiniBand NDR 400G", gbps_per_gpu=50.0,
                  source="NVIDIA ConnectX-7 datasheet: NDR 400 Gb/s"),
    # NVIDIA ConnectX-8 XDR InfiniBand: 800 Gb/s per port = 100 GB/s per direction.
    "xdr": Fabric(key="xdr", name="InfiniBand XDR 800G", gbps_per_gpu=100.0,
                  source="NVIDIA ConnectX-8 SuperNIC: XDR 800 Gb/s"),
    # RoCE / plain Ethernet NICs at the named line rate.
    "eth-100g": Fabric(key="eth-100g", name="Ethernet/RoCE 100G", gbps_per_gpu=12.5, source="100 GbE line rate"),
    "eth-200g": Fabric(key="eth-200g", name="Ethernet/RoCE 200G", gbps_per_gpu=25.0, source="200 GbE line rate"),
    "eth-400g": Fabric(key="eth-400g", name="Ethernet/RoCE 400G", gbps_per_gpu=50.0,
                       source="400 GbE line rate (e.g. Spectrum-X, ConnectX-7)"),
    # AWS p5.48xlarge: 3,200 Gbps of EFAv2 per instance of 8 H100 -> 400 Gb/s = 50 GB/s per GPU.
    "efa": Fabric(key="efa", name="AWS EFA (p5, 3200 Gbps / 8 GPUs)", gbps_per_gpu=50.0,
                  source="AWS EC2 P5 instance page: 3,200 Gbps EFA"),
}


def accelerator_names() -> list[str]:
    return sorted(ACCELERATORS)


def fabric_names() -> list[str]:
    return sorted(FABRICS)


def peak_tflops_for(acc: Accelerator, precision: str) -> float | None:
    """The dense peak a run in `precision` can reach; None when unknown (CPU: measured at run time).

    bf16/fp16 run on the 16-bit tensor cores (same rate on every catalog GPU). fp32 training runs
    matmuls in TF32 on GPUs that have it (PyTorch's allow_tf32), else at the plain FP32 rate (V100);
    with neither figure (a custom accelerator or an overridden CPU) the only peak we know is used.
    """
    p = precision.lower()
    if p in ("bf16", "fp16", "fp8"):  # fp8: MFU against the BF16 peak, as torchtitan and Megatron report it
        return acc.peak_bf16_tflops
    if p in ("fp32", "tf32"):
        for peak in (acc.peak_tf32_tflops, acc.peak_fp32_tflops, acc.peak_bf16_tflops):
            if peak is not None:
                return peak
        return None
    raise ValueError(f"unknown precision {precision!r}; expected bf16, fp16, fp32 or fp8")


def gemm_speedup(acc: Accelerator, precision: str) -> float:
    """How many times faster than at `peak_tflops_for` the linear layers' GEMMs run in `precision`: the FP8
    peak over the BF16 peak for fp8 on a part with FP8 tensor cores (H100 SXM: 1,979 / 989.4 = 2.0), else 1
    (a CPU emulates FP8: no faster). The plan prices those GEMMs' FLOPs at this multiple of the rate."""
    if precision.lower() != "fp8" or not acc.peak_fp8_tflops or not acc.peak_bf16_tflops:
        return 1.0
    return acc.peak_fp8_tflops / acc.peak_bf16_tflops


def resolve_accelerator(cluster: Any) -> Accelerator:
    """The cluster's accelerator: the catalog entry with the spec's overrides applied.

    `cluster` is a `ClusterSpec` (duck-typed: gpu, gpus_per_node, peak_tflops, memory_gb,
    nvlink_domain, nvlink_gbps). The returned `nvlink_domain` is always concrete (>= 1): the
    catalog's 0 ("one node") becomes gpus_per_node, and a board-level domain is clipped to the node
    (an HGX board's NVLink does not reach the next node); an explicit override is taken as given.
    """
    gpu: str = cluster.gpu
    per_node: int = cluster.gpus_per_node
    peak = getattr(cluster, "peak_tflops", None)
    memory = getattr(cluster, "memory_gb", None)
    domain = getattr(cluster, "nvlink_domain", None)
    link_gbps = getattr(cluster, "nvlink_gbps", None)

    base = ACCELERATORS.get(gpu)
    if base is None:
        if peak is None or memory is None:
            raise SpecError([
                f"cluster.gpu = {gpu!r}: not in the hardware catalog. Fix: use one of "
                f"{', '.join(accelerator_names())} (see `trainctl hardware`), or give cluster.peak_tflops "
                "and cluster.memory_gb for a custom accelerator"
            ])
        # A custom part: assume one node is one NVLink domain unless told; 100 GB/s is a cautious
        # NVLink-class guess the user is expected to override.
        base = Accelerator(key=gpu, name=f"custom accelerator ({gpu})", peak_bf16_tflops=peak, peak_tf32_tflops=None,
                           peak_fp32_tflops=None, memory_gb=memory, nvlink_domain=0, nvlink_gbps=100.0,
                           source="cluster spec overrides (custom accelerator)")

    changes: dict[str, Any] = {}
    if peak is not None:
        changes["peak_bf16_tflops"] = float(peak)
        changes["source"] = base.source + "; peak overridden by cluster.peak_tflops"
    if memory is not None:
        changes["memory_gb"] = float(memory)
    if link_gbps is not None:
        changes["nvlink_gbps"] = float(link_gbps)
    if domain is not None:
        changes["nvlink_domain"] = int(domain)
    elif base.nvlink_domain == 0:
        changes["nvlink_domain"] = per_node
    elif not base.multi_node_domain:
        changes["nvlink_domain"] = min(base.nvlink_domain, per_node)
    return replace(base, **changes) if changes else base


def resolve_fabric(cluster: Any) -> Fabric:
    """The cluster's inter-node fabric, with `cluster.inter_node_gbps` applied if given."""
    key: str = getattr(cluster, "interconnect", "ndr")
    override = getattr(cluster, "inter_node_gbps", None)
    base = FABRICS.get(key)
    if base is None:
        if override is None:
            raise SpecError([
                f"cluster.interconnect = {key!r}: not a known fabric. Fix: use one of "
                f"{', '.join(fabric_names())} or set cluster.inter_node_gbps"
            ])
        return Fabric(key=key, name=f"custom fabric ({key})", gbps_per_gpu=float(override),
                      source="cluster.inter_node_gbps")
    if override is not None:
        return replace(base, gbps_per_gpu=float(override), source=base.source + "; overridden by inter_node_gbps")
    return base

"""The peak FLOP/s behind every MFU figure: the GPU's NVML name -> catalog -> dense peak for the precision
(BF16/FP16 tensor, TF32 for fp32 training; never the sparsity figure), cluster.peak_tflops wins, the CPU's
measured rate otherwise; the source is recorded; MFU above 100% is shown as a bug, not as a number."""

from __future__ import annotations

import pytest

from trainctl.hardware.catalog import ACCELERATORS
from trainctl.spec import load_spec_text

torch = pytest.importorskip("torch")
from trainctl.runtime.observe import metrics, peak  # noqa: E402 - needs torch

BASE = """
name: p
model: {preset: tiny}
train: {global_batch: 8, steps: 1, precision: PREC}
data: {synthetic: true}
cluster: {nodes: 1, gpus_per_node: 8, gpu: GPU EXTRA}
launcher: {backend: local}
"""


def spec(prec: str = "bf16", gpu: str = "h100-sxm", extra: str = ""):
    return load_spec_text(BASE.replace("PREC", prec).replace("GPU", gpu).replace(" EXTRA", extra))


@pytest.fixture
def nvml(monkeypatch):
    def set_name(name: str | None) -> None:
        monkeypatch.setattr(peak, "gpu_product_name", lambda index: name)
    return set_name


CUDA = torch.device("cuda", 0)


def test_h100_bf16_is_the_dense_figure(nvml):
    nvml("NVIDIA H100 80GB HBM3")
    flops, source = peak.peak_flops_per_rank(spec("bf16"), CUDA)
    assert flops == 989.4e12 and abs(flops - ACCELERATORS["h100-sxm"].sparse_bf16_tflops * 1e12 / 2) < 0.2e12
    assert "h100-sxm" in source and "dense BF16" in source and "NVML" in source


def test_fp32_training_uses_tf32_peak(nvml):
    nvml("NVIDIA A100-SXM4-80GB")
    flops, source = peak.peak_flops_per_rank(spec("fp32", gpu="a100-80gb"), CUDA)
    assert flops == 156e12 and "TF32" in source


def test_detected_gpu_wins_over_the_spec_name(nvml, capsys):
    nvml("NVIDIA H100 80GB HBM3")
    flops, source = peak.peak_flops_per_rank(spec("bf16", gpu="a100-80gb"), CUDA)
    assert flops == 989.4e12 and "h100-sxm" in source
    assert "cluster.gpu" in capsys.readouterr().err  # the mismatch is pointed out


def test_unknown_gpu_falls_back_to_the_spec(nvml):
    nvml("NVIDIA Mystery GPU")
    flops, source = peak.peak_flops_per_rank(spec("bf16", gpu="a100-80gb"), CUDA)
    assert flops == 312e12 and "cluster.gpu" in source


def test_spec_override_wins(nvml):
    nvml("NVIDIA H100 80GB HBM3")
    flops, source = peak.peak_flops_per_rank(spec("bf16", extra=", peak_tflops: 500"), CUDA)
    assert flops == 500e12 and source == "spec cluster.peak_tflops"


def test_cpu_peak_is_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flops, source = peak.peak_flops_per_rank(spec("fp32", gpu="cpu"), torch.device("cpu"))
    assert flops > 1e8 and "measured" in source
    assert peak.cache_path().exists()
    monkeypatch.setattr(peak, "measure_matmul_flops", lambda *a, **k: pytest.fail("not cached"))
    again, _ = peak.peak_flops_per_rank(spec("fp32", gpu="cpu"), torch.device("cpu"))
    assert again == flops


def test_record_names_its_peak_and_flags_mfu_above_100_percent():
    fm = metrics.FlopsModel.from_spec(spec("fp32", gpu="cpu"), world_size=1, peak=1e6, source="test peak")
    rec = metrics.step_record(1, 1, 2.0, 1e-3, 1.0, 1.0, fm, 0)
    assert rec["peak_source"] == "test peak"
    assert rec["mfu"] > 1 and rec["mfu_bug"] is True
    line = metrics.console_line(rec)
    assert "MFU BUG" in line and f"{100 * rec['mfu']:.1f}%" not in line

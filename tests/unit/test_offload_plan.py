"""Optimizer offload in the planner and the spec: the optimizer bytes leave the GPU for host memory (checked
per node), the step pays the copies and the CPU AdamW (figures against hand arithmetic from the parameter
count), `plan --auto` proposes offload where nothing fits without it, and offload without ZeRO exits 2."""

from __future__ import annotations

import pytest
from cli_utils import trainctl

from trainctl.errors import SpecError
from trainctl.plan.auto import search
from trainctl.plan.plan import build_plan
from trainctl.spec import load_spec_text

GB = 1e9


def spec_text(preset: str = "llama3-8b", zero: int = 1, offload: str = "optimizer", extra: str = "",
              gpus: int = 8, cluster: str = "") -> str:
    return f"""
name: offload
model: {{preset: {preset}}}
parallel: {{tp: 1, pp: 1, zero: {zero}, offload: {offload}{extra}}}
train: {{global_batch: 64, steps: 100, lr: 1.0e-4, precision: bf16, recompute: full}}
cluster: {{nodes: 1, gpus_per_node: {gpus}, gpu: h100-sxm{cluster}}}
"""


def test_zero1_offload_moves_the_optimizer_to_host_and_pays_copies_and_cpu_step():
    on, off = build_plan(load_spec_text(spec_text())), build_plan(load_spec_text(spec_text(offload="none")))
    p = on.params.total  # Llama 3 8B: 8.03e9, one rank holds all of them (tp = pp = 1)
    assert on.est.worst.params == p
    slice_ = p / 8  # dp 8: this rank's 1/8 of every bucket
    # GPU: the bf16 weights and the fp32 gradient buffer stay, the 12/dp bytes of master + moments go
    assert off.est.worst.optimizer == pytest.approx(12 * slice_)
    assert on.est.worst.optimizer == 0
    assert on.est.worst.weights == off.est.worst.weights == pytest.approx(2 * p)
    assert on.est.worst.total == pytest.approx(off.est.worst.total - 12 * slice_)
    # host: master + moments (12) + the gradient copy AdamW reads (4) + the bf16 rounding sent up (2), x 8 GPUs
    assert on.est.host_per_gpu == pytest.approx(18 * slice_)
    assert on.est.host_per_node == pytest.approx(8 * 18 * slice_) and on.est.host_capacity == 2000 * GB
    assert on.est.host_fits and off.est.host_per_gpu == 0
    # time: 4 bytes down + 2 up per element at 25 GB/s; 28 bytes per element at 40 GB/s; nothing else changes
    copy, cpu = 6 * slice_ / 25e9, 28 * slice_ / 40e9
    assert on.est.offload_copy_time == pytest.approx(copy) and on.est.offload_step_time == pytest.approx(cpu)
    # the optimizer step leaves the GPU (its HBM-bound step, off.est.optimizer_time) for the CPU
    assert on.est.optimizer_time == 0 < off.est.optimizer_time
    assert on.est.step_time == pytest.approx(off.est.step_time - off.est.optimizer_time + copy + cpu)
    j = on.to_json()
    assert j["layout"]["offload"] == "optimizer"
    assert j["prediction"]["breakdown_s"]["offload copies"] == pytest.approx(copy)
    assert j["prediction"]["breakdown_s"]["offload CPU step"] == pytest.approx(cpu)
    assert sum(j["prediction"]["breakdown_s"].values()) == pytest.approx(j["prediction"]["step_time_s"])
    assert j["memory"]["host_per_node"] == pytest.approx(8 * 18 * slice_)
    assert {"offload_pcie_gbps": 25.0, "host_adam_gbps": 40.0}.items() <= j["assumptions"].items()


def test_zero3_offload_keeps_every_shard_on_the_host():
    on = build_plan(load_spec_text(spec_text(zero=3)))
    off = build_plan(load_spec_text(spec_text(zero=3, offload="none")))
    p, w = on.params.total, on.est.worst
    assert w.weights == w.gradients == w.optimizer == 0
    assert off.est.worst.model_states == pytest.approx(16 * p / 8)
    assert on.est.host_per_gpu == pytest.approx(16 * p / 8)
    # per micro-batch each shard goes up twice (forward and backward gathers) and its gradient comes down
    m = on.est.micro_batches
    assert on.est.offload_copy_time == pytest.approx(m * 3 * 4 * p / 8 / 25e9)
    assert on.est.offload_step_time == pytest.approx(28 * p / 8 / 40e9)


def test_host_memory_is_checked_per_node():
    small = build_plan(load_spec_text(spec_text(cluster=", host_memory_gb: 100")))  # 8 x 18 GB > 100 GB
    assert not small.fits and small.est.worst.total < small.est.capacity
    (w,) = [w for w in small.warnings if w.code == "HOST_OOM"]
    assert w.level == "error" and "cluster.host_memory_gb" in w.message
    big = build_plan(load_spec_text(spec_text(cluster=", host_memory_gb: 200")))
    assert big.fits and not [w for w in big.warnings if w.code == "HOST_OOM"]


def test_offload_with_one_replica_moves_nothing():
    p = build_plan(load_spec_text(spec_text(gpus=1)))
    assert p.est.host_per_gpu == 0 and p.est.offload_copy_time == 0
    assert [w.code for w in p.warnings if w.code == "OFFLOAD_NO_EFFECT"] == ["OFFLOAD_NO_EFFECT"]


def test_auto_proposes_offload_where_nothing_else_fits():
    """Llama 3 70B on one node of 8 H100: every layout without offload holds 16 bytes x 70.6e9 parameters over
    8 x 76.8 GB (tp, pp and ZeRO-3 only divide them); with the optimizer in host memory it fits."""
    spec = load_spec_text(spec_text(preset="llama3-70b", offload="none"))
    assert not build_plan(spec).fits
    res = search(spec, top=5)
    assert res.top and res.invalid == []
    for s, run, _ in res.top:
        assert s.cand.offload and run.parallel.offload == "optimizer"
        plan = build_plan(run)  # what `trainctl plan` says of the proposal
        assert plan.fits and plan.est.step_time == pytest.approx(s.est.step_time)
        cost = plan.est.offload_copy_time + plan.est.offload_step_time
        assert cost > 0
        no_offload = build_plan(run.model_copy(update={"parallel": replace_offload(run, "none")}))
        assert not no_offload.fits
        assert plan.est.step_time == pytest.approx(no_offload.est.step_time - no_offload.est.optimizer_time + cost)
    row = res.to_json()["top"][0]
    assert row["offload"] == "optimizer" and row["offload_s"] > 0 and row["host_per_node"] > 0
    # the offloaded state is 16 x 70.6e9 = 1.13 TB per node whatever the layout: 1 TB of host memory is too little
    tight = search(load_spec_text(spec_text(preset="llama3-70b", offload="none", cluster=", host_memory_gb: 1000")))
    assert not tight.top and tight.evaluated == res.evaluated


def replace_offload(run, value: str):
    return run.parallel.model_copy(update={"offload": value})


def test_offload_without_zero_exits_2_with_the_fix(tmp_path):
    with pytest.raises(SpecError) as e:
        load_spec_text(spec_text(zero=0))
    assert "parallel.offload = 'optimizer'" in e.value.message
    assert "set parallel.zero 1, 2 or 3" in e.value.message
    path = tmp_path / "spec.yaml"
    path.write_text(spec_text(zero=0))
    out = trainctl("plan", str(path), "--json")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "parallel.offload" in ln]
    assert len(lines) == 1 and "optimizer offload needs a sharded optimizer" in lines[0], out


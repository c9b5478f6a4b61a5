"""PowerSGD's spec rules and planner side: the rules name the fix (exit 2 from the CLI), the planner's matrices
are the runtime model's 2-D parameters, its DP bytes and extra FLOPs match arithmetic over those parameters with
torch's own compression rule, and `plan --auto` / `plan` propose bf16 reduction or PowerSGD on a comm-bound
layout with the saving the two estimates differ by."""

from __future__ import annotations

import pytest
import torch
from cli_utils import trainctl
from paths import RECIPES
from spec_utils import one_problem
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from trainctl.model_shape import ModelShape
from trainctl.plan.auto import search
from trainctl.plan.comm import all_reduce_bytes
from trainctl.plan.plan import build_plan
from trainctl.plan.powersgd import stage_matrices
from trainctl.runtime.model.transformer import build_stage
from trainctl.spec import load_spec, load_spec_text

BASE = """
name: t
model: {preset: tiny, seq_len: 32}
parallel: {dp: 4, grad_compression: {powersgd: {rank: 4}}}
train: {global_batch: 8, steps: 10, precision: fp32}
cluster: {nodes: 1, gpus_per_node: 4, gpu: cpu}
data: {synthetic: true}
"""
FIELD = "parallel.grad_compression.powersgd"


@pytest.mark.parametrize(("overrides", "expected"), [
    ([f"{FIELD}.rank=0"], f"{FIELD}.rank = 0: an approximation needs rank >= 1. Fix: use rank >= 1"),
    ([f"{FIELD}.start_step=0"], f"{FIELD}.start_step = 0: steps count from 1. Fix: use start_step >= 1"),
    (["parallel.zero=2"], "parallel.zero = 2: PowerSGD compresses the plain-DP and ZeRO-1 all-reduce. Fix: use "
                          "parallel.zero 0 or 1, or grad_reduce_dtype: bf16 for ZeRO-2/3"),
    (["parallel.zero=3"], "parallel.zero = 3: PowerSGD compresses"),
    (["parallel.grad_reduce_dtype=bf16"], "parallel.grad_reduce_dtype = 'bf16': PowerSGD reduces"),
])
def test_rules_name_the_field_and_the_fix(overrides: list[str], expected: str) -> None:
    assert one_problem(BASE, *overrides).startswith(f"s.yaml: {expected}")


def test_cli_refuses_powersgd_with_fsdp_in_one_line_exit_2(tmp_path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(BASE)
    out = trainctl("validate", str(spec), "--set", "parallel.zero=3")
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {spec}: parallel.zero = 3: PowerSGD compresses the plain-DP and ZeRO-1 all-reduce. "
                      "Fix: use parallel.zero 0 or 1, or grad_reduce_dtype: bf16 for ZeRO-2/3"]
    assert "Traceback" not in out.stderr


MOE = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 255, "seq_len": 16, "norm": "rmsnorm", "position": "rope",
       "activation": "swiglu", "tied_embeddings": False, "kv_heads": 2,
       "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden": 48, "shared_experts": 1, "shared_ffn_hidden": 40}}


@pytest.mark.parametrize("model", [{"preset": "tiny"}, {"preset": "tiny-llama"}, MOE])
def test_planned_matrices_are_the_models_2d_parameters(model: dict, one_torch_thread: None) -> None:
    from trainctl.spec.models import ModelSpec

    cfg = ModelShape.from_spec(ModelSpec(**model))
    built = build_stage(cfg, range(0, cfg.layers), first=True, last=True, seed=1)
    got = sorted(tuple(p.shape) for p in built.parameters() if p.dim() == 2)
    planned = stage_matrices(cfg, 1, cfg.layers, True, True, cfg.moe_layers)
    assert got == sorted((r, c) for r, c, n, _ in planned for _ in range(n))


def test_plan_bytes_and_flops_match_arithmetic_over_the_models_parameters(one_torch_thread: None) -> None:
    """DP2 ZeRO-0 on the tiny model at rank 4: the all-reduce carries, per parameter, (n + m) * r fp32 values
    when torch's rule compresses it, else all of it; the extra FLOPs are M Q, M^T P, P Q^T and two QRs."""
    spec = load_spec_text(BASE, "s.yaml", ["parallel.dp=2", "cluster.gpus_per_node=2"])
    plan = build_plan(spec).to_json()
    built = build_stage(ModelShape.from_spec(spec.model), range(0, 4), first=True, last=True, seed=1)
    values = flops = 0
    for p in built.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        ok, full, small = _should_compress(n, m, min(n, m, 4), 2)
        if p.dim() == 2 and ok:
            values += small
            flops += 3 * 2 * n * m * 4 + 2 * (n + m) * 16
        else:
            values += full
    assert plan["communication"]["per_kind"]["dp"]["bytes"] == pytest.approx(all_reduce_bytes(values * 4, 2))
    gc = plan["grad_compression"]
    assert gc["extra_flops_per_step"] == flops and gc["rank"] == 4
    assert gc["dp_bytes_per_step"] == plan["communication"]["per_kind"]["dp"]["bytes"]
    plain = build_plan(load_spec_text(BASE, "s.yaml", ["parallel.dp=2", "cluster.gpus_per_node=2",
                                                       "parallel.grad_compression=null"])).to_json()
    assert "grad_compression" not in plain
    ratio = plain["communication"]["per_kind"]["dp"]["bytes"] / gc["dp_bytes_per_step"]
    assert ratio > 10  # the tiny model's matrices are 64 wide: (n + m) * 4 of n * m


COMM_BOUND = ["cluster.nodes=8", "cluster.gpus_per_node=1", "parallel.dp=8", "cluster.interconnect=eth-100g",
              "parallel.micro_batch=4", "train.global_batch=32"]


def _plan_with(*overrides: str):
    return build_plan(load_spec(RECIPES / "gpt2-124m.yaml", [*COMM_BOUND, *overrides]))


def test_comm_bound_layout_gets_bf16_and_powersgd_with_the_predicted_saving() -> None:
    """GPT-2 124M on 8 nodes of one GPU over 100G Ethernet, 4 sequences per GPU: DP8 is DP-bound. `plan` names
    both levers in DP_EXPOSED, each saving what the plan of the spec with that setting predicts; `--auto`, whose
    best plain layouts keep DP below 8 (pipelines of 2 or 4 stages take the rest), finds DP8 with PowerSGD faster
    and says so."""
    plan = _plan_with()
    (w,) = [x for x in plan.warnings if x.code == "DP_EXPOSED"]
    step = plan.est.step_time
    bf16 = _plan_with("parallel.grad_reduce_dtype=bf16").est.step_time
    psgd = _plan_with("parallel.grad_compression={powersgd: {rank: 4}}")
    assert f"parallel.grad_reduce_dtype: bf16: step {bf16:.3g} s (-{(step - bf16) / step:.0%})" in w.message
    assert (f"parallel.grad_compression: {{powersgd: {{rank: 4}}}}: step {psgd.est.step_time:.3g} s "
            f"(-{(step - psgd.est.step_time) / step:.0%})") in w.message
    assert psgd.est.comm_bytes["dp"] < 0.05 * plan.est.comm_bytes["dp"]  # rank 4 of 768-wide matrices
    assert not [x for x in psgd.warnings if x.code == "DP_EXPOSED"]  # pulled, the lever is not proposed again

    res = search(load_spec(RECIPES / "gpt2-124m.yaml", COMM_BOUND), top=3)
    assert res.top[0][0].cand.dp < 8  # the plain ranking avoids the DP-bound full width
    assert res.pulled is not None
    s, lever = res.pulled
    assert s.cand.dp == 8 and "powersgd" in lever.setting
    c = s.cand
    same = _plan_with(f"parallel.pp={c.pp}", f"parallel.dp={c.dp}", f"parallel.zero={c.zero}",
                      f"parallel.micro_batch={c.micro_batch}", f"train.recompute={c.recompute}",
                      "parallel.grad_compression={powersgd: {rank: 4}}")
    assert lever.step_time == pytest.approx(same.est.step_time)
    assert lever.saving_s == pytest.approx(s.est.step_time - same.est.step_time)
    assert lever.step_time < res.top[0][0].est.step_time
    j = res.to_json()["comm_lever_layout"]
    assert j["dp"] == 8 and j["step_time_s"] == pytest.approx(lever.step_time) and j["saving_fraction"] > 0.5


def test_a_layout_that_hides_its_dp_communication_gets_no_lever() -> None:
    spec = load_spec(RECIPES / "gpt2-124m.yaml")  # one NVLink node: DP hides behind compute
    assert not [x for x in build_plan(spec).warnings if x.code == "DP_EXPOSED"]
    res = search(spec, top=3)
    assert not res.levers and res.pulled is None
    assert all(row["comm_levers"] == [] for row in res.to_json()["top"])


def test_runtime_state_is_q_and_error_per_matrix() -> None:
    """The compressor's checkpointed state: every compressed matrix's Q and error, refused when the matrices
    (or the rank) differ, so a resume never mixes another layout's state in. The first Q depends on the name
    only (the same on every DP rank), and reset() (after a non-finite step) goes back to it with e = 0."""
    from trainctl.runtime.parallel.powersgd import PowerSGD

    flat = torch.zeros(64 * 32 + 8)
    psgd = PowerSGD(2, 1, 0, None, 2)
    psgd.bucket([("w", flat[:64 * 32], (64, 32)), ("b", flat[64 * 32:], (8,))])
    st = psgd.state_dict()
    assert set(st["matrices"]) == {"w"} and st["matrices"]["w"]["q"].shape == (32, 2)
    first_q = st["matrices"]["w"]["q"]
    assert torch.equal(PowerSGD(2, 1, 0, None, 2).bucket([("w", flat[:64 * 32], (64, 32))]).matrices[0].q, first_q)
    psgd.matrices["w"].q.fill_(float("nan"))  # a non-finite step went through it
    psgd.matrices["w"].e.fill_(float("nan"))
    psgd.reset()
    assert torch.equal(psgd.matrices["w"].q, first_q) and not psgd.matrices["w"].e.any()
    st["matrices"]["w"]["e"].fill_(3.0)
    assert psgd.load_state_dict(st) and torch.equal(psgd.matrices["w"].e, torch.full((64, 32), 3.0))
    other = PowerSGD(4, 1, 0, None, 2)
    other.bucket([("w", flat[:64 * 32], (64, 32))])
    assert not other.load_state_dict(st)
    assert torch.equal(other.matrices["w"].e, torch.zeros(64, 32))

"""The calibration's fixed work (trainctl/plan/calibration/fixed.py): its fits recover known costs, and the
planner charges them as the trainer spends them (docs/design/calibration.md, "Calibration profile"). Independent
arithmetic: synthetic timings from known per-tensor / per-element costs, and the step's figures recomputed
from the model's own counts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from paths import REPO

from trainctl.model_shape import ModelShape, layer_flops_per_token, layer_params_per_gpu
from trainctl.plan import comm
from trainctl.plan.calibration import profile as prof
from trainctl.plan.calibration.fixed import fit_fixed
from trainctl.plan.calibration.shapes import OPS
from trainctl.plan.estimate import Evaluator, assumed_rates
from trainctl.plan.plan import build_plan, candidate_from_spec, context_from_spec
from trainctl.plan.rates import MeasuredRates
from trainctl.spec import load_spec

TINY = REPO / "recipes" / "tiny-cpu.yaml"
TWO_RANKS = ["cluster.gpus_per_node=2", "parallel.tp=1", "parallel.pp=1", "parallel.dp=2",
             "parallel.sequence_parallel=false"]


def test_fit_recovers_the_optimizer_and_head_costs() -> None:
    tensor_s, element_s, n, k = 2e-4, 1e-8, 50_000, 6
    raw = {"micro_batch": 2, "embedding_s": [1e-3, 3e-3, 2e-3], "head_s": [5e-3], "head_flops": 1e6,
           "tensors": {"layer": k, "embedding": 2, "head": 1},
           "optimizer": [{"tensors": k, "elements": n, "seconds": [k * tensor_s + n * element_s]},
                         {"tensors": 1, "elements": n, "seconds": [tensor_s + n * element_s]},
                         {"tensors": 1, "elements": 4 * n, "seconds": [tensor_s + 4 * n * element_s]}],
           "fsdp": {"link": "intra_node", "group_size": 2, "unit_bytes": 4e5, "plain_s": [0.010, 0.012],
                    "sharded_s": [0.016, 0.018]}}
    f = fit_fixed(raw, compute_rate=1e9)
    assert f.element_s == pytest.approx(element_s, rel=1e-6)
    assert f.tensor_s == pytest.approx(tensor_s, rel=1e-6)
    assert f.embedding_s == pytest.approx(2e-3)  # the median over ranks
    assert f.head_extra_s == pytest.approx(5e-3 - 1e6 / 1e9)  # beyond the head's FLOPs at the planner's rate
    assert f.fsdp_unit_s == pytest.approx(0.017 - 0.011)
    assert f.optimizer_seconds(10, 1e6) == pytest.approx(10 * tensor_s + 1e6 * element_s)
    assert f.stage_tensors(4, True, True) == 4 * k + 2 + 1 and f.stage_tensors(2, False, False) == 2 * k
    assert f.valid() and not replace(f, tensor_s=-1.0).valid()


def test_zero3_traffic_follows_fsdp2_as_the_trainer_drives_it() -> None:
    """One reduce-scatter per unit per step (gradient sync off until the last micro-batch); every unit
    gathered for forward and again for backward, per micro-batch."""
    psi, m, units, dp = 1e6, 4, 5, 2
    rs, fwd, bwd = comm.dp_traffic(psi, 3, dp, m, 4, 4, units)
    assert rs == ("reduce_scatter", pytest.approx(4 * psi / 2), units)
    assert fwd == ("all_gather", pytest.approx(m * 4 * psi / 2), m * units)
    assert bwd == ("all_gather", pytest.approx(m * 4 * psi / 2), m * units)


FIXED = {"micro_batch": 2, "embedding_s": 1e-3, "head_extra_s": 3e-3, "tensor_s": 2e-4, "element_s": 1e-8,
         "layer_tensors": 6, "embedding_tensors": 2, "head_tensors": 2, "fsdp_unit_s": 5e-3,
         "fsdp_link": "intra_node", "fsdp_group": 2, "fsdp_bytes": 0.0}
LINK = {"latency_s": 1e-4, "step_latency_s": 0.0, "bytes_per_s": 1e8, "points": 5, "rms_rel_error": 0.0}


def _profile(fixed: dict[str, Any] | None) -> prof.Profile:
    fits: dict[str, Any] = {"compute": {"1": 2e9, "2": 2e9},
                            "links": {"intra_node": {op: {**LINK, "op": op} for op in OPS}}}
    if fixed is not None:
        fits["fixed"] = fixed
    return prof.parse(Path("<test>"), {"kind": prof.KIND, "schema": prof.SCHEMA, "fits": fits,
                                       "cluster": {"gpu": "cpu", "ranks": 2, "ranks_per_node": 2}})


def _evaluate(sets: list[str], fixed: dict[str, Any] | None):
    spec = load_spec(TINY, overrides=[*TWO_RANKS, *sets])
    ctx = context_from_spec(spec)
    rates = MeasuredRates(_profile(fixed), assumed_rates(ctx.hw, ctx.assume), [])
    return Evaluator(replace(ctx, rates=rates)).evaluate(candidate_from_spec(spec)), spec


@pytest.mark.parametrize("zero", [0, 1])
def test_the_step_adds_the_ends_per_micro_batch_and_the_optimizer_step(zero: int) -> None:
    with_fixed, spec = _evaluate([f"parallel.zero={zero}"], FIXED)
    without, _ = _evaluate([f"parallel.zero={zero}"], None)
    micro_batches = spec.train.global_batch // (spec.parallel.micro_batch * 2)
    ends = micro_batches * (FIXED["embedding_s"] + FIXED["head_extra_s"])  # one stage holds both ends
    tensors = 4 * 6 + 2 + 2  # the tiny model's 4 layers and both ends
    params = with_fixed.ranks[0].params
    # ZeRO-1 steps this rank's fragments of the master: half the tensors and elements over dp 2
    opt = (tensors * 2e-4 + params * 1e-8) if zero == 0 else (tensors / 2 * 2e-4 + params / 2 * 1e-8)
    assert with_fixed.optimizer_time == pytest.approx(opt)
    assert with_fixed.compute_time - without.compute_time == pytest.approx(ends)
    assert with_fixed.step_time - without.step_time == pytest.approx(ends + opt)


def test_the_plan_shows_the_work_outside_the_layers_and_its_breakdown_keeps_the_step(tmp_path: Path) -> None:
    """`plan --json`: the ends per micro-batch x micro-batches + the optimizer step, both inside the step's
    breakdown (the ends in compute), which still sums to the step."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_profile(FIXED).data))
    spec = load_spec(TINY, overrides=[*TWO_RANKS, "parallel.zero=0"]).with_calibration(path)
    pred = build_plan(spec).to_json()["prediction"]
    micro_batches = spec.train.global_batch // (spec.parallel.micro_batch * 2)
    ends = FIXED["embedding_s"] + FIXED["head_extra_s"]  # one stage holds both ends
    outside = pred["outside_layers"]
    assert outside["per_micro_batch_s"] == pytest.approx(ends) and outside["micro_batches"] == micro_batches
    assert outside["total_s"] == pytest.approx(micro_batches * ends + pred["breakdown_s"]["optimizer step"])
    assert pred["breakdown_s"]["compute"] == pytest.approx(pred["compute_s"])
    assert sum(pred["breakdown_s"].values()) == pytest.approx(pred["step_time_s"])
    without = tmp_path / "no-fixed.json"
    without.write_text(json.dumps(_profile(None).data))
    assert build_plan(spec.with_calibration(without)).to_json()["prediction"]["outside_layers"] is None


def test_zero3_charges_the_measured_fsdp_unit_moved_by_the_gather_fit() -> None:
    est, spec = _evaluate(["parallel.zero=3"], FIXED)
    micro_batches = spec.train.global_batch // (spec.parallel.micro_batch * 2)
    unit_bytes = layer_params_per_gpu(ModelShape.from_spec(spec.model), 1) * 4  # fp32 weights gathered
    # measured at 0 bytes over 2 ranks: two all-gathers of the layer's bytes more, at the fit's bandwidth
    unit = FIXED["fsdp_unit_s"] + 2 * comm.gather_bytes(unit_bytes, 2) / LINK["bytes_per_s"]
    assert est.fsdp_time == pytest.approx(micro_batches * 4 * unit)
    assert est.step_time == pytest.approx(
        est.compute_time + est.optimizer_time + est.fsdp_time + est.dp_exposed_time)


def test_a_measured_tp_layer_prices_the_layers_tp_time_and_the_ends_stay_on_the_fits() -> None:
    """TP 2 with SP on 2 ranks: each layer's exposed TP time is its measured seconds as a TP rank less its
    FLOPs at the compute rate; the embedding's and the head's collectives are priced by the link fits."""
    spec = load_spec(TINY, overrides=[*TWO_RANKS, "parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true"])
    ctx = context_from_spec(spec)
    profile = _profile(FIXED)
    shape = ModelShape.from_spec(spec.model)
    tokens = spec.parallel.micro_batch * shape.seq_len
    profile.data["fits"]["layer"] = {"recompute": "none", "tokens": tokens, "tp_seconds": {"2": {"sp": 0.02}}}
    rates = MeasuredRates(profile, assumed_rates(ctx.hw, ctx.assume), [])
    est = Evaluator(replace(ctx, rates=rates)).evaluate(candidate_from_spec(spec))
    micro_batches = spec.train.global_batch // spec.parallel.micro_batch
    layer_compute = layer_flops_per_token(shape, "none") / 2 / 2e9 * tokens
    message = comm.all_reduce_bytes(tokens * shape.hidden * 4, 2)  # fp32 activations
    ends = 2 * (2 * LINK["latency_s"] + 0.5 * 2 * message / LINK["bytes_per_s"])  # RS + AG, embedding and head
    assert est.tp_exposed_time == pytest.approx(micro_batches * (shape.layers * (0.02 - layer_compute) + ends))
    # another recompute mode than the one measured: back on the fits
    other = replace(candidate_from_spec(spec), recompute="full")
    fits_only = Evaluator(replace(ctx, rates=rates)).evaluate(other).tp_exposed_time
    assert fits_only != pytest.approx(est.tp_exposed_time)


def test_a_measured_cp_layer_prices_the_layers_cp_time_in_place_of_the_exchange_fits() -> None:
    """CP 2 on 2 ranks: each layer's exposed CP time is its measured seconds on a CP rank (scaled from the
    measured micro-batch's tokens / cp to the run's) less its FLOPs at the compute rate: the K/V exchange and
    the chunked attention's extra work together, which the collective fits alone left out."""
    spec = load_spec(TINY, overrides=[*TWO_RANKS, "parallel.dp=1", "parallel.cp=2", "parallel.micro_batch=1"])
    ctx = context_from_spec(spec)
    profile = _profile(FIXED)
    shape = ModelShape.from_spec(spec.model)
    tokens = 2 * shape.seq_len  # calibrated at micro-batch 2, the run's is 1
    profile.data["fits"]["layer"] = {"recompute": "none", "tokens": tokens, "cp_seconds": {"2": 0.03}}
    rates = MeasuredRates(profile, assumed_rates(ctx.hw, ctx.assume), [])
    est = Evaluator(replace(ctx, rates=rates)).evaluate(candidate_from_spec(spec))
    micro_batches = spec.train.global_batch // spec.parallel.micro_batch
    rank_tokens = shape.seq_len // 2  # the run's micro-batch on one CP rank: half of 1 x seq
    per_layer = 0.03 / 2 - layer_flops_per_token(shape, "none") / 2e9 * rank_tokens  # half the measured tokens
    assert est.extra["cp_time"] == pytest.approx(micro_batches * shape.layers * per_layer)
    # the K/V exchange by the fits alone, as without the measurement (another recompute mode: not measured)
    other = replace(candidate_from_spec(spec), recompute="full")
    assert Evaluator(replace(ctx, rates=rates)).evaluate(other).extra["cp_time"] == pytest.approx(
        Evaluator(replace(ctx, rates=MeasuredRates(_profile(FIXED), assumed_rates(ctx.hw, ctx.assume), []))
                  ).evaluate(other).extra["cp_time"])


def test_no_parameters_make_no_collective() -> None:
    """A dense model's expert-DP group reduces nothing: no calls whose latency the step would pay."""
    for zero in (0, 1, 2, 3):
        assert comm.dp_traffic(0.0, zero, 2, 4, 4, 4, units=5) == []


def _with_dispatch(floor_s: float, device: str) -> prof.Profile:
    profile = _profile(FIXED)
    profile.data["device"] = {"type": device}
    profile.data["fits"]["layer"] = {"dispatch_s": {"none": floor_s, "selective": 2 * floor_s, "full": 3 * floor_s}}
    return profile


@pytest.mark.parametrize("recompute, factor", [("none", 1), ("full", 3)])
def test_on_a_gpu_a_layer_takes_at_least_the_hosts_dispatch_floor(recompute: str, factor: int) -> None:
    """A GPU runs a layer's kernels while the host issues the next: the layers take the longer of their FLOPs
    at the compute rate and the profile's dispatch floor for the run's recompute mode (measured on a few tokens);
    a CPU runs what it issues, so its floor is not charged again. Checked on the slowest rank's micro-batch."""
    spec = load_spec(TINY, overrides=[*TWO_RANKS, f"train.recompute={recompute}"])
    ctx, cand = context_from_spec(spec), candidate_from_spec(spec)
    shape = ModelShape.from_spec(spec.model)
    tokens = spec.parallel.micro_batch * shape.seq_len
    kernels = layer_flops_per_token(shape, recompute) / 2e9 * tokens  # one layer's micro-batch at 2 GFLOP/s
    micro_batches = spec.train.global_batch // (spec.parallel.micro_batch * 2)
    plain = Evaluator(replace(ctx, rates=MeasuredRates(_profile(FIXED), assumed_rates(ctx.hw, ctx.assume), [])))
    base = plain.evaluate(cand)
    for floor, device, expect in [(2 * kernels / factor, "cuda", kernels), (kernels / (2 * factor), "cuda", 0.0),
                                  (2 * kernels / factor, "cpu", 0.0)]:
        rates = MeasuredRates(_with_dispatch(floor, device), assumed_rates(ctx.hw, ctx.assume), [])
        est = Evaluator(replace(ctx, rates=rates)).evaluate(cand)
        added = micro_batches * shape.layers * expect  # floor 2x the kernels: one layer's kernel time more each
        assert est.extra["dispatch_time"] == pytest.approx(added)
        assert est.compute_time - base.compute_time == pytest.approx(added)
        assert est.step_time - base.step_time == pytest.approx(added)


def test_the_plan_says_when_the_gpu_waits_for_the_host(tmp_path: Path) -> None:
    spec = load_spec(TINY, overrides=TWO_RANKS)
    path = tmp_path / "profile.json"
    for floor, warned in [(1.0, True), (1e-9, False)]:
        path.write_text(json.dumps(_with_dispatch(floor, "cuda").data))
        plan = build_plan(spec.with_calibration(path)).to_json()
        codes = [w["code"] for w in plan["warnings"]]
        assert ("DISPATCH_BOUND" in codes) is warned
        # the floor's share of the predicted step, for mfu-report's largest gap
        dispatch = plan["prediction"]["dispatch_s"]
        assert (dispatch > 0.05 * plan["prediction"]["step_time_s"]) is warned and dispatch >= 0

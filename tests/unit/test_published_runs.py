"""The plan against the published record (recipes/published/, docs/validation.md): every published run planned
as its spec says, with the uncalibrated model's cited constants, and its predicted TFLOP/s per GPU held against the
published figure.

The target is a mean absolute error of at most 5% and at most 10% on any one run. The cited-constant model
does not reach it on the Megatron-Core H100 rows (docs/validation.md says why); this test holds the errors the model
reaches, so a change that makes the plan worse against the record fails here, and one that makes it better can
tighten HELD_MEAN / HELD_WORST.
"""

from __future__ import annotations

import json

import pytest

from trainctl.plan import record, validation
from trainctl.plan.plan import build_plan, checkpoint_plan, stage_prices
from trainctl.plan.rates import calibration_text
from trainctl.spec import load_spec

ROOT = validation.ROOT

# over the eleven headline runs; over all the published rows
HELD_MEAN, HELD_WORST = 0.11, 0.31  # reached: 10.6%, 30.1% (the Megatron-Core 1.7B row); target 5%, 10%
HELD_MEAN_ALL, HELD_WORST_ALL = 0.08, 0.31  # reached: 7.9%, 30.1% (52 runs)
# the A100 rows, Megatron-LM 2021 within 10% each (reached: 9.5%, the 1.7B) and Megatron-LM 2022 (Korthikanti et
# al.) within 12% (reached: 11.0%, the 1T under full recompute): the A100's GEMM figure is one measured layer's
HELD_A100_2021, HELD_A100_2022 = 0.10, 0.12
# Megatron-Turing NLG 530B on 2,240-3,360 A100s: within 18% each (reached: 17.5%, too fast, the 3,360)
HELD_MTNLG = 0.18
# NVIDIA's DGX Cloud H100 recipes (v24.11.1: exact layouts, measured steps): BF16 within 5% each (reached: 5.0%,
# Llama 3.1 405B), FP8 within 10% (reached: 9.7%, Llama 3.1 70B)
HELD_DGXC, HELD_DGXC_FP8 = 0.05, 0.10
# the v25.05 release's Llama 3.1 405B, the same software on H100 and GB200, BF16 and FP8: the H100 rows within 1%
# (reached: 0.3%); the GB200 rows within 11% (reached: 10.2%, BF16, on the plan's default placement of the 128 GPUs,
# which the README does not give: docs/validation.md)
HELD_DGXC2505_H100, HELD_DGXC2505_GB200 = 0.01, 0.11
# the FP8 speed-up over BF16 of the same recipe, the eight pairs: mean within 3%, each within 10% (reached: 2.7%,
# 9.0%, Llama 3.1 70B)
HELD_FP8_SPEEDUP_MEAN, HELD_FP8_SPEEDUP_WORST = 0.03, 0.10
# Llama 3 405B at 8K on 8,192 and 16,384 H100s (the paper's Table 4), the gradients reduce-scattered once a step as
# the recipes read the paper: within 6% each (reached: 5.7%, the 16,384)
HELD_LLAMA3 = 0.06


@pytest.fixture(scope="module")
def rows() -> list[validation.Row]:
    return [validation.plan_row(e) for e in validation.runs()]


@pytest.fixture(scope="module")
def unknowns(rows: list[validation.Row]) -> list[tuple[validation.Row, validation.Unknowns | None]]:
    return validation.headline_unknowns(validation.runs(), rows)


def test_every_published_run_is_planned_and_the_error_is_held(rows: list[validation.Row]) -> None:
    issue = [r for r in rows if r.headline]
    assert len(issue) == 11 and len(rows) > 11
    for r in rows:
        assert r.step_s > 0 and r.predicted > 0
    mean, worst = validation.summary(issue)
    assert mean <= HELD_MEAN and worst <= HELD_WORST, validation.table(rows)
    mean, worst = validation.summary(rows)
    assert mean <= HELD_MEAN_ALL and worst <= HELD_WORST_ALL, validation.table(rows)
    a100 = [r for r in rows if r.spec.startswith("megatron2021-")]
    assert len(a100) == 10 and max(abs(r.error) for r in a100) <= HELD_A100_2021, validation.table(rows)
    a100 = [r for r in rows if r.spec.startswith("korthikanti2022-")]
    assert len(a100) == 8 and max(abs(r.error) for r in a100) <= HELD_A100_2022, validation.table(rows)
    mtnlg = [r for r in rows if r.spec == "mtnlg-530b.yaml"]
    assert len(mtnlg) == 3 and max(abs(r.error) for r in mtnlg) <= HELD_MTNLG, validation.table(rows)
    dgxc = {p: [r for r in rows if r.spec.startswith("dgxc-") and r.precision == p] for p in ("bf16", "fp8")}
    assert len(dgxc["bf16"]) == len(dgxc["fp8"]) == 6
    assert max(abs(r.error) for r in dgxc["bf16"]) <= HELD_DGXC, validation.table(rows)
    assert max(abs(r.error) for r in dgxc["fp8"]) <= HELD_DGXC_FP8, validation.table(rows)
    v2505 = {part: [r for r in rows if r.spec == f"dgxc2505-llama31-405b-{part}.yaml"] for part in ("h100", "gb200")}
    assert [r.gpu for r in v2505["h100"] + v2505["gb200"]] == ["h100-sxm"] * 2 + ["gb200"] * 2
    assert max(abs(r.error) for r in v2505["h100"]) <= HELD_DGXC2505_H100, validation.table(rows)
    assert max(abs(r.error) for r in v2505["gb200"]) <= HELD_DGXC2505_GB200, validation.table(rows)
    llama3 = [r for r in rows if r.spec.startswith("llama3-405b-")]
    assert len(llama3) == 2 and max(abs(r.error) for r in llama3) <= HELD_LLAMA3, validation.table(rows)


def test_the_fp8_speedup_of_each_recipe_is_held(rows: list[validation.Row]) -> None:
    """Each DGX Cloud recipe published in BF16 and FP8: the plan's FP8 step over its BF16 step against NVIDIA's
    (Llama 3.1 8B: 12.91 s over 9.67 s, 1.335x, llama3.1/README_8b.md)."""
    pairs = validation.fp8_pairs(rows)
    assert len(pairs) == 8
    llama = next(x for x in pairs if x.bf16.spec == "dgxc-llama31-8b.yaml")
    assert llama.published == pytest.approx(12.91 / 9.67, rel=1e-12)
    assert llama.predicted == pytest.approx(llama.bf16.step_s / llama.fp8.step_s, rel=1e-12)
    errors = [abs(x.error) for x in pairs]
    assert sum(errors) / len(errors) <= HELD_FP8_SPEEDUP_MEAN and max(errors) <= HELD_FP8_SPEEDUP_WORST, (
        validation.fp8_table(pairs))


def test_the_docs_table_is_current(rows: list[validation.Row], unknowns) -> None:
    """docs/validation.md and the record the plan prints from (plan/record.json) are what `python -m
    trainctl.plan.validation --write` writes today."""
    assert validation.DOC.read_text() == validation.render(rows, unknowns), (
        "docs/validation.md is stale. Fix: python -m trainctl.plan.validation --write")
    assert json.loads(record.RECORD.read_text()) == validation.record_of(rows), (
        "trainctl/plan/record.json is stale. Fix: python -m trainctl.plan.validation --write")


def test_each_headline_run_is_planned_again_at_the_values_its_source_leaves_open(unknowns) -> None:
    """The unknowns table (docs/validation.md, "What the unknowns move"): at the spec's own values it is the headline
    row's plan, and every other value it names moves the plan (an override the planner ignored would repeat the
    spec's error and read as an assumption that does not matter)."""
    assert len(unknowns) == 11
    varied = [(row, u) for row, u in unknowns if u is not None]
    assert len(varied) == 10  # BLOOM's layout is published whole
    for row, u in varied:
        assert row.headline
        at_spec = [p for p in u.grid if p.values == u.planned]
        assert len(at_spec) == 1 and at_spec[0].error == pytest.approx(row.error, abs=1e-12), row.run
        for field, values in u.fields.items():
            assert dict(u.planned)[field] in values, (row.run, field)
            along = u.along(field)
            assert len(along) >= 2, (row.run, field, "no alternative the spec accepts")
            assert len({round(p.error, 9) for p in along}) == len(along), (row.run, field, along)
        assert u.closest.fits and abs(u.closest.error) <= abs(row.error) + 1e-12


def test_the_177b_strong_scaling_loses_what_megatrons_readme_says(rows: list[validation.Row]) -> None:
    """The Megatron-LM README strong-scales its 177B at batch 1152 from 96 to 4,608 H100s, "a reduction in MFU from
    47% to 42%": with its whole percents, a loss of 8.6-12.6%. The plan's loss between its two ends falls in that
    band, the layers' error cancelling in the ratio as an FP8 speed-up's does: what is left is the DP traffic and
    the bubble, which grow with the replicas. (With one slot for all the DP traffic, before the interleaved
    schedule's chunk-by-chunk reduction was priced, the plan lost 18%.)"""
    ends = [r for r in rows if r.run.startswith("Megatron-Core H100 strong scaling")]
    assert [r.gpus for r in ends] == [96, 4608] and {r.spec for r in ends} == {"mcore-h100-177b.yaml"}
    loss = 1 - ends[1].predicted / ends[0].predicted
    assert 1 - 42.5 / 46.5 <= loss <= 1 - 41.5 / 47.5, loss


def test_an_uncalibrated_plan_carries_the_records_range_on_its_gpu(rows: list[validation.Row]) -> None:
    """A user's uncalibrated H100 plan says how far the plan has been from every published H100 run: the measured
    step over the predicted one, at its lowest and highest. A flat-rate plan and a CPU plan carry no range (the
    record holds the operator model on GPUs; a calibrated plan prices with measured rates instead)."""
    h100 = [r for r in rows if r.gpu == "h100-sxm"]
    ratios = [r.published_step_s / r.step_s if r.published_step_s else r.predicted / r.published for r in h100]
    cal = build_plan(load_spec(ROOT / "recipes" / "llama3-8b.yaml")).to_json()["calibration"]
    assert cal["record"]["runs"] == len(h100) > 10
    assert cal["record"]["step_ratio_min"] == pytest.approx(min(ratios), abs=5e-4)
    assert cal["record"]["step_ratio_max"] == pytest.approx(max(ratios), abs=5e-4)
    assert f"{len(h100)} published runs took" in calibration_text(cal) and "docs/validation.md" in calibration_text(cal)
    flat = load_spec(ROOT / "recipes" / "llama3-8b.yaml", overrides=["estimate.compute_efficiency=0.6"])
    assert "record" not in build_plan(flat).to_json()["calibration"]
    assert "record_range" not in build_plan(flat).to_json()["checkpoint"]["whole_run"]
    assert "record" not in build_plan(load_spec(ROOT / "recipes" / "tiny-cpu.yaml")).to_json()["calibration"]


def test_the_whole_run_is_priced_again_at_the_records_two_ends() -> None:
    """The days and GPU-hours the whole run would take were the step as far off as the record has been: the
    whole run of the same spec at the step times the record's lowest and highest ratio. At a ratio of 1 both ends
    are the plan's own figures; the plan's mean lies between the ends."""
    spec = load_spec(ROOT / "recipes" / "llama3-405b-staged.yaml")
    p = build_plan(spec)
    run = p.to_json()["checkpoint"]["whole_run"]
    rec = run["record_range"]
    assert rec["step_ratio"] == [p.record["step_ratio_min"], p.record["step_ratio_max"]]
    assert rec["wall_days"][0] < run["wall_days"]["mean"] < rec["wall_days"][1]
    assert rec["gpu_hours"][0] < run["gpu_hours"] < rec["gpu_hours"][1]
    stages = stage_prices(spec)
    unit = {**p.record, "step_ratio_min": 1.0, "step_ratio_max": 1.0}
    same = checkpoint_plan(spec, p.est.step_time, stages, unit)[0]["whole_run"]
    assert same["record_range"]["wall_days"] == [pytest.approx(run["wall_days"]["mean"], rel=1e-12)] * 2
    assert same["record_range"]["gpu_hours"] == [pytest.approx(run["gpu_hours"], rel=1e-12)] * 2


def test_the_published_figure_converts_to_the_step_the_plan_would_need(rows: list[validation.Row]) -> None:
    """Independent arithmetic on one row: Megatron 2021's 1T run published 163 TFLOP/s per GPU counting
    96*B*s*l*h^2*(1 + s/6h + V/16lh) FLOPs per step (Narayanan et al. 2021); the predicted figure is those FLOPs
    over the predicted step and 3072 GPUs."""
    row = next(r for r in rows if r.spec == "megatron2021-1t.yaml")
    B, s, l, h, V = 3072, 2048, 128, 25600, 51200  # noqa: E741 - the paper's symbols
    flops = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert row.predicted == pytest.approx(flops / row.step_s / 3072 / 1e12, rel=1e-6)


def test_the_2022_steps_give_the_mfu_megatrons_readme_published() -> None:
    """Independent arithmetic on the Megatron-LM 2022 rows: Korthikanti et al. 2022's Table 5 iteration times
    (sequence parallelism and selective recompute, no data parallelism) at their Table 3 layouts give the MFU
    NVIDIA/Megatron-LM's README published in May 2022 (41.5%, 51.4%, 56.0%, 56.3%), counting the paper's model
    FLOPs, 72*B*s*l*h^2*(1 + s/6h + V/12lh), against 312 TFLOP/s per A100, within the rounding of both: the times'
    last digit (1.10 s is 1.095-1.105) and the README's 0.1%."""
    readme = {"22b": (4, 48, 6144, 8, 0.415), "175b": (64, 96, 12288, 64, 0.514),
              "530b": (280, 105, 20480, 280, 0.560), "1t": (512, 128, 25600, 512, 0.563)}
    steps = {e["spec"]: e["step_s"] for e in validation.runs()
             if e["spec"].startswith("korthikanti2022-") and not e.get("set")}
    s, V = 2048, 51200
    for size, (B, l, h, gpus, mfu) in readme.items():  # noqa: E741 - the paper's symbols
        flops = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
        step = steps[f"korthikanti2022-{size}.yaml"]
        reached = flops / step / gpus / 312e12
        assert reached == pytest.approx(mfu, abs=reached * 0.005 / step + 0.0005)


def test_a_published_step_converts_with_the_sources_own_flops(rows: list[validation.Row]) -> None:
    """A published step time becomes TFLOP/s per GPU through the plan's model FLOPs; NVIDIA's recipe gives its own
    count, 4.74E+14 FLOPs per sample of Llama 3.1 8B at 8192 tokens (llama3.1/README_8b.md, its MFU example), and
    the two agree: 128 samples a step over 12.91 s on 8 GPUs. Also by hand: 6N + 12*L*h*s per token, N the matmul
    weights (32 layers of q, k, v, o and the SwiGLU's three, and the LM head)."""
    row = next(r for r in rows if r.spec == "dgxc-llama31-8b.yaml")
    assert row.published_step_s == 12.91
    assert row.published == pytest.approx(128 * 4.74e14 / 12.91 / 8 / 1e12, rel=2e-3)
    L, h, kv, ffn, V, s = 32, 4096, 1024, 14336, 128256, 8192  # noqa: E741 - the config's symbols
    n = L * (h * h + 2 * h * kv + h * h + 3 * h * ffn) + V * h
    flops = (6 * n + 12 * L * h * s) * 128 * s
    assert row.published == pytest.approx(flops / 12.91 / 8 / 1e12, rel=1e-6)
    assert row.error == pytest.approx(12.91 / row.step_s - 1, rel=1e-9)  # the same FLOPs on both sides

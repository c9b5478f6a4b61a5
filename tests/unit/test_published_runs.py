"""The plan against the published record (recipes/published/, docs/validation.md): every published run planned
as its spec says, with the uncalibrated model's cited constants, and its predicted TFLOP/s per GPU held against the
published figure.

The target is a mean absolute error of at most 5% and at most 10% on any one run. The cited-constant model
does not reach it on the Megatron-Core H100 rows (docs/validation.md says why); this test holds the errors the model
reaches, so a change that makes the plan worse against the record fails here, and one that makes it better can
tighten HELD_MEAN / HELD_WORST.
"""

from __future__ import annotations

import pytest

from trainctl.plan import validation

# over the eleven headline runs; over all the published rows
HELD_MEAN, HELD_WORST = 0.16, 0.57  # reached: 15.8%, 56.2% (the Megatron-Core 1.7B row); target 5%, 10%
HELD_MEAN_ALL, HELD_WORST_ALL = 0.15, 0.57  # reached: 14.1%, 56.2% (22 runs)
# the Megatron-LM 2021 A100 rows, where the model's cited figures hold: within 7% each (reached: 6.3%)
HELD_A100_2021 = 0.07


@pytest.fixture(scope="module")
def rows() -> list[validation.Row]:
    return [validation.plan_row(e) for e in validation.runs()]


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


def test_the_docs_table_is_current(rows: list[validation.Row]) -> None:
    """docs/validation.md is what `python -m trainctl.plan.validation --write` writes today."""
    assert validation.DOC.read_text() == validation.render(rows), (
        "docs/validation.md is stale. Fix: python -m trainctl.plan.validation --write")


def test_the_published_figure_converts_to_the_step_the_plan_would_need(rows: list[validation.Row]) -> None:
    """Independent arithmetic on one row: Megatron 2021's 1T run published 163 TFLOP/s per GPU counting
    96*B*s*l*h^2*(1 + s/6h + V/16lh) FLOPs per step (Narayanan et al. 2021); the predicted figure is those FLOPs
    over the predicted step and 3072 GPUs."""
    row = next(r for r in rows if r.spec == "megatron2021-1t.yaml")
    B, s, l, h, V = 3072, 2048, 128, 25600, 51200  # noqa: E741 - the paper's symbols
    flops = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert row.predicted == pytest.approx(flops / row.step_s / 3072 / 1e12, rel=1e-6)

"""report/scaling_law.py: points made from a known law give its parameters back (worked out here, not by the fit)."""

from __future__ import annotations

import math

import pytest

from trainctl.report import scaling_law as sl


def points(law, computes):
    return [{"dir": f"run-{i}", "values": {}, "compute": c, "loss": law(c)} for i, c in enumerate(computes)]


def test_pure_power_law_recovers_a_and_b() -> None:
    f = sl.fit(points(lambda c: 7.0 * c ** -0.076, [1e15, 3e15, 1e16, 4e16]))
    assert f["fitted"] and f["form"] == "L = a*C^-b" and f["irreducible"] == 0.0
    assert f["b"] == pytest.approx(0.076, rel=1e-9) and f["a"] == pytest.approx(7.0, rel=1e-9)
    assert f["sse"] == pytest.approx(0.0, abs=1e-20)
    assert "without an irreducible term" in f["line"] and "over 4 runs" in f["line"]


def test_points_off_the_law_against_hand_arithmetic() -> None:
    # three points off a line in log space: slope by hand, (x - mean) weighted
    cs, ls = [1e12, 1e13, 1e14], [4.0, 3.0, 2.5]
    xs, ys = [math.log(c) for c in cs], [math.log(v) for v in ls]
    mx, my = sum(xs) / 3, sum(ys) / 3
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    f = sl.fit(points(dict(zip(cs, ls, strict=True)).get, cs))
    assert f["b"] == pytest.approx(-slope, rel=1e-12)
    assert f["a"] == pytest.approx(math.exp(my - slope * mx), rel=1e-12)


def test_irreducible_term_recovered_from_enough_points() -> None:
    law = lambda c: 1.69 + 406.4 * (c / 1e15) ** -0.34  # noqa: E731
    f = sl.fit(points(law, [1e15 * 4**i for i in range(6)]))
    assert f["form"] == "L = E + a*C^-b"
    assert f["irreducible"] == pytest.approx(1.69, rel=1e-4)
    assert f["b"] == pytest.approx(0.34, rel=1e-4)
    assert f["a"] == pytest.approx(406.4 * 1e15**0.34, rel=1e-3)
    for p in f["points"]:
        assert p["fitted_loss"] == pytest.approx(p["loss"], rel=1e-6)


def test_too_few_points_is_no_fit() -> None:
    f = sl.fit(points(lambda c: c ** -0.1, [1e12, 1e13]))
    assert not f["fitted"] and "no fit" in f["note"]
    same = sl.fit(points(lambda c: 3.0, [1e12, 1e12, 1e12]))
    assert not same["fitted"]  # one compute: no slope


def test_which_grids_qualify() -> None:
    assert sl.qualifies({"model.layers": ["2", "4"], "train.steps": ["10", "20"]})
    assert sl.qualifies({"train.global_batch": ["4", "8"]})
    assert not sl.qualifies({"train.lr": ["1e-3", "3e-3"], "train.seed": ["1", "2"]})


def test_no_floor_in_the_points_fits_the_plain_law() -> None:
    # six points of a pure power law: the irreducible term is tried and comes out at 0, so the plain law is fitted
    f = sl.fit(points(lambda c: 9.0 * c ** -0.05, [1e12 * 3**i for i in range(6)]))
    assert f["form"] == "L = a*C^-b" and f["irreducible"] == 0.0 and "the points show no floor" in f["line"]
    assert f["b"] == pytest.approx(0.05, rel=1e-9)

"""The one JSON printer of the CLI (trainctl/cli/jsonout.py): strict RFC 8259, non-finite numbers as null."""

from __future__ import annotations

import json
import math

import pytest
from json_utils import strict_loads

from trainctl.cli.jsonout import dumps


def test_strict_parser_refuses_what_python_writes_for_nan() -> None:
    # the helper the CLI tests rely on must itself fail on Python's default output
    with pytest.raises(ValueError, match="NaN"):
        strict_loads(json.dumps({"loss": math.nan}))


@pytest.mark.parametrize("compact", [False, True])
def test_non_finite_numbers_become_null_at_any_depth(compact: bool) -> None:
    value = {"loss": math.nan, "series": [1.5, math.inf, {"x": -math.inf}], "pair": (2, math.nan), 3: "k"}
    assert strict_loads(dumps(value, compact=compact)) == {
        "loss": None, "series": [1.5, None, {"x": None}], "pair": [2, None], "3": "k"}


def test_finite_values_and_paths_print_as_before() -> None:
    from pathlib import Path

    value = {"a": [1, 2.5, "s", None, True], "p": Path("/tmp/run")}
    assert dumps(value) == json.dumps(value, indent=2, default=str)
    assert dumps(value, compact=True) == json.dumps(value, separators=(",", ":"), default=str)

"""Specs for tests: the tiny run spec every multi-process test starts from, the one writer of spec files, and the
spec-error lines a spec text gives (the helper of the spec-rule tests)."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainctl.errors import SpecError
from trainctl.spec import RunSpec, load_spec, load_spec_text

TINY: dict[str, Any] = {
    "name": "tiny",
    "model": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
    "parallel": {"tp": 1, "pp": 1, "dp": 1, "micro_batch": 1},
    "train": {"global_batch": 8, "steps": 10, "lr": 1e-3, "warmup": 2, "precision": "fp32", "seed": 7,
              "grad_clip": 1.0},
    "data": {"synthetic": True},
    "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "cpu"},
    "launcher": {"backend": "local"},
}


def deep_update(base: dict[str, Any], upd: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base` with `upd` merged in: a section into a section, any other value replacing."""
    out = copy.deepcopy(base)
    for k, v in upd.items():
        out[k] = deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def world_size(parallel: dict[str, Any]) -> int:
    """The ranks a `parallel` section lays out (an absent degree is 1)."""
    return parallel.get("tp", 1) * parallel.get("cp", 1) * parallel.get("pp", 1) * parallel.get("dp", 1)


def write_spec(path: Path, *updates: dict[str, Any], base: dict[str, Any] = TINY,
               one_node: bool = False) -> Path:
    """`path`, holding `base` (the tiny spec unless told) with each of `updates` applied in turn (nested sections
    merged) as YAML; with one_node, cluster.gpus_per_node is the layout's world size (one node holds every
    rank)."""
    spec = base
    for update in updates:
        spec = deep_update(spec, update)
    if one_node:
        spec = deep_update(spec, {"cluster": {"gpus_per_node": world_size(spec["parallel"])}})
    path.write_text(yaml.safe_dump(spec))
    return path


def spec_with(path: Path, *settings: Mapping[str, object]) -> RunSpec:
    """The spec at `path` with `settings` (merged, a later one's key winning) applied as `--set key=value` applies
    them (a value that is not a string written as JSON)."""
    merged: dict[str, object] = {}
    for s in settings:
        merged.update(s)
    return load_spec(path, [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in merged.items()])


def problems(text: str, *overrides: str) -> list[str]:
    """Every line of the SpecError that `text` with `overrides` raises (source named s.yaml)."""
    with pytest.raises(SpecError) as err:
        load_spec_text(text, "s.yaml", overrides)
    return err.value.message.splitlines()


def one_problem(text: str, *overrides: str) -> str:
    """The one line of that SpecError (a test fails if there are more)."""
    found = problems(text, *overrides)
    assert len(found) == 1, found
    return found[0]

"""Every parallel layout trains exactly what one process trains (gloo, CPU, fp32, same seed and data).

Each case is a real torchrun job; its per-step losses must match the single-process run to 1e-5 relative
and its final weights (TP shards concatenated, gathered by parameter name) to ~1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_utils import final_weights, losses, make_run, max_rel_diff, run_trainer

pytestmark = pytest.mark.slow

SMALL_BUCKETS = {"TRAINCTL_BUCKET_NUMEL": "20000"}  # several buckets: overlap, ordering, ZeRO slicing

CASES: dict[str, tuple[dict, dict]] = {
    "dp2": ({"dp": 2}, SMALL_BUCKETS),
    "tp2": ({"tp": 2, "micro_batch": 4}, {}),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True, "micro_batch": 4}, {}),
    "pp2-1f1b": ({"pp": 2}, {}),
    "pp4-1f1b": ({"pp": 4}, {}),
    "pp2-interleaved": ({"pp": 2, "schedule": "interleaved", "virtual_stages": 2}, {}),
    "pp2-gpipe": ({"pp": 2, "schedule": "gpipe"}, {}),
    "zero1-dp2": ({"dp": 2, "zero": 1}, SMALL_BUCKETS),
    "zero2-dp2": ({"dp": 2, "zero": 2}, SMALL_BUCKETS),
    "fsdp-dp2": ({"dp": 2, "zero": 3}, {}),
    "tp2-pp2-dp2": ({"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True, "micro_batch": 2}, {}),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], dict[str, torch.Tensor]]:
    run, world = make_run(tmp_path_factory.mktemp("ref"), "single")
    r = run_trainer(run, world)
    assert r.returncode == 0, r.stderr[-3000:]
    return losses(run), final_weights(run)


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_single_process(case: str, reference, tmp_path: Path) -> None:
    parallel, env = CASES[case]
    run, world = make_run(tmp_path, case, parallel=parallel)
    r = run_trainer(run, world, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    ref_losses, ref_weights = reference
    got = losses(run)
    assert len(got) == len(ref_losses) >= 10
    rel = max_rel_diff(got, ref_losses)
    print(f"{case}: max relative loss difference {rel:.2e}")
    assert rel <= 1e-5, (got, ref_losses)
    weights = final_weights(run)
    assert set(weights) == set(ref_weights)
    worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    print(f"{case}: max absolute weight difference {worst:.2e}")
    assert worst <= 1e-5

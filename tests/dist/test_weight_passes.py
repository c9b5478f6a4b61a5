"""The passes over the weights and the gradient buffer the plan prices beyond the GEMMs (plan/operators.py
weight_pass_bytes, gradient_buffer_pass_bytes) are the ones the trainer's real steps make (gloo ranks): counted
from the aten ops of its steps (weight_pass_worker.py) on two DP ranks, three micro-batches a step, bf16 compute.
Per matmul weight and micro-batch: fp32 weights cast by autocast, their gradients cast back and added into the
fp32 buffer (ZeRO-0, 24 bytes), bf16 weights whose gradients are added into it (ZeRO-1/2, 10), FSDP2's gathers
copied out twice and its unsharded gradient kept in fp32 (ZeRO-3, 14 with one micro-batch, 18 + 4/3 with
three); per parameter of the gradient buffer and micro-batch: its zeroing and the division by dp once a step
(ZeRO-0/1, (4 + 8)/3), or every micro-batch with the fp32 shard's accumulation (ZeRO-2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spec_utils import TINY, deep_update
from trainer_utils import fork_ranks

from trainctl.plan import operators

WORKER = Path(__file__).with_name("weight_pass_worker.py")
DP, MICRO_BATCHES = 2, 3
# wide layers, short sequences and vocabulary: no activation has a weight's or the gradient buffer's size
MODEL = {"layers": 2, "hidden": 128, "heads": 2, "vocab": 64, "seq_len": 8, "tied_embeddings": False}


def spec(zero: int) -> dict:
    return deep_update(TINY, {"model": MODEL, "parallel": {"dp": DP, "zero": zero, "micro_batch": 1},
                              "cluster": {"gpus_per_node": DP},
                              "train": {"steps": 3, "global_batch": DP * MICRO_BATCHES, "precision": "bf16",
                                        "low_precision_on_cpu": True}})


def test_the_trainer_makes_the_weight_passes_the_plan_prices(tmp_path: Path) -> None:
    cases = [{"id": f"zero{z}", "spec": spec(z)} for z in (0, 1, 2)]
    cases += [{"id": f"fsdp-{m}", "width": 256, "micro_batches": m} for m in (1, MICRO_BATCHES)]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    r = fork_ranks(DP, [str(WORKER), str(tmp_path / "cases.json"), str(tmp_path)], timeout=300)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    for case in cases:
        got = json.loads((tmp_path / f"{case['id']}.json").read_text())
        zero, m = (3 if "width" in case else case["spec"]["parallel"]["zero"]), got["micro_batches"]
        assert m == case.get("micro_batches", MICRO_BATCHES)
        per_weight = operators.weight_pass_bytes("auto", precision="bf16", zero=zero, dp=DP, pp=1, micro_batches=m,
                                                 recompute="none")
        assert got["bytes"] == pytest.approx(per_weight * got["weights"] * m, rel=1e-9), (case["id"], got)
        if zero < 3:  # the layers' weights on one rank, and the gradient buffer of all its parameters
            assert got["weights"] == 2 * 12 * 128 * 128
            per_param = operators.gradient_buffer_pass_bytes("auto", zero=zero, dp=DP, micro_batches=m,
                                                             reduce_bf16=False)
            assert got["buffer_bytes"] == pytest.approx(per_param * got["buffer"] * m, rel=1e-9), (case["id"], got)
    assert operators.weight_pass_bytes("auto", precision="bf16", zero=3, dp=DP, pp=1, micro_batches=1,
                                       recompute="none") == 14

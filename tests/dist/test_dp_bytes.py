"""The bytes a rank sends for data parallelism in real trainer steps (gloo ranks) are what the plan prices.

ZeRO-1 reduce-scatters the step's accumulated gradients and all-gathers the updated weights (Megatron's
distributed optimizer; ZeRO paper Sec. 7: reduce-scatter + all-gather = Psi (n-1)/n each): with fp32 gradients
and bf16 weights 4 + 2 = 6 bytes per parameter (x (n-1)/n), 2 + 2 = 4 with grad_reduce_dtype bf16, where
ZeRO-0's all-reduce of fp32 gradients sends 2 x 4 = 8. dp_bytes_worker.py counts the DP group's collectives
as the trainer issues them; the buckets pad each to a multiple of dp, so the collectives move the padded
bucket elements exactly and the plan's figure (parameters unpadded) within the padding. Besides the gradient
and weight collectives the DP group carries only scalars (the loss and grad-norm reductions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spec_utils import TINY, deep_update
from trainer_utils import fork_ranks

from trainctl.plan import comm

WORKER = Path(__file__).with_name("dp_bytes_worker.py")
BF16 = {"precision": "bf16", "low_precision_on_cpu": True}
# (zero, train section, grad_reduce_dtype, gradient bytes, weight bytes on the wire)
CASES = {"zero0-fp32": (0, {}, None, 4, 4), "zero1-bf16": (1, BF16, None, 4, 2),
         "zero1-bf16-reduce-bf16": (1, BF16, "bf16", 2, 2)}
STEPS, MICRO_BATCHES = 2, 2


def spec(dp: int, zero: int, train: dict, reduce: str | None) -> dict:
    parallel = {"dp": dp, "zero": zero, "micro_batch": 2, **({"grad_reduce_dtype": reduce} if reduce else {})}
    return deep_update(TINY, {"parallel": parallel, "cluster": {"gpus_per_node": dp},
                              "train": {"steps": STEPS, "global_batch": dp * 2 * MICRO_BATCHES, **train}})


@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_sends_six_bytes_per_parameter_as_planned(tmp_path: Path, dp: int) -> None:
    cases = [{"id": name, "spec": spec(dp, zero, train, reduce)} for name, (zero, train, reduce, _, _) in CASES.items()]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    r = fork_ranks(dp, [str(WORKER), str(tmp_path / "cases.json"), str(tmp_path)],
                   env={"TRAINCTL_BUCKET_NUMEL": "20000"}, timeout=300)  # several buckets
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    ring = (dp - 1) / dp
    for name, (zero, _, _, grad_bytes, weight_bytes) in CASES.items():
        got = json.loads((tmp_path / f"{name}.json").read_text())
        sent, padded, params = got["sent"], got["bucket_numel"], got["params"]
        assert sent.pop("scalars", 0.0) <= 2 * 8 * 4, (name, got)  # a few fp32 scalars per step
        want = {"all_reduce": 2 * grad_bytes * padded * ring} if zero == 0 else {
            "reduce_scatter": grad_bytes * padded * ring, "all_gather": weight_bytes * padded * ring}
        assert sent == pytest.approx(want, rel=1e-12), (name, got)
        assert got["calls"] == {op: got["buckets"] for op in want}  # once per step and bucket, not per micro-batch
        per_param = sum(want.values()) / (params * ring)
        assert per_param == pytest.approx({0: 8, 1: grad_bytes + weight_bytes}[zero], rel=1e-3)
        planned = sum(b for _, b, _ in comm.dp_traffic(params, zero, dp, MICRO_BATCHES, grad_bytes, weight_bytes))
        assert sum(want.values()) == pytest.approx(planned, rel=1e-3), (name, planned)
        print(f"dp{dp} {name}: {sum(sent.values()) / params:.4f} bytes per parameter sent "
              f"({per_param:.3f} x (n-1)/n), planned {planned / params:.4f}")

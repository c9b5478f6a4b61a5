"""The bytes a rank sends for data parallelism in real trainer steps (gloo ranks) are what the plan prices.

ZeRO-1 reduce-scatters the step's accumulated gradients and all-gathers the updated weights (Megatron's
distributed optimizer; ZeRO paper Sec. 7: reduce-scatter + all-gather = Psi (n-1)/n each): with fp32 gradients
and bf16 weights 4 + 2 = 6 bytes per parameter (x (n-1)/n), 2 + 2 = 4 with grad_reduce_dtype bf16, where
ZeRO-0's all-reduce of fp32 gradients sends 2 x 4 = 8. dp_bytes_worker.py counts the DP group's collectives
as the trainer issues them; the buckets pad each to a multiple of dp, so the collectives move the padded
bucket elements exactly and the plan's figure (parameters unpadded) within the padding. Besides the gradient
and weight collectives the DP group carries only scalars (the loss and grad-norm reductions).

ZeRO-3 (FSDP2, untied embeddings, fp32): one reduce-scatter of every gradient per step; every unit's weights
gathered for each micro-batch's forward and again for its backward, but for the final norm + LM head unit,
which stays gathered from its forward to its backward (as torchtitan wraps it): 4 x Psi + 4 x (2m Psi - m H)
bytes x (n-1)/n per step for m micro-batches, H the head unit's parameters, counted from the module's names."""

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
ZERO3 = "zero3-fp32-untied"


def spec(dp: int, zero: int, train: dict, reduce: str | None) -> dict:
    parallel = {"dp": dp, "zero": zero, "micro_batch": 2, **({"grad_reduce_dtype": reduce} if reduce else {})}
    return deep_update(TINY, {"parallel": parallel, "cluster": {"gpus_per_node": dp},
                              "train": {"steps": STEPS, "global_batch": dp * 2 * MICRO_BATCHES, **train}})


@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_sends_six_bytes_per_parameter_as_planned(tmp_path: Path, dp: int) -> None:
    cases = [{"id": name, "spec": spec(dp, zero, train, reduce)} for name, (zero, train, reduce, _, _) in CASES.items()]
    cases.append({"id": ZERO3, "spec": deep_update(spec(dp, 3, {}, None), {"model": {"tied_embeddings": False}})})
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

    got = json.loads((tmp_path / f"{ZERO3}.json").read_text())
    sent, params, head = got["sent"], got["params"], got["head_params"]
    assert sent.pop("scalars", 0.0) <= 2 * 8 * 4, got
    m, layers = MICRO_BATCHES, TINY["model"]["layers"]
    assert head == TINY["model"]["hidden"] * (TINY["model"]["vocab"] + 1)  # the LM head, the final norm (no bias)
    # FSDP2 pads each parameter's rows to a multiple of dp: the tiny model's all divide, so bytes are exact
    want = {"reduce_scatter": 4 * params * ring, "all_gather": 4 * (2 * m * params - m * head) * ring}
    assert sent == pytest.approx(want, rel=1e-12), got
    units = layers + 2  # each layer, the embedding, the final norm + LM head
    assert got["calls"] == {"reduce_scatter": units, "all_gather": m * units + m * (units - 1)}, got
    planned = comm.dp_traffic(params, 3, dp, m, 4, 4, comm.fsdp_units(layers, True, True, tied=False),
                              kept=comm.fsdp_head_unit(TINY["model"]["hidden"], TINY["model"]["hidden"] *
                                                       TINY["model"]["vocab"], tied=False))
    assert sum(b for _, b, _ in planned) == pytest.approx(sum(want.values()), rel=1e-12)
    assert sum(c for _, _, c in planned) == sum(got["calls"].values())

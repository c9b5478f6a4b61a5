"""Resume is exact: a run's checkpoint after N/2 of N steps, resumed in fresh processes, retraces the
run's steps N/2+1..N bit for bit: losses, grad norms and final weights (CPU, gloo; fp32, and
bf16 with bf16 parameters under ZeRO-2). A bf16 ZeRO-1 checkpoint holds the fp32 master: resumed at ZeRO-0,
the fp32 weights are the master bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from resume_utils import assert_resumed_bitwise, ok, set_spec, straight_and_resumed
from trainer_utils import final_weights, make_run, run_trainer

pytestmark = pytest.mark.slow

SMALL_BUCKETS = {"TRAINCTL_BUCKET_NUMEL": "20000"}  # several buckets: ZeRO slices cut through parameters
BF16 = {"train": {"precision": "bf16", "low_precision_on_cpu": True}}
# A mixture of experts (4 experts, top-2, a shared expert, balance and z losses), Llama family
MOE_MODEL = {"norm": "rmsnorm", "position": "rope", "activation": "swiglu", "tied_embeddings": False,
             "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden": 64, "shared_experts": 1,
                     "aux_loss_coeff": 0.01, "z_loss_coeff": 0.001}}

# Each case is a distinct save/load path; a path that a larger case already exercises is not run again alone
# (TP2 x PP2 x DP2 covers PP 1F1B, SP and ZeRO-1; TP2 x DP2 covers plain DP buckets and TP without SP).
CASES: dict[str, tuple[dict, dict, int] | tuple[dict, dict, int, dict]] = {
    "tp2-dp2": ({"tp": 2, "dp": 2, "micro_batch": 4}, SMALL_BUCKETS, 6),
    # ZeRO-2 reduces every micro-batch into fp32 slices; bf16 parameters, the fp32 master in the checkpoint
    "zero2-bf16-dp2": ({"dp": 2, "zero": 2}, SMALL_BUCKETS, 6, BF16),
    "pp2-interleaved": ({"pp": 2, "schedule": "interleaved", "virtual_stages": 2}, {}, 6),
    "fsdp-dp2": ({"dp": 2, "zero": 3}, {}, 6),
    # the one 8-rank case (slow on 2 cores): TP2 x PP2 x DP2 (1F1B) with sequence parallelism and ZeRO-1
    "tp2-pp2-dp2": ({"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True, "micro_batch": 2, "zero": 1},
                    SMALL_BUCKETS, 4),
    # expert parallelism: the experts' ZeRO-1 slices over an expert-DP group of 2, the dense ones over DP 4
    "moe-dp4-ep2-zero1": ({"dp": 4, "ep": 2, "zero": 1, "micro_batch": 2}, SMALL_BUCKETS, 4, {"model": MOE_MODEL}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise(case: str, tmp_path: Path) -> None:
    parallel, env, steps, *sections = CASES[case]
    straight, resumed = straight_and_resumed(tmp_path, parallel, steps, env=env, **(sections[0] if sections else {}))
    assert_resumed_bitwise(straight, resumed, steps)
    print(f"{case}: {steps} steps, resumed at {steps // 2}: losses/grad norms/weights bitwise equal")


def test_bf16_zero1_checkpoint_resumes_at_zero0_with_the_fp32_master(tmp_path: Path) -> None:
    """ZeRO-1 under bf16 trains bf16 parameters against an fp32 master slice per DP rank; its checkpoint
    saves the master as the model's weights. ZeRO-0 keeps fp32 weights: resumed there (one rank), they are
    the master, bit for bit, not its bf16 rounding."""
    sections = {"train": {"steps": 2, **BF16["train"]}, "checkpoint": {"every_steps": 2}}
    run, world = make_run(tmp_path, "bf16", parallel={"dp": 2, "zero": 1}, **sections)
    ok(run_trainer(run, world, env=SMALL_BUCKETS), "bf16 ZeRO-1")
    master = final_weights(run)  # the fp32 master, gathered over DP (trainer.dump_weights)
    (run / "final_weights").rename(run / "zero1_weights")
    set_spec(run, parallel={"dp": 1, "zero": 0})
    ok(run_trainer(run, 1), "resumed at ZeRO-0")  # at train.steps already: loads, then writes its weights
    loaded = final_weights(run)
    assert set(loaded) == set(master)
    for k, w in master.items():
        assert loaded[k].dtype == w.dtype == torch.float32, k
        assert torch.equal(loaded[k], w), k
    # the master carries bits that bf16 weights do not: most trained elements are not bf16 numbers
    trained = torch.cat([w.reshape(-1) for w in master.values()])
    assert (trained != trained.bfloat16().float()).float().mean() > 0.9

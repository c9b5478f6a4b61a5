"""Context parallelism in the spec: parallel.cp, the world size tp x cp x pp x dp, and its rules (one line each,
naming the field, the value and the fix)."""

from __future__ import annotations

import pytest

from trainctl.errors import SpecError
from trainctl.spec import load_spec_text

LLAMA = """
name: t
model: {preset: llama3-8b, seq_len: 8192}
parallel: {tp: 8, cp: 2, pp: 1, dp: auto}
train: {global_batch: 64, steps: 10}
cluster: {nodes: 4, gpus_per_node: 8, gpu: h100-sxm}
"""


def problems(*overrides: str, text: str = LLAMA) -> list[str]:
    with pytest.raises(SpecError) as err:
        load_spec_text(text, "s.yaml", overrides)
    return [line.removeprefix("s.yaml: ") for line in err.value.message.splitlines()]


def test_world_is_tp_cp_pp_dp():
    spec = load_spec_text(LLAMA)
    assert (spec.parallel.cp, spec.dp, spec.model_parallel) == (2, 2, 16)
    assert spec.micro_batches == 32  # CP ranks share each sequence: the batch is dealt over dp only
    assert load_spec_text(LLAMA, overrides=["parallel.cp=1"]).dp == 4  # cp defaults to 1 and is then invisible


def test_world_size_mismatch_names_cp():
    (line,) = problems("parallel.dp=4")
    assert line.startswith("parallel.dp = 4: tp*cp*pp*dp = 8*2*1*4 = 64 but the cluster has 4 nodes x 8 GPUs = 32")
    assert "set parallel.dp to 2" in line
    (line,) = problems("parallel.cp=3", "model.seq_len=8184")
    assert "tp*cp*pp = 24 does not divide the 32 GPUs" in line and line.startswith("parallel = 'tp=8 cp=3 pp=1'")


def test_seq_len_must_split_into_2cp_chunks():
    (line,) = problems("model.seq_len=8190")
    assert line.startswith("model.seq_len = 8190: context parallelism splits each sequence into 2*cp = 4 chunks")
    assert "Fix: use a seq_len divisible by 4, e.g. 8188 or 8192" in line


def test_sequence_parallel_splits_each_cp_ranks_tokens_over_tp():
    # 8 x 2 = 16 divides 8192; 1028 is divisible by 2*cp = 4 but not by tp*cp = 16
    load_spec_text(LLAMA, overrides=["parallel.sequence_parallel=true"])
    (line,) = problems("parallel.sequence_parallel=true", "model.seq_len=1028")
    assert "sequence_parallel splits each CP rank's 1028/cp tokens over tp=8 ranks" in line
    assert "Fix: use a seq_len divisible by 16 (tp*cp = 8*2)" in line


def test_cp_refuses_dropout_and_moe_with_one_line_each():
    (line,) = problems("model.dropout=0.1")
    assert line.startswith("model.dropout = 0.1: context parallelism (cp=2) supports causal attention without "
                           "dropout") and "Fix: set model.dropout: 0" in line
    moe = LLAMA.replace("seq_len: 8192}", "seq_len: 8192, moe: {num_experts: 8, top_k: 2}}")
    (line,) = problems(text=moe)
    assert line.startswith("parallel.cp = 2: context parallelism with a mixture-of-experts model is not supported")
    assert "Fix: set parallel.cp: 1" in line


def test_cp_accepts_both_position_kinds_and_gqa():
    for pos in ("rope", "learned"):
        spec = load_spec_text(LLAMA, overrides=[f"model.position={pos}"])
        assert spec.model.kv_heads == 8 and spec.parallel.cp == 2

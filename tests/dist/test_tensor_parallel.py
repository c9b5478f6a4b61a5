"""Tensor parallelism with real processes (gloo, CPU, fp64): TP=2 and TP=4 reproduce one process.

Each TP size launches tests/dist/tp_worker.py once (all cases in one run, ~7-14 s); the tests below assert on its
JSON results. See the worker's docstring for what each case does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_utils import fork_ranks

WORKER = Path(__file__).with_name("tp_worker.py")

pytestmark = pytest.mark.slow

EQUIV_CASES = ["gpt2", "gpt2_sp", "llama", "llama_sp", "gpt2_sp_deferred", "gpt2_sp_selective", "llama_sp_full",
               "pp_chain_gpt2_sp", "pp_chain_llama"]


def _run_worker(nproc: int, tmp_path: Path) -> dict:
    out = tmp_path / f"tp{nproc}.json"
    proc = fork_ranks(nproc, [str(WORKER), str(out)])
    assert proc.returncode == 0, f"worker failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def results(request, tmp_path_factory) -> tuple[int, dict]:
    tp = request.param
    return tp, _run_worker(tp, tmp_path_factory.mktemp(f"tp{tp}"))


@pytest.mark.parametrize("case", EQUIV_CASES)
def test_tp_matches_single_process(results, case):
    """Loss and every (gathered, full) gradient equal the single-process model's in fp64."""
    tp, res = results
    r = res[case]
    assert r["loss_diff"] <= 1e-12, r
    assert r["grad_diff"] <= 1e-12, r
    assert r["grad_scale"] > 1e-3  # the comparison is not vacuous
    assert r["local_logits"] == 256 // tp  # logits really were vocab-sharded


def test_tp_fp32_within_tolerance(results):
    """fp32 matches only up to reduction order (~1e-6; docs/design/checked-facts.md, "Checked facts:
    PyTorch distributed on CPU/gloo"): tolerance, not bitwise."""
    _tp, res = results
    r = res["llama_sp_fp32"]
    assert r["loss_diff"] <= 1e-5 * abs(r["ref_loss"])
    assert r["grad_diff"] <= 1e-5 * r["grad_scale"], r


def test_padded_vocab_gives_the_same_loss(results):
    """vocab 255 is padded to 256 for tp 2 and 4; the padded columns are masked, so the loss equals tp 1's."""
    tp, res = results
    for case in ("gpt2", "llama", "gpt2_sp"):
        assert res[case]["padded_vocab"] == 256
        assert res[case]["loss_diff"] <= 1e-12


def test_cross_entropy_with_tiny_vocab(results):
    """vocab = tp + 1: some ranks hold mostly (tp 4: only) padding; loss and grads still equal F.cross_entropy."""
    _tp, res = results
    r = res["ce_tiny_vocab"]
    assert r["loss_diff"] <= 1e-12 and r["grad_diff"] <= 1e-12
    assert r["pad_grad_max"] == 0.0


def test_no_full_vocab_logits_on_any_rank(results):
    """Every tensor any op produces on a TP rank (forward and backward) is at most V/tp in every dimension,
    while the single-process control does produce full-vocab [*, V] tensors (the detector works)."""
    tp, res = results
    assert res["nofull"]["max_dim"] == 384 // tp, res["nofull"]
    assert res["nofull"]["offenders"] == []
    assert res["nofull_single"]["max_dim"] == 384
    assert res["nofull_single"]["offenders"]


def test_tp_dropout_and_recompute(results):
    """Dropout masks differ across TP ranks where activations are sharded and agree where replicated;
    selective and full recompute replay dropout exactly under TP+SP."""
    _tp, res = results
    d = res["dropout"]
    assert d["sharded_differ"] and d["replicated_equal"]
    for rc in ("selective", "full"):
        assert d[f"recompute_{rc}_loss_diff"] == 0.0
        assert d[f"recompute_{rc}_grad_diff"] == 0.0
    assert d["dropout_changes_loss"] > 1e-6

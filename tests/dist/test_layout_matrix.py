"""Every model family on every layout trains what one process trains: the equivalence matrix.

Factors: the model (the GPT and Llama families whole, the Llama family with one feature switched back
to GPT's: norm, positions, activation, tied embeddings, bias, attention heads, and a mixture of experts of
each family), the layout (TP with and without SP, each pipeline schedule, TP x PP with and without SP, DP
with ZeRO 0-3, TP x PP x DP, and expert parallelism with each of those kinds, for the MoE models only), the
micro-batch size and the recompute mode (the MoE models on the EP layouts and five without EP, MOE_WITHOUT_EP).
The default suite runs a covering design: every allowed pair of values of any two factors at least once, the
values no pair decides spread evenly (198 configurations, 46 of them MoE). `pytest -m matrix_full` runs the full
product. Each configuration is held against one rank on the same global batch (two micro-batches per pipeline
stage on each DP rank: global_batch()): losses and grad norms over 4 steps within 1e-5 relative, final weights
within 1e-5 absolute (fp32: only the summation order differs; measured over the pairwise design: losses 1.8e-7,
grad norms 3.8e-7, weights 2.3e-6). Dropless routing makes the MoE models exact up to summation order too.

bf16 (train.low_precision_on_cpu runs the real autocast path on the CPU): the Llama family under
TP2 x PP2 x DP2 + SP with ZeRO-1 is held against one rank in bf16 within 2e-3 relative per step (losses and
grad norms; measured 1.7e-5 and 3.3e-4). Justification: bf16 keeps 8 significant bits (unit roundoff
2^-9 = 2.0e-3); TP changes where matmul partial sums are rounded to bf16, so each activation differs by
O(2^-9) relative between layouts, and the loss, a mean over all tokens of the batch, averages those
independent roundings down rather than adding them up. ZeRO-1 under bf16 also keeps bf16 parameters (one
rank keeps fp32 weights: docs/design/memory.md, "Memory model"); with the bf16 residual stream one rank casts
its norm weights to bf16 too, so only the embedding weights and the gradients rounded to bf16 differ (with
the fp32 stream, where one rank's norms ran on fp32 weights, the grad norms differed by 1.7e-3). The
bf16-parameter paths themselves are held against PyTorch's own: the hand-written ZeRO-1 and ZeRO-2 against
FSDP2's mixed precision (ZeRO-3, fp32 shards gathered in bf16, fp32 reduction) at the fp32 matrix's 1e-5
(measured: losses equal, grad norms 2.5e-8, fp32 master weights equal). The test also checks that bf16's grad norms
differ from fp32's by far more than fp32 layouts differ among themselves, i.e. that bf16 really ran.

Context parallelism: CP2, CP4, CP2 x TP2 + SP, CP2 x PP2 and CP2 x DP2 with ZeRO-1,
for the Llama family (RoPE, GQA: 2 KV heads for 4 query heads) and the GPT family (learned positions), and
CP2 with the other pipeline schedules (GPipe, interleaved, zero-bubble) and with FSDP, are held against one
rank over 10 steps with the same tolerances, the rows spread over micro-batch sizes and recompute modes
(selective and full recompute re-run the K/V all-gather in backward); at most 4 ranks, so the run stays
cheap. Measured: losses 1.8e-7, grad norms 2.4e-7, weights 4.8e-7.

Expert parallelism: EP2, EP2 x TP2 + SP, EP2 x PP2 and EP4 with ZeRO-1, for both MoE
models (both router conventions, a shared expert), over 10 steps with the same tolerances. Measured:
losses 1.7e-7, grad norms 3.9e-7, weights 2.3e-6.
"""

from __future__ import annotations

import itertools
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_utils import deep_update, final_weights, fork_ranks, max_rel_diff, metrics

from trainctl.runtime.model.fp8 import RECIPES

STEPS = 4
WORLD = 8  # the largest layout below; smaller ones run on ranks [0, world)

BASE: dict[str, Any] = {
    "name": "matrix",
    "model": {"layers": 4, "hidden": 32, "heads": 4, "vocab": 255, "seq_len": 16},  # vocab pads at tp=2
    "parallel": {"tp": 1, "pp": 1, "dp": 1, "micro_batch": 16},
    # eps 1e-6: Adam divides an update by sqrt(v) + eps, so with 1e-8 an element whose gradient is at fp32
    # rounding level moves by O(lr) in a direction the summation order decides, and the weight check would
    # compare rounding, not gradients (measured: one LM-head element of 8,160 off by 3.1e-5 under MoE DP2/EP2
    # with 1e-8, 2.3e-6 with 1e-6; the rest of the model 5e-6 and 5e-7)
    "train": {"global_batch": 16, "steps": STEPS, "lr": 1e-3, "warmup": 1, "precision": "fp32", "seed": 11,
              "grad_clip": 1.0, "eps": 1e-6},
    "data": {"synthetic": True},
    "cluster": {"nodes": 1, "gpus_per_node": WORLD, "gpu": "cpu"},
    "launcher": {"backend": "local"},
}

GPT = {"norm": "layernorm", "position": "learned", "activation": "gelu", "tied_embeddings": True, "bias": True,
       "kv_heads": 4}
LLAMA = {"norm": "rmsnorm", "position": "rope", "activation": "swiglu", "tied_embeddings": False, "bias": False,
         "kv_heads": 2}
# Mixtures of experts, dropless, both router conventions: the Llama family with a shared expert in every layer
# (Mixtral's router, z-loss on), the GPT family (biases in every expert) with every other layer MoE (OLMoE's
# router); each with the balance loss on, so its gradient is held against one rank too.
MOE_LLAMA = {**LLAMA, "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden": 32, "shared_experts": 1,
                              "shared_ffn_hidden": 48, "router": "topk_softmax", "aux_loss_coeff": 0.01,
                              "z_loss_coeff": 0.001}}
MOE_GPT = {**GPT, "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden": 48, "every": 2,
                          "router": "softmax_topk", "aux_loss_coeff": 0.01}}
MODELS: dict[str, dict[str, Any]] = {
    "gpt": GPT,
    "llama": LLAMA,
    **{f"llama-{key}-{GPT[key]}".replace("_", "-").lower(): {**LLAMA, key: GPT[key]} for key in GPT},
    "moe-llama": MOE_LLAMA,
    "moe-gpt": MOE_GPT,
}
# Models of targeted tests, outside the covering design
TARGETED: dict[str, dict[str, Any]] = {
    "moe-llama-capacity": {**MOE_LLAMA, "moe": {**MOE_LLAMA["moe"], "capacity_factor": 1.0}},
}

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2-sp": {"tp": 2, "sequence_parallel": True},
    "tp2": {"tp": 2},
    "pp2-1f1b": {"pp": 2, "schedule": "1f1b"},
    "pp2-gpipe": {"pp": 2, "schedule": "gpipe"},
    "pp2-interleaved": {"pp": 2, "schedule": "interleaved", "virtual_stages": 2},
    "pp4-1f1b": {"pp": 4, "schedule": "1f1b"},
    "pp2-zero-bubble": {"pp": 2, "schedule": "zero-bubble", "virtual_stages": 2},
    "pp2-dp2-zero-bubble-zero3": {"pp": 2, "dp": 2, "schedule": "zero-bubble", "zero": 3},
    "pp2-zbv": {"pp": 2, "schedule": "zbv"},  # V placement: rank 0 holds both ends (and both tied copies)
    "pp2-dp2-zbv-zero1": {"pp": 2, "dp": 2, "schedule": "zbv", "zero": 1},
    "tp2-pp2-sp-1f1b": {"tp": 2, "pp": 2, "sequence_parallel": True, "schedule": "1f1b"},
    "tp2-pp2-1f1b": {"tp": 2, "pp": 2, "schedule": "1f1b"},
    "tp2-pp2-sp-interleaved": {"tp": 2, "pp": 2, "sequence_parallel": True, "schedule": "interleaved",
                               "virtual_stages": 2},
    "dp2": {"dp": 2, "zero": 0},
    "dp2-zero1": {"dp": 2, "zero": 1},
    "dp2-zero2": {"dp": 2, "zero": 2},
    "dp2-zero3": {"dp": 2, "zero": 3},
    "tp2-pp2-dp2-sp-zero1": {"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True, "zero": 1},
    "tp2-pp2-dp2-sp-zero3": {"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True, "zero": 3},
    # expert parallelism (MoE models only): ep carved from dp, with every ZeRO stage, TP with and without SP,
    # each pipeline schedule, and an expert-data-parallel group of 1 (ep = dp) and of 2 (ep = dp/2)
    "dp2-ep2": {"dp": 2, "ep": 2},
    "dp2-ep2-zero2": {"dp": 2, "ep": 2, "zero": 2},
    "dp2-ep2-zero3": {"dp": 2, "ep": 2, "zero": 3},
    "dp4-ep4-zero1": {"dp": 4, "ep": 4, "zero": 1},
    "dp4-ep2-zero1": {"dp": 4, "ep": 2, "zero": 1},
    "dp4-ep2-zero3": {"dp": 4, "ep": 2, "zero": 3},
    "tp2-dp2-ep2-sp": {"tp": 2, "dp": 2, "ep": 2, "sequence_parallel": True},
    "tp2-dp2-ep2": {"tp": 2, "dp": 2, "ep": 2},
    "pp2-dp2-ep2-1f1b": {"pp": 2, "dp": 2, "ep": 2, "schedule": "1f1b"},
    "pp2-dp2-ep2-interleaved": {"pp": 2, "dp": 2, "ep": 2, "schedule": "interleaved", "virtual_stages": 2},
    "pp2-dp2-ep2-zero-bubble": {"pp": 2, "dp": 2, "ep": 2, "schedule": "zero-bubble", "virtual_stages": 2},
    "tp2-pp2-dp2-ep2-sp-zero1": {"tp": 2, "pp": 2, "dp": 2, "ep": 2, "sequence_parallel": True, "zero": 1},
}

LONG_STEPS = 10  # expert and context parallelism are held against one rank over 10 steps
CP_LAYOUTS: dict[str, dict[str, Any]] = {
    "cp2": {"cp": 2},
    "cp4": {"cp": 4},
    "cp2-tp2-sp": {"cp": 2, "tp": 2, "sequence_parallel": True},
    "cp2-pp2": {"cp": 2, "pp": 2, "schedule": "1f1b"},
    "cp2-dp2-zero1": {"cp": 2, "dp": 2, "zero": 1},
    "cp2-pp2-gpipe": {"cp": 2, "pp": 2, "schedule": "gpipe"},
    "cp2-pp2-interleaved": {"cp": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2},
    "cp2-pp2-zero-bubble": {"cp": 2, "pp": 2, "schedule": "zero-bubble", "virtual_stages": 2},
    "cp2-dp2-zero3": {"cp": 2, "dp": 2, "zero": 3},
}
FACTORS: dict[str, list[str]] = {
    "model": list(MODELS),
    "layout": list(LAYOUTS),
    "micro_batch": ["1", "2", "4"],
    "recompute": ["none", "selective", "full"],
}


# The MoE models run on every EP layout and on these without EP (their experts replicated over DP, each
# schedule and TP variant being on an EP layout already): TP with and without SP, GPipe, FSDP, TP x PP x FSDP.
MOE_WITHOUT_EP = {"tp2-sp", "tp2", "pp2-gpipe", "dp2-zero3", "tp2-pp2-dp2-sp-zero3"}


def allowed(row: dict[str, str]) -> bool:
    """Whether a (partial) row is in the matrix: expert parallelism needs a mixture-of-experts model, and the
    MoE models run on the EP layouts and MOE_WITHOUT_EP."""
    if "model" not in row or "layout" not in row:
        return True
    ep = LAYOUTS.get(row["layout"], {}).get("ep", 1) > 1
    if "moe" in MODELS[row["model"]]:
        return ep or row["layout"] in MOE_WITHOUT_EP
    return not ep


def covering_design(factors: dict[str, list[str]]) -> list[dict[str, str]]:
    """A deterministic pairwise covering design (greedy, AETG-style): every allowed pair of values of any two
    factors appears in at least one row. Each row starts from the first uncovered pair and fills the other
    factors with the allowed value that covers the most uncovered pairs with what the row already holds."""
    names = list(factors)
    uncovered = {((a, va), (b, vb)) for a, b in itertools.combinations(names, 2)
                 for va in factors[a] for vb in factors[b] if allowed({a: va, b: vb})}

    def gain(row: dict[str, str], name: str, value: str) -> int:
        return sum(((n, row[n]), (name, value)) in uncovered or ((name, value), (n, row[n])) in uncovered
                   for n in row)

    rows: list[dict[str, str]] = []
    used = {(name, v): 0 for name in names for v in factors[name]}
    while uncovered:
        (a, va), (b, vb) = min(uncovered, key=lambda p: (names.index(p[0][0]), names.index(p[1][0]), p))
        row = {a: va, b: vb}
        for name in names:
            if name not in row:
                row[name] = max((v for v in factors[name] if allowed({**row, name: v})),
                                key=lambda v: (gain(row, name, v), -used[name, v], -factors[name].index(v)))
        uncovered -= {((x, row[x]), (y, row[y])) for x, y in itertools.combinations(names, 2)}
        rows.append({n: row[n] for n in names})
        for name in names:
            used[name, row[name]] += 1
    return rows


def full_product(factors: dict[str, list[str]]) -> list[dict[str, str]]:
    rows = [dict(zip(factors, values, strict=True)) for values in itertools.product(*factors.values())]
    return [r for r in rows if allowed(r)]


def layout_of(row: dict[str, str]) -> dict[str, Any]:
    return {**LAYOUTS, **CP_LAYOUTS}.get(row["layout"], {"tp": 1, "pp": 1, "dp": 1})


def global_batch(row: dict[str, str]) -> int:
    """A row's global batch: two micro-batches per pipeline stage on each DP rank. Gradient accumulation and
    every schedule's warm-up, steady state and cool-down all happen (interleaved and zero-bubble need a
    multiple of pp; ZBV's order is full from 2*pp-1), and no step runs more micro-batches than that proves anything
    with: the matrix's time goes into micro-batches, not into configurations."""
    parallel = layout_of(row)
    return parallel.get("dp", 1) * int(row["micro_batch"]) * 2 * parallel.get("pp", 1)


def case_spec(row: dict[str, str], **train: Any) -> dict[str, Any]:
    """The run spec of one row; layout "one-rank" is the reference."""
    parallel = layout_of(row)
    world = parallel.get("tp", 1) * parallel.get("cp", 1) * parallel.get("pp", 1) * parallel.get("dp", 1)
    return deep_update(BASE, {"model": {**MODELS, **TARGETED}[row["model"]],
                              "parallel": {**parallel, "micro_batch": int(row["micro_batch"])},
                              "train": {"recompute": row["recompute"], **train},
                              "cluster": {"gpus_per_node": world}})


ONE_RANK = {"layout": "one-rank", "micro_batch": "16", "recompute": "none"}


def case_id(row: dict[str, str]) -> str:
    return "_".join(row[n] for n in FACTORS)


def reference_id(row: dict[str, str]) -> str:
    """The one-rank run a row is held against: its model on its global batch (one micro-batch)."""
    return f"ref-{row['model']}-gb{global_batch(row)}"


def reference_case(row: dict[str, str], **train: Any) -> dict[str, Any]:
    gb = global_batch(row)
    one = {**ONE_RANK, "model": row["model"], "micro_batch": str(gb)}
    return {"id": reference_id(row), "spec": case_spec(one, global_batch=gb, **train)}


def row_cases(rows: list[dict[str, str]], **train: Any) -> list[dict[str, Any]]:
    """The rows' runs and, first, the distinct one-rank references they are held against."""
    refs = {reference_id(r): reference_case(r, **train) for r in rows}
    return [*refs.values(), *({"id": case_id(r), "spec": case_spec(r, global_batch=global_batch(r), **train)}
                              for r in rows)]


def run_matrix(cases: list[dict[str, Any]], out: Path, timeout: float, nproc: int = WORLD) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "cases.json").write_text(json.dumps(cases))
    # small DP buckets: several per model, so bucket overlap, ordering and ZeRO slicing are exercised
    env = {"TRAINCTL_TIMEOUT_S": "300", "TRAINCTL_BUCKET_NUMEL": "4000"}
    r = fork_ranks(nproc, [str(Path(__file__).with_name("matrix_worker.py")), str(out / "cases.json"), str(out)],
                   env=env, timeout=timeout)
    (out / "worker.log").write_text(r.stdout)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-6000:])


def compare(run: Path, ref: Path, loss_tol: float, weight_tol: float | None,
            steps: int = STEPS, gnorm_tol: float | None = None) -> tuple[float, float, float]:
    """(loss, grad norm, weight) differences of `run` from `ref`, each held to its tolerance (grad norms to
    loss_tol unless gnorm_tol is given)."""
    got, want = metrics(run), metrics(ref)
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, steps + 1))
    loss = max_rel_diff([m["loss"] for m in got], [m["loss"] for m in want])
    gnorm = max_rel_diff([m["grad_norm"] for m in got], [m["grad_norm"] for m in want])
    worst = 0.0
    if weight_tol is not None:
        w, wr = final_weights(run), final_weights(ref)
        assert set(w) == set(wr)
        worst = max((w[k] - wr[k]).abs().max().item() for k in wr)
    assert loss <= loss_tol and gnorm <= (gnorm_tol or loss_tol), (run.name, loss, gnorm)
    if weight_tol is not None:
        assert worst <= weight_tol, (run.name, worst)
    return loss, gnorm, worst


def check_rows(rows: list[dict[str, str]], out: Path, timeout: float, steps: int = STEPS, nproc: int = WORLD,
               what: str = "matrix", jobs: int = 2) -> None:
    """Every row against its one-rank reference over `steps` steps. The rows are dealt to `jobs` matrix jobs
    that run side by side, each with its own ranks, references and directory: a step of these tiny models waits
    on gloo's latency more than it computes, so two jobs keep two cores busier than one (three do no better)."""
    parts = [rows[i::jobs] for i in range(jobs)]
    train = {"steps": steps} if steps != STEPS else {}
    with ThreadPoolExecutor(jobs) as pool:
        for done in [pool.submit(run_matrix, row_cases(part, **train), out / f"job{i}", timeout, nproc)
                     for i, part in enumerate(parts)]:
            done.result()
    worst = [0.0, 0.0, 0.0]
    for i, part in enumerate(parts):
        for r in part:
            diffs = compare(out / f"job{i}" / case_id(r), out / f"job{i}" / reference_id(r), 1e-5, 1e-5, steps=steps)
            worst = [max(a, b) for a, b in zip(worst, diffs, strict=True)]
    print(f"{what}, {len(rows)} configurations x {steps} steps: max relative loss difference {worst[0]:.1e}, grad "
          f"norm {worst[1]:.1e}, max absolute weight difference {worst[2]:.1e}")


def test_covering_design_covers_every_pair() -> None:
    rows = covering_design(FACTORS)
    assert all(allowed(r) for r in rows)
    for a, b in itertools.combinations(FACTORS, 2):
        seen = {(r[a], r[b]) for r in rows}
        assert seen == {(x, y) for x, y in itertools.product(FACTORS[a], FACTORS[b]) if allowed({a: x, b: y})}, (a, b)
    # near the lower bound (the allowed pairs of the two largest factors), far below the full product
    model_layout = sum(allowed({"model": m, "layout": la}) for m in MODELS for la in LAYOUTS)
    assert len(rows) <= 1.25 * model_layout < len(full_product(FACTORS)) / 5


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pairwise_matrix_matches_one_rank(tmp_path: Path) -> None:
    check_rows(covering_design(FACTORS), tmp_path, timeout=1500)


@pytest.mark.matrix_full
@pytest.mark.timeout(7200)
def test_full_matrix_matches_one_rank(tmp_path: Path) -> None:
    check_rows(full_product(FACTORS), tmp_path, timeout=7000)


# (model, layout, micro_batch, recompute): both families on every layout, the micro-batch sizes and recompute
# modes spread over the rows
CP_ROWS = [
    ("llama", "cp2", "2", "none"), ("llama", "cp4", "2", "selective"), ("llama", "cp2-tp2-sp", "4", "full"),
    ("llama", "cp2-pp2", "2", "none"), ("llama", "cp2-dp2-zero1", "4", "selective"),
    ("gpt", "cp2", "4", "full"), ("gpt", "cp4", "4", "none"), ("gpt", "cp2-tp2-sp", "2", "selective"),
    ("gpt", "cp2-pp2", "4", "selective"), ("gpt", "cp2-dp2-zero1", "2", "full"),
    ("gpt", "cp2-pp2-gpipe", "2", "none"), ("llama", "cp2-pp2-interleaved", "2", "full"),
    ("gpt", "cp2-pp2-zero-bubble", "2", "selective"), ("llama", "cp2-dp2-zero3", "4", "none"),
]


def check_rows_over(rows: list[tuple[str, str, str, str]], tmp_path: Path, what: str) -> None:
    """Each (model, layout, micro_batch, recompute) row against one rank of its model over LONG_STEPS steps."""
    check_rows([dict(zip(FACTORS, row, strict=True)) for row in rows], tmp_path, timeout=900, steps=LONG_STEPS,
               nproc=4, what=what, jobs=1)  # 4-rank rows: two jobs of them are slower than one (measured)


@pytest.mark.slow
def test_context_parallel_matches_one_rank(tmp_path: Path) -> None:
    check_rows_over(CP_ROWS, tmp_path, "context parallel")


# expert parallelism: EP2, EP2 x TP2 (+SP), EP2 x PP2 and EP4 with ZeRO-1 over 10 steps, both router
# conventions (moe-llama: topk_softmax with a shared expert; moe-gpt: softmax_topk, every other layer MoE)
MOE_ROWS = [
    ("moe-llama", "dp2-ep2", "2", "none"), ("moe-gpt", "dp2-ep2", "4", "selective"),
    ("moe-llama", "tp2-dp2-ep2-sp", "4", "selective"), ("moe-gpt", "tp2-dp2-ep2-sp", "2", "full"),
    ("moe-llama", "pp2-dp2-ep2-1f1b", "2", "full"), ("moe-gpt", "pp2-dp2-ep2-1f1b", "4", "none"),
    ("moe-llama", "dp4-ep4-zero1", "1", "none"), ("moe-gpt", "dp4-ep4-zero1", "2", "selective"),
]


@pytest.mark.slow
def test_expert_parallel_matches_one_rank_over_ten_steps(tmp_path: Path) -> None:
    check_rows_over(MOE_ROWS, tmp_path, "expert parallel")


@pytest.mark.slow
def test_capacity_drops_the_same_tokens_in_every_layout(tmp_path: Path) -> None:
    """With a capacity factor an expert takes at most C assignments of each sequence (runtime/model/moe.py): the
    same ones in every layout, so the losses, grad norms and weights still match one rank, drops and all."""
    rows = [{"model": "moe-llama-capacity", "layout": layout, "micro_batch": mb, "recompute": "none"}
            for layout, mb in (("tp2-dp2-ep2-sp", "2"), ("pp2-dp2-ep2-1f1b", "4"), ("dp4-ep2-zero1", "1"))]
    run_matrix(row_cases(rows), tmp_path, timeout=600)
    for r in rows:
        compare(tmp_path / case_id(r), tmp_path / reference_id(r), 1e-5, 1e-5)
        dropped = [m["moe"]["dropped"] for m in metrics(tmp_path / reference_id(r))]
        assert all(d > 0 for d in dropped), dropped  # the capacity really binds
        assert [m["moe"]["dropped"] for m in metrics(tmp_path / case_id(r))] == dropped


@pytest.mark.slow
def test_llama_tp_pp_sp_in_bf16_matches_one_rank_in_bf16(tmp_path: Path) -> None:
    """The real bf16 autocast path under TP2 x PP2 x DP2 + SP (ZeRO-1: bf16 parameters, fp32 master) at
    micro_batch 2 and 4, against one rank (fp32 weights, autocast); and the hand-written bf16 ZeRO-1 and
    ZeRO-2 against FSDP2's own mixed precision (ZeRO-3: fp32 shards gathered in bf16, fp32 reduction)."""
    bf16 = {"precision": "bf16", "low_precision_on_cpu": True}
    cases = [{"id": "ref-bf16", "spec": case_spec({"model": "llama", **ONE_RANK}, **bf16)},
             {"id": "ref-fp32", "spec": case_spec({"model": "llama", **ONE_RANK})}]
    for mb in ("2", "4"):
        row = {"model": "llama", "layout": "tp2-pp2-dp2-sp-zero1", "micro_batch": mb, "recompute": "selective"}
        cases.append({"id": f"bf16-mb{mb}", "spec": case_spec(row, **bf16)})
    for layout in ("dp2-zero1", "dp2-zero2", "dp2-zero3"):
        row = {"model": "llama", "layout": layout, "micro_batch": "2", "recompute": "none"}
        cases.append({"id": f"bf16-{layout}", "spec": case_spec(row, **bf16)})
    run_matrix(cases, tmp_path, timeout=600)
    for mb in ("2", "4"):
        loss, gnorm, _ = compare(tmp_path / f"bf16-mb{mb}", tmp_path / "ref-bf16", 2e-3, None)
        print(f"bf16 micro_batch {mb}: max relative loss difference {loss:.1e}, grad norm {gnorm:.1e}")
    for zero in ("1", "2"):
        loss, gnorm, weights = compare(tmp_path / f"bf16-dp2-zero{zero}", tmp_path / "bf16-dp2-zero3", 1e-5, 1e-5)
        print(f"bf16 ZeRO-{zero} vs FSDP2 mixed precision: loss {loss:.1e}, grad norm {gnorm:.1e}, "
              f"fp32 master weights {weights:.1e}")
    # bf16 really ran: near initialisation the loss is ~ln(vocab) whatever the precision, but the gradients
    # carry bf16's rounding (fp32 layouts agree on grad norms to ~3e-7)
    bf, fp = metrics(tmp_path / "ref-bf16"), metrics(tmp_path / "ref-fp32")
    assert max_rel_diff([m["grad_norm"] for m in bf], [m["grad_norm"] for m in fp]) > 1e-4
    assert all(torch.isfinite(torch.tensor([m["loss"] for m in bf])))


# FP8 (train.precision fp8, emulated on the CPU; docs/design/trainer.md, "FP8 training"): every kind of layout
# once, both families and both MoE models, both recipes, against one rank in fp8 (fp32 elsewhere on the CPU).
FP8_ROWS = [
    ("llama", "tp2-sp", "2", "selective", "tensorwise"), ("gpt", "tp2", "4", "none", "rowwise"),
    ("llama", "pp2-zero-bubble", "2", "none", "rowwise"), ("gpt", "pp2-interleaved", "2", "full", "tensorwise"),
    ("llama", "dp2-zero1", "4", "none", "tensorwise"), ("gpt", "dp2-zero3", "2", "selective", "rowwise"),
    ("llama", "tp2-pp2-dp2-sp-zero1", "2", "full", "rowwise"), ("llama", "cp2-tp2-sp", "2", "none", "tensorwise"),
    ("moe-llama", "tp2-dp2-ep2-sp", "2", "none", "tensorwise"), ("moe-gpt", "dp2-ep2-zero3", "2", "full", "rowwise"),
]
# Dynamic scales depend on which tokens share a GEMM (the micro-batch, the SP and CP shard: an amax over other
# tokens), so an FP8 layout and one rank quantize differently: they agree to FP8's rounding, not fp32's. e4m3
# rounds each operand within 2^-4 relative, and the loss and grad norm, sums over every token and weight,
# average those independent roundings down. Measured over FP8_ROWS: losses 2.6e-4, grad norms 5.4e-3, as far
# apart as one rank in fp8 is from one rank in fp32 (losses 1.9e-5 to 1.7e-4, grad norms 8.3e-4 to 5.4e-3).
# The full FP8 matrix (73 configurations, -m matrix_full -k fp8, 2.7 min on 2 cores): losses 2.6e-4, grad norms
# 8.0e-3. Tolerances about 4x the measured: losses 1e-3, grad norms 2e-2; the weights are not compared (Adam's
# first steps move each weight by ~lr whatever the gradient's rounding, in the direction the rounding decides).
FP8_LOSS_TOL, FP8_GNORM_TOL = 1e-3, 2e-2


def fp8_cases(rows: list[tuple[str, str, str, str, str]]) -> list[dict[str, Any]]:
    """Each (model, layout, micro_batch, recompute, recipe) row in fp8, its one-rank fp8 reference and its
    one-rank fp32 reference (each reference once)."""
    cases: dict[str, dict[str, Any]] = {}
    for model, layout, mb, recompute, recipe in rows:
        row = {"model": model, "layout": layout, "micro_batch": mb, "recompute": recompute}
        fp8 = {"precision": "fp8", "fp8_recipe": recipe}
        ref8, ref32 = reference_case(row, **fp8), reference_case(row)
        cases.setdefault(f"{ref8['id']}-{recipe}", {**ref8, "id": f"{ref8['id']}-{recipe}"})
        cases.setdefault(f"{ref32['id']}-fp32", {**ref32, "id": f"{ref32['id']}-fp32"})
        run = f"{case_id(row)}-{recipe}"
        cases[run] = {"id": run, "spec": case_spec(row, global_batch=global_batch(row), **fp8)}
    return list(cases.values())


def check_fp8_rows(rows: list[tuple[str, str, str, str, str]], out: Path, timeout: float) -> None:
    """Each FP8 row against one rank in fp8 within FP8_LOSS_TOL and FP8_GNORM_TOL, and FP8 really ran: one rank's
    fp8 grad norms are further from fp32's than fp32 layouts are from each other (~4e-7)."""
    run_matrix(fp8_cases(rows), out, timeout=timeout)
    worst = [0.0, 0.0]
    for model, layout, mb, recompute, recipe in rows:
        row = {"model": model, "layout": layout, "micro_batch": mb, "recompute": recompute}
        ref = out / f"{reference_id(row)}-{recipe}"
        loss, gnorm, _ = compare(out / f"{case_id(row)}-{recipe}", ref, FP8_LOSS_TOL, None, gnorm_tol=FP8_GNORM_TOL)
        worst = [max(worst[0], loss), max(worst[1], gnorm)]
        fp32 = metrics(out / f"{reference_id(row)}-fp32")
        assert max_rel_diff([m["grad_norm"] for m in metrics(ref)], [m["grad_norm"] for m in fp32]) > 1e-4, row
    print(f"fp8, {len(rows)} configurations: max relative loss difference {worst[0]:.1e}, grad norm {worst[1]:.1e}")


@pytest.mark.slow
def test_fp8_layouts_match_one_rank_in_fp8(tmp_path: Path) -> None:
    check_fp8_rows(FP8_ROWS, tmp_path, timeout=900)


@pytest.mark.matrix_full
@pytest.mark.timeout(3600)
def test_full_matrix_fp8_every_layout_matches_one_rank(tmp_path: Path) -> None:
    """Every layout of the matrix (CP's included) with every model family that runs on it, in fp8 at micro-batch
    2, recompute and recipe alternating: the layout factor whole, the others as FP8_ROWS spreads them."""
    layouts = [*LAYOUTS, *CP_LAYOUTS]
    rows = [(model, layout, "2", ("none", "selective", "full")[i % 3], RECIPES[i % 2])
            for i, (model, layout) in enumerate((m, la) for la in layouts for m in ("llama", "gpt", "moe-llama")
                                                if allowed({"model": m, "layout": la}))]
    check_fp8_rows(rows, tmp_path, timeout=3300)

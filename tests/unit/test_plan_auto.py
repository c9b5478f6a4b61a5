"""`trainctl plan --auto` and the roofline's invariants.

- --auto never returns an invalid layout: every returned layout is a RunSpec that passed
  trainctl.spec.validate_spec, and on small clusters every *enumerated* layout passes it too, and
  every layout the rules accept (with the search's fixed choices) is enumerated.
- Predicted MFU never exceeds 1 (docs/design/memory.md, "MFU convention": an MFU above 100% is a bug),
  nor the best GEMM efficiency the catalog cites for the part.
- The fast score --auto ranks by equals the full evaluation's step time and memory.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from paths import RECIPES

from trainctl.errors import SpecError
from trainctl.hardware.catalog import ACCELERATORS
from trainctl.plan.auto import enumerate_candidates, enumerate_shapes, search, zero_variants
from trainctl.plan.estimate import Candidate, Evaluator
from trainctl.plan.plan import build_plan, context_from_spec
from trainctl.spec import load_spec, load_spec_text, validate_spec
from trainctl.spec.models import RunSpec


def small_spec(nodes: int, gpn: int, layers: int, heads: int, kv: int, gb: int, gpu: str = "h100-sxm") -> RunSpec:
    return load_spec_text(f"""
name: small
model: {{layers: {layers}, hidden: {heads * 16}, heads: {heads}, kv_heads: {kv}, vocab: 1000, seq_len: 128,
         activation: swiglu, norm: rmsnorm, position: rope, tied_embeddings: false}}
parallel: {{tp: 1, pp: 1, dp: auto}}
train: {{global_batch: {gb}, steps: 10}}
cluster: {{nodes: {nodes}, gpus_per_node: {gpn}, gpu: {gpu}}}
launcher: {{backend: slurm}}
""")


def as_data(spec: RunSpec, c: Candidate) -> dict:
    data = spec.model_dump(by_alias=True)
    data["parallel"].update(tp=c.tp, pp=c.pp, dp=c.dp, zero=c.zero, micro_batch=c.micro_batch,
                            sequence_parallel=c.sequence_parallel, schedule=c.schedule,
                            virtual_stages=c.virtual_stages, stage_layers=None,
                            offload="optimizer" if c.offload else "none")
    data["train"]["recompute"] = c.recompute
    return data


small_clusters = dict(
    nodes=st.integers(1, 3), gpn=st.sampled_from([1, 2, 4, 8]), layers=st.integers(1, 8),
    heads=st.sampled_from([2, 4, 6, 8]), kv_div=st.sampled_from([1, 2]), gb=st.sampled_from([1, 6, 8, 16, 24, 48]),
)


@settings(max_examples=25, deadline=None)
@given(**small_clusters)
def test_auto_never_returns_an_invalid_layout(nodes, gpn, layers, heads, kv_div, gb):
    try:  # --auto starts from a valid spec (pure data parallelism here)
        spec = small_spec(nodes=nodes, gpn=gpn, layers=layers, heads=heads, kv=heads // kv_div, gb=gb)
    except SpecError:
        assume(False)
    res = search(spec, top=10_000)
    assert res.invalid == []
    for scored, run, _ in res.top:
        validate_spec(run.model_dump(by_alias=True))  # raises if invalid
        assert run.parallel.tp == scored.cand.tp and run.dp == scored.cand.dp
        assert scored.est.fits
    # Sound: every enumerated layout passes the spec rules (not only the ones shown).
    for c in enumerate_candidates(spec, {}):
        validate_spec(as_data(spec, c))


@pytest.mark.parametrize("nodes,gpn,layers,heads,kv,gb", [(1, 8, 4, 4, 2, 16), (2, 4, 6, 6, 6, 24)])
def test_auto_enumerates_every_layout_the_rules_accept(nodes, gpn, layers, heads, kv, gb):
    """Complete: brute force over a grid of parallel settings and schedules, keep what validate_spec accepts
    (with the search's fixed choices: sp iff tp > 1 and no gpipe), and compare with the enumeration."""
    spec = small_spec(nodes=nodes, gpn=gpn, layers=layers, heads=heads, kv=kv, gb=gb)
    world = nodes * gpn
    accepted = set()
    for tp, pp, mb, v, sched in itertools.product(range(1, world + 1), range(1, world + 1), range(1, gb + 1),
                                                  range(1, layers + 1), ("1f1b", "interleaved", "zero-bubble", "zbv")):
        if world % (tp * pp) or (v > 1 and pp == 1):
            continue
        c = Candidate(tp=tp, pp=pp, dp=world // (tp * pp), zero=1, micro_batch=mb, recompute="none",
                      sequence_parallel=tp > 1 and 128 % tp == 0, schedule=sched, virtual_stages=v)
        try:
            validate_spec(as_data(spec, c))
        except SpecError:
            continue
        accepted.add((c.tp, c.pp, c.dp, c.micro_batch, c.schedule, c.virtual_stages))
    enumerated = {(c.tp, c.pp, c.dp, c.micro_batch, c.schedule, c.virtual_stages)
                  for c in enumerate_candidates(spec, {})}
    assert enumerated == accepted


def test_each_layout_shape_expands_to_every_zero_stage_and_offload():
    """The pruned search builds a shape's ZeRO/offload variants only when it scores them: the candidates are
    exactly each shape with ZeRO 0-3, and 1-3 again with the optimizer offloaded where it is sharded, every other
    field kept (a new Candidate field too), in enumeration order."""
    spec = small_spec(nodes=2, gpn=4, layers=6, heads=6, kv=6, gb=24)
    shapes = enumerate_shapes(spec, {})
    expected = [replace(s, zero=zero, offload=off) for s in shapes for zero in range(4) for off in (False, True)
                if not off or (zero and s.dp * s.cp > 1)]
    assert enumerate_candidates(spec, {}) == expected
    assert {s.zero for s in shapes} == {0} and any(s.dp * s.cp == 1 for s in shapes)
    odd = Candidate(tp=2, pp=3, dp=4, micro_batch=5, recompute="full", sequence_parallel=True, schedule="interleaved",
                    virtual_stages=2, stage_layers=(1, 2, 1, 2, 1, 2), ep=2, cp=2)
    assert zero_variants(odd)[4] == replace(odd, zero=2, offload=True)


def test_auto_llama3_405b_at_16k_gpus():
    spec = load_spec_text("""
name: l405
model: {preset: llama3-405b}
parallel: {tp: 8, pp: 16, dp: auto, sequence_parallel: true, schedule: interleaved, virtual_stages: 2}
train: {global_batch: 2048, steps: 10, recompute: full}
cluster: {nodes: 2048, gpus_per_node: 8, gpu: h100-sxm, interconnect: ndr}
launcher: {backend: slurm}
""")
    res = search(spec, top=5)
    assert res.evaluated > 1000 and res.invalid == [] and len(res.top) == 5
    mfus = [s.mfu for s, _, _ in res.top]
    # no layout beats the best GEMM the catalog cites for the part (the operator model's ceiling)
    assert mfus == sorted(mfus, reverse=True) and 0 < mfus[0] < ACCELERATORS["h100-sxm"].gemm_efficiency
    for s, run, _ in res.top:
        assert run.parallel.tp == 8  # at 16k GPUs and 2048 sequences only tp = 8 gives pp micro-batches
        assert build_plan(run).mfu == pytest.approx(s.mfu, rel=1e-9)  # --auto ranks what `plan` prints
    for s, why in res.rejected:
        assert not s.est.fits and "GB >" in why
    js = res.to_json()
    assert {"top", "rejected", "evaluated", "fitting", "skipped", "assumptions"} <= set(js)


LAYOUT = st.fixed_dictionaries(dict(
    tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4, 8]), dp=st.sampled_from([1, 2, 4, 16]),
    zero=st.integers(0, 3), micro_batch=st.sampled_from([1, 2, 4]),
    recompute=st.sampled_from(["none", "selective", "full"]), v=st.sampled_from([1, 2, 3]),
    ce=st.floats(0.05, 1.0), cme=st.floats(0.05, 1.0), overlap=st.floats(0, 1), tp_overlap=st.floats(0, 1),
))


@settings(max_examples=150, deadline=None)
@given(LAYOUT)
def test_predicted_mfu_never_exceeds_one_and_score_matches(d):
    from dataclasses import replace

    spec = load_spec_text("""
name: mfu
model: {preset: llama3-8b}
train: {global_batch: 512, steps: 10}
cluster: {nodes: 1, gpus_per_node: 8, gpu: h100-sxm}
""")
    ctx = context_from_spec(spec)
    world = d["tp"] * d["pp"] * d["dp"]
    ctx = replace(ctx, world=world, assume=replace(ctx.assume, compute_efficiency=d["ce"],
                                                   comm_efficiency=d["cme"], dp_overlap=d["overlap"],
                                                   tp_overlap=d["tp_overlap"]))
    v = d["v"] if d["pp"] > 1 else 1
    c = Candidate(tp=d["tp"], pp=d["pp"], dp=d["dp"], zero=d["zero"], micro_batch=d["micro_batch"],
                  recompute=d["recompute"], sequence_parallel=d["tp"] > 1, schedule="interleaved" if v > 1 else "1f1b",
                  virtual_stages=v)
    ev = Evaluator(ctx)
    e = ev.evaluate(c)
    mfu = e.mfu(world, ctx.hw.peak_flops)
    assert mfu is not None and 0 < mfu <= d["ce"] + 1e-12 <= 1 + 1e-12
    step, mem = ev.score(c)
    assert step == e.step_time and mem == pytest.approx(e.memory_total, rel=1e-12)
    assert e.bubble_fraction < 1 and e.dp_exposed_time >= 0


def test_auto_ranks_layouts_with_headroom_before_tight_ones():
    """A layout at 95% of device memory is a crash waiting for the CUDA context and NCCL buffers: the
    search puts every layout with >= 10% headroom first (Llama-3 8B on 32 H100s has plenty of those)."""

    from trainctl.spec import load_spec

    recipe = RECIPES / "llama3-8b.yaml"
    result = search(load_spec(recipe), top=20)
    fractions = [scored.est.headroom_fraction for scored, _, _ in result.top]
    assert fractions[0] >= 0.10
    tight = [f < 0.10 for f in fractions]
    assert tight == sorted(tight)  # no comfortable layout after a tight one


@pytest.mark.parametrize("recipe", ["mtnlg-530b", "dgxc-gpt3-175b"])
def test_the_search_names_the_stack_it_priced_as_plan_does(recipe: str) -> None:
    """`plan --auto` prices every layout with the spec's estimate.* (another stack's kernels, gradient passes,
    pipeline sends, overlaps) and prints them as `plan` does: the same assumptions, field by field."""
    spec = load_spec(RECIPES / "published" / f"{recipe}.yaml")
    auto = search(spec, top=1).assumptions
    plan = build_plan(spec).to_json()["assumptions"]
    for field in ("attention_kernel", "elementwise", "grad_accumulation", "pp_scatter_gather", "dp_overlap",
                  "tp_overlap", "compute_efficiency", "comm_efficiency"):
        assert auto[field] == plan[field], field

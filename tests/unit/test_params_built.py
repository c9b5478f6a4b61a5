"""The planner's parameter counts are the trainer's: every recipe (and layouts that stress the ends of the
pipeline) built on the meta device, stage by stage as the trainer builds them, against `trainctl plan`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from paths import RECIPES, TINY_RECIPE

from trainctl.model_shape import ModelShape, param_counts
from trainctl.plan.pipeline import spec_stages_of_pp_rank, stage_layer_ranges
from trainctl.plan.plan import build_plan
from trainctl.runtime.model.moe import EPContext, MoEContext
from trainctl.runtime.model.parallel_context import ParallelContext
from trainctl.runtime.model.transformer import StageModule, params_built, params_record
from trainctl.runtime.parallel.tensor_parallel import TPContext
from trainctl.spec import load_spec

RECIPE_FILES = sorted(RECIPES.glob("*.yaml"))

# Layouts of the embedded tiny model that move the embedding, the LM head and the vocabulary padding:
# a tied copy on a separate last stage, interleaved chunks, ZBV's V (both ends and both tied copies on pipeline
# rank 0), a vocabulary that tp does not divide, untied.
TINY_LAYOUTS = [
    ["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.dp=4"],
    ["parallel.virtual_stages=2", "parallel.schedule=interleaved"],
    ["parallel.virtual_stages=2", "parallel.schedule=zbv"],
    ["parallel.tp=3", "parallel.pp=1", "parallel.dp=1", "parallel.sequence_parallel=false",
     "cluster.gpus_per_node=3", "model.heads=6", "model.hidden=96", "model.ffn_hidden=384"],
    ["model.tied_embeddings=false", "model.bias=true"],
    ["model.norm=rmsnorm", "model.position=rope", "model.activation=swiglu", "model.kv_heads=2"],
]
# Mixture-of-experts layouts of tiny-moe-cpu: experts split over ep, dense first layer, biases in every expert
# (split and replicated over TP), two shared experts of their own size, a pipeline rank without MoE layers.
MOE_LAYOUTS = [
    ["parallel.ep=1"],
    ["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.dp=4", "parallel.ep=4"],
    ["model.moe.first_dense=1", "model.bias=true", "model.norm=layernorm", "model.moe.shared_experts=2",
     "model.moe.shared_ffn_hidden=32"],
    ["parallel.pp=2", "parallel.dp=1", "parallel.ep=1", "model.moe.every=2", "model.moe.first_dense=2"],
]


def built_record(spec) -> dict:
    """What the trainer records (Trainer._params_record), one rank per pipeline rank (each EP rank's experts:
    the trainer gathers their names over the EP group), on the meta device."""
    shape = ModelShape.from_spec(spec.model)
    p = spec.parallel
    tp = TPContext(None, p.tp, 0, p.sequence_parallel)
    ranges = stage_layer_ranges(spec)
    by_pp_rank = {}
    with torch.device("meta"):
        for r in range(p.pp):
            built = []
            for e in range(p.ep):
                moe = MoEContext.build(shape, EPContext(None, p.ep, e)) if shape.moe is not None else None
                stages = [StageModule(shape, ranges[s], first=s == 0, last=s == len(ranges) - 1,
                                      ctx=ParallelContext(tp=tp, moe=moe))
                          for s in spec_stages_of_pp_rank(r, spec)]
                built.append(params_built(stages))
            by_pp_rank[r] = (built[0][0], {k: v for _, names in built for k, v in names.items()})
    return params_record(by_pp_rank)


def _check(spec) -> None:
    planned = build_plan(spec).to_json()["params"]
    built = built_record(spec)
    assert built["total"] == planned["total"] == param_counts(ModelShape.from_spec(spec.model)).total
    assert built["per_rank"] == planned["per_rank"]


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.stem)
def test_recipe_plan_counts_what_the_trainer_builds(path: Path) -> None:
    _check(load_spec(path))


@pytest.mark.parametrize("overrides", TINY_LAYOUTS, ids=lambda o: ",".join(o))
def test_layout_plan_counts_what_the_trainer_builds(overrides: list[str]) -> None:
    _check(load_spec(TINY_RECIPE, overrides=overrides))


@pytest.mark.parametrize("overrides", MOE_LAYOUTS, ids=lambda o: ",".join(o))
def test_moe_layout_plan_counts_what_the_trainer_builds(overrides: list[str]) -> None:
    _check(load_spec(RECIPES / "tiny-moe-cpu.yaml", overrides=overrides))


def test_layernorm_bias_only_with_bias() -> None:
    """The planner used to count a LayerNorm bias always (218,240 for tiny-cpu against the 217,664 the
    trainer built): a LayerNorm has a bias only with model.bias: true, as the trainer builds it."""
    spec = load_spec(TINY_RECIPE)
    assert spec.model.norm == "layernorm" and not spec.model.bias
    assert built_record(spec)["total"] == param_counts(ModelShape.from_spec(spec.model)).total == 217_664

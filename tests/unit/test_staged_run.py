"""Staged training (train.stages) through the real CLI: plan prices each stage's steps at its own shape and sums
them, the rules name each inconsistent stage in one line, launch refuses what the trainer would not run, and
the published whole runs (BLOOM, Llama 3.1 405B) planned from their recipes, with the GPU-hours error held."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_utils import trainctl
from paths import REPO

LLAMA_8B = REPO / "recipes" / "llama3-8b.yaml"
TINY = REPO / "recipes" / "tiny-cpu.yaml"


def staged(tmp_path: Path, base: Path, stages: list[dict[str, Any]], **train: Any) -> Path:
    """`base` with train.stages (train.steps/tokens dropped and no warm-up, unless given)."""
    spec = yaml.safe_load(base.read_text())
    spec["train"] = {k: v for k, v in spec["train"].items() if k not in ("steps", "tokens")}
    spec["train"].update({"warmup": 0, **train}, stages=stages)
    path = tmp_path / f"{base.stem}-staged.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def plan_json(path: Path) -> dict[str, Any]:
    out = trainctl("plan", str(path), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_plan_prices_each_stage_at_its_shape_and_sums_the_run(tmp_path: Path) -> None:
    """Two stages of llama3-8b: 100 steps at the recipe's shape, 50 at twice the sequence and half the batch (the
    same tokens per step). Each stage's step is the plan of that shape alone; the whole run's compute is their
    sum, its steps their total, and a stage's tokens added again add exactly its compute."""
    base = plan_json(LLAMA_8B)
    per_step = base["flops"]["tokens_per_step"]
    gb = base["layout"]["global_batch"]
    stages = [{"name": "short", "tokens": 100 * per_step},
              {"name": "long", "tokens": 50 * per_step, "global_batch": gb // 2, "seq_len": 16384}]
    run = plan_json(staged(tmp_path, LLAMA_8B, stages))["checkpoint"]["whole_run"]
    short, long = run["stages"]
    assert (short["steps"], long["steps"], run["steps"]) == (100, 50, 150)
    assert short["step_time_s"] == pytest.approx(base["prediction"]["step_time_s"], rel=1e-12)
    assert long["seq_len"] == 16384 and long["step_time_s"] > short["step_time_s"]  # attention grows with s
    assert run["compute_s"] == pytest.approx(100 * short["step_time_s"] + 50 * long["step_time_s"], rel=1e-12)
    assert run["tokens"] == 150 * per_step and run["given"] == "train.stages"
    more = plan_json(staged(tmp_path, LLAMA_8B, [*stages, {**stages[1], "name": "long-again"}]))
    assert more["checkpoint"]["whole_run"]["compute_s"] == pytest.approx(run["compute_s"] + long["compute_s"])
    text = trainctl("plan", str(staged(tmp_path, LLAMA_8B, stages)), env={"COLUMNS": "300"}).stdout
    assert "stage long" in text and f"50 steps x {gb // 2} x 16,384 tokens" in text and "150 steps in 2 stages" in text


def test_inconsistent_stages_are_refused_one_line_each(tmp_path: Path) -> None:
    """Each mistake its own line naming the stage and the fix: tokens not whole steps, a cp that breaks the world
    size, a repeated name, train.tokens beside the stages; nothing is priced."""
    per_step = plan_json(LLAMA_8B)["flops"]["tokens_per_step"]
    bad = staged(tmp_path, LLAMA_8B, [{"name": "a", "tokens": 100 * per_step + 1},
                                      {"name": "a", "tokens": per_step, "cp": 2}], tokens=per_step)
    out = trainctl("plan", str(bad))
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert any("train.stages[0] (a).tokens" in ln and "not a multiple" in ln and "use " in ln for ln in lines)
    assert any(ln.count("train.stages[1] (a): parallel.dp") == 1 and "cluster has" in ln for ln in lines)
    assert any("stage names repeat" in ln for ln in lines)
    assert any("train.tokens" in ln and "beside train.stages" in ln for ln in lines)
    steps = staged(tmp_path, LLAMA_8B, [{"name": "a", "tokens": per_step}], steps=7)
    out = trainctl("plan", str(steps))
    assert out.returncode == 2
    assert "train.steps = 7: disagrees with train.stages, whose tokens make 1 steps" in out.stderr


def test_a_stage_at_its_own_micro_batch_is_that_plan(tmp_path: Path) -> None:
    """BLOOM ran its batch ramp at micro-batch 1 and the rest at 2 (train.stages[].micro_batch): a stage's step is
    the plan of the spec at that micro-batch and batch, and plan says each stage's micro-batch where they differ."""
    base = plan_json(LLAMA_8B)
    per_step = base["flops"]["tokens_per_step"]
    stages = [{"name": "mb2", "tokens": 10 * per_step, "micro_batch": 2}, {"name": "mb1", "tokens": 10 * per_step}]
    run = plan_json(staged(tmp_path, LLAMA_8B, stages))["checkpoint"]["whole_run"]
    two = trainctl("plan", str(LLAMA_8B), "--json", "--set", "parallel.micro_batch=2")
    assert two.returncode == 0, two.stderr
    assert run["stages"][0]["micro_batch"] == 2 and run["stages"][1]["micro_batch"] == 1
    assert run["stages"][0]["step_time_s"] == pytest.approx(json.loads(two.stdout)["prediction"]["step_time_s"],
                                                            rel=1e-12)
    assert run["stages"][1]["step_time_s"] == pytest.approx(base["prediction"]["step_time_s"], rel=1e-12)
    text = trainctl("plan", str(staged(tmp_path, LLAMA_8B, stages)), env={"COLUMNS": "300"}).stdout
    assert "micro-batch 2)" in text and "micro-batch 1)" in text


def test_a_stage_on_fewer_nodes_is_priced_on_its_own_gpus(tmp_path: Path) -> None:
    """A stage may run on part of the cluster (train.stages[].nodes; Llama 3 trained its first 16M-token stage on
    8,192 of 16,384 GPUs, Table 4). Half the nodes at half the batch is the same work per GPU, so the same step;
    the run's GPU-hours and failure rate count each stage's own GPUs, weighted by its compute: here equal
    compute on N/2 and N GPUs holds 3N/4 of them, and the MTBF is the fleet's GPU-hours per failure over 3N/4."""
    base = yaml.safe_load(LLAMA_8B.read_text())
    nodes, gpn = base["cluster"]["nodes"], base["cluster"]["gpus_per_node"]
    j = plan_json(LLAMA_8B)
    per_step, gb, dp = j["flops"]["tokens_per_step"], j["layout"]["global_batch"], j["layout"]["dp"]
    stages = [{"name": "half", "tokens": 50 * per_step // 2, "global_batch": gb // 2, "dp": dp // 2,
               "nodes": nodes // 2},
              {"name": "all", "tokens": 50 * per_step}]
    out = plan_json(staged(tmp_path, LLAMA_8B, stages, global_batch=gb))
    run = out["checkpoint"]["whole_run"]
    half, full = run["stages"]
    assert (half["nodes"], half["gpus"], full["nodes"]) == (nodes // 2, nodes * gpn // 2, nodes)
    # the same work per GPU: the steps differ only by the DP ring's per-step latency over half the ranks
    assert half["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-4)
    held = (half["compute_s"] * half["gpus"] + full["compute_s"] * full["gpus"]) / run["compute_s"]
    assert held == pytest.approx(0.75 * nodes * gpn, rel=1e-4)
    assert run["gpu_hours"] == pytest.approx(run["wall_days"]["mean"] * 24 * held, rel=1e-9)
    fleet_hours = float(run["mtbf_source"].split(" GPU-hours")[0].replace(",", ""))
    assert run["mtbf_s"] == pytest.approx(fleet_hours / held * 3600, rel=1e-4)  # the source rounds its hours
    text = trainctl("plan", str(staged(tmp_path, LLAMA_8B, stages, global_batch=gb)), env={"COLUMNS": "300"}).stdout
    assert f"dp {dp // 2}, {nodes // 2:,} nodes)" in text and "GPU-hours (each stage's on its own GPUs)" in text
    # a stage's dp that does not fill the cluster names the nodes that would fit it; more nodes than the cluster's
    bad = staged(tmp_path, LLAMA_8B, [{"name": "a", "tokens": per_step // 2, "global_batch": gb // 2,
                                       "dp": dp // 2},
                                      {"name": "b", "tokens": per_step, "nodes": 2 * nodes}], global_batch=gb)
    err = trainctl("plan", str(bad))
    assert err.returncode == 2 and "Traceback" not in err.stderr
    assert f"train.stages[0] (a): parallel.dp = {dp // 2}" in err.stderr
    assert f"give the stage nodes: {nodes // 2}" in err.stderr
    assert f"train.stages[1] (b).nodes = {2 * nodes}: more than the cluster's {nodes:,} nodes" in err.stderr


def test_launch_refuses_stages_rather_than_train_another_shape(tmp_path: Path) -> None:
    """The trainer runs one shape: a staged spec is refused at launch (one line, exit 2, no run directory),
    not trained at its base shape in silence."""
    spec = staged(tmp_path, TINY, [{"name": "a", "tokens": 16 * 64 * 3}, {"name": "b", "tokens": 8 * 64 * 2,
                                                                           "global_batch": 8}])
    out = trainctl("launch", str(spec), "--run-dir", str(tmp_path / "run"), "--dry-run")
    assert out.returncode == 2 and "train.stages" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()
    assert trainctl("validate", str(spec)).returncode == 0


def test_the_node_sweep_refuses_stages_rather_than_price_one_shape() -> None:
    """The sweep's whole run prices the spec's one shape: a staged spec is refused in one line, not priced as
    if every stage were the base."""
    out = trainctl("plan", str(REPO / "recipes" / "bloom-176b.yaml"), "--auto", "--nodes", "24..48")
    assert out.returncode == 2 and "the node sweep prices one shape, not train.stages' 3" in out.stderr
    assert "Traceback" not in out.stderr


# The published whole runs, planned from their recipes (estimate.* as each names its stack): GPU-hours against the
# published figure. TARGET is the goal for published whole runs; the third figure of each is the error the plan
# achieves today (the step model is uncalibrated against these runs; nothing is fitted to them), so a change
# that moves it must say so here.
TARGET = 0.10
PUBLISHED = {  # recipe -> (published GPU-hours, source, error held today)
    "bloom-176b": (1_082_990, "BLOOM paper sec. 3.5.1 / model card: 1,082,990 A100 GPU-hours", 0.10),
    "llama3-405b-staged": (30.84e6, "Llama 3.1 model card: 30.84M H100 GPU-hours for the 405B", 0.02),
}


@pytest.mark.parametrize("recipe", sorted(PUBLISHED))
def test_published_whole_run_gpu_hours_from_the_recipe(recipe: str) -> None:
    published, source, held = PUBLISHED[recipe]
    run = plan_json(REPO / "recipes" / f"{recipe}.yaml")["checkpoint"]["whole_run"]
    error = run["gpu_hours"] / published - 1.0
    print(f"{recipe}: planned {run['gpu_hours']:,.0f} GPU-hours against {published:,.0f} ({source}): "
          f"{error:+.1%} (target within {TARGET:.0%})")
    assert abs(error) <= held, f"{recipe}: {error:+.1%} against the {held:.0%} held"
    # the whole run is the sum of its stages, each at its own shape
    assert run["compute_s"] == pytest.approx(sum(s["steps"] * s["step_time_s"] for s in run["stages"]), rel=1e-9)


def test_the_405b_recipe_follows_the_paper_and_its_oom_line_names_the_bytes() -> None:
    """Llama 3 (sec. 3.3.2) trained 405B at 8K without activation checkpointing, optimizer state sharded and
    gradients accumulated whole in fp32, reduce-scattered once a step (ZeRO-1 here; the recipe says why). The plan
    of that layout does not fit, and its OOM line says where the bytes go: the fp32 gradients of the rank's 3.19B
    parameters, and the activations, 569 MB per layer per micro-batch (Korthikanti et al.'s 34sbh/t for this shape
    is 570 MB) times 128 layer-micro-batches: 16 micro-batches of the 8 one-layer chunks a middle rank holds under
    Megatron's interleaved schedule at micro-batches = pp."""
    j = plan_json(REPO / "recipes" / "llama3-405b.yaml")
    assert (j["layout"]["recompute"], j["layout"]["zero"]) == ("none", 1)
    oom = next(w["message"] for w in j["warnings"] if w["code"] == "OOM")
    worst = j["memory"]["per_pp_rank"][j["memory"]["worst_pp_rank"]]
    per_layer = 34 * 8192 * 16384 / 8
    assert worst["activations"] == pytest.approx(128 * per_layer, rel=0.01)
    assert "128 layer-micro-batches' worth" in oom and "569 MB per layer per micro-batch" in oom
    assert f"activations {worst['activations'] / 1e9:.1f} GB" in oom and "3.2 GB reserve" in oom
    assert worst["gradients"] == 4 * worst["params"]  # whole, in fp32, until the step's reduce-scatter
    assert f"gradients {worst['gradients'] / 1e9:.1f} GB" in oom

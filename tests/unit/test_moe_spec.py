"""The `model.moe` section and `parallel.ep`: defaults, presets, the rules (each bad input exits 2 with one
clear line through `trainctl validate`), and `trainctl launch` accepting an MoE spec."""

from __future__ import annotations

import pytest
from cli_utils import trainctl
from paths import RECIPES

from trainctl.errors import SpecError
from trainctl.spec import load_spec

TINY_MOE = str(RECIPES / "tiny-moe-cpu.yaml")
TINY = str(RECIPES / "tiny-cpu.yaml")


def test_moe_defaults_and_absent_is_dense() -> None:
    assert load_spec(TINY).model.moe is None
    s = load_spec(TINY_MOE, overrides=["model.moe.expert_ffn_hidden=null", "model.moe.shared_ffn_hidden=null"])
    moe = s.model.moe
    assert moe is not None and moe.num_experts == 4 and moe.top_k == 2
    assert moe.expert_ffn_hidden == s.model.ffn_hidden  # default: the dense MLP's size
    assert moe.shared_ffn_hidden == moe.expert_ffn_hidden
    assert moe.capacity_factor is None  # dropless by default
    assert moe.router == "topk_softmax" and moe.z_loss_coeff is None


def test_an_override_keeps_the_presets_experts() -> None:
    s = load_spec(TINY_MOE, overrides=["model.moe.top_k=3"])
    assert s.model.moe is not None and (s.model.moe.num_experts, s.model.moe.top_k) == (4, 3)


def test_layer_pattern() -> None:
    s = load_spec(TINY_MOE, overrides=["model.layers=8", "model.moe.every=2", "model.moe.first_dense=2"])
    moe = s.model.moe
    assert moe is not None
    assert [i for i in range(8) if moe.is_moe_layer(i)] == [2, 4, 6]


def test_published_presets() -> None:
    mixtral = load_spec(RECIPES / "mixtral-8x7b.yaml").model
    assert mixtral.moe is not None and (mixtral.moe.num_experts, mixtral.moe.top_k) == (8, 2)
    assert mixtral.moe.router == "topk_softmax"
    olmoe = load_spec(RECIPES / "olmoe-1b-7b.yaml").model
    assert olmoe.moe is not None and (olmoe.moe.num_experts, olmoe.moe.top_k) == (64, 8)
    assert olmoe.moe.router == "softmax_topk" and olmoe.moe.z_loss_coeff == 0.001


@pytest.mark.parametrize(
    "spec, overrides, needle",
    [
        (TINY_MOE, ["model.moe.top_k=5"], "model.moe.top_k = 5"),
        (TINY_MOE, ["model.moe.top_k=0"], "model.moe.top_k = 0"),
        (TINY_MOE, ["model.moe.num_experts=0"], "an MoE block without experts"),
        (TINY_MOE, ["model.moe.num_experts=3", "model.moe.top_k=1", "parallel.ep=2"],
         "parallel.ep = 2: does not divide model.moe.num_experts = 3"),
        (TINY_MOE, ["parallel.ep=4"], "ep does not divide dp = 2"),
        (TINY_MOE, ["model.moe.capacity_factor=0"], "model.moe.capacity_factor = 0"),
        (TINY_MOE, ["model.moe.capacity_factor=-1.5"], "model.moe.capacity_factor = -1.5"),
        (TINY_MOE, ["model.moe.expert_ffn_hidden=97"], "model.moe.expert_ffn_hidden = 97"),
        (TINY_MOE, ["model.moe.first_dense=4"], "no layer of the 4 is an MoE layer"),
        (TINY, ["parallel.ep=2"], "expert parallelism needs a mixture-of-experts model"),
    ],
    ids=lambda x: x if isinstance(x, str) and not x.startswith("/") else "",
)
def test_bad_moe_input_exits_2_with_one_clear_line(spec: str, overrides: list[str], needle: str) -> None:
    out = trainctl("validate", spec, *[a for o in overrides for a in ("--set", o)])
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Fix:" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_rules_accept_every_ep_that_divides_experts_and_dp() -> None:
    for ep in (1, 2):
        assert load_spec(TINY_MOE, overrides=[f"parallel.ep={ep}"]).parallel.ep == ep
    with pytest.raises(SpecError):
        load_spec(TINY_MOE, overrides=["parallel.ep=3"])


def test_launch_takes_an_moe_spec(tmp_path) -> None:
    """The bundled trainer trains MoE (tests/dist/test_moe_launch.py runs it); launch has no refusal left."""
    out = trainctl("launch", TINY_MOE, "--run-dir", str(tmp_path / "run"), "--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "--nproc-per-node=4" in out.stdout and "trainctl.runtime" in out.stdout

"""Every recipe in recipes/ loads and validates, and holds the layout its header comment cites."""

from __future__ import annotations

from pathlib import Path

import pytest
from paths import RECIPES

from trainctl.errors import SpecError
from trainctl.hardware import resolve_accelerator
from trainctl.spec import load_spec, load_spec_text

RECIPE_FILES = sorted(RECIPES.glob("*.yaml"))


def test_the_agreed_recipes_exist() -> None:
    names = {p.stem for p in RECIPE_FILES}
    assert {"tiny-cpu", "gpt2-124m", "llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b-a100"} <= names


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.stem)
def test_recipe_validates(path: Path) -> None:
    spec = load_spec(path)
    assert spec.name == path.stem
    # A recipe says what it is and where its layout comes from before anything else.
    assert path.read_text().startswith("# ")


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.stem)
def test_recipe_tp_stays_inside_the_nvlink_domain(path: Path) -> None:
    spec = load_spec(path)
    assert spec.parallel.tp <= resolve_accelerator(spec.cluster).nvlink_domain


@pytest.mark.parametrize("path", [p for p in RECIPE_FILES if p.stem.startswith("llama3")], ids=lambda p: p.stem)
def test_llama_token_files_are_uint32(path: Path) -> None:
    spec = load_spec(path)
    assert spec.model.vocab == 128256 and spec.model.seq_len == (131072 if "long-context" in path.stem else 8192)
    assert spec.data.synthetic or spec.data.dtype == "uint32"


def test_llama3_405b_is_the_paper_layout() -> None:
    # Llama 3 paper (Dubey et al. 2024), Table 4: 16,384 GPUs, TP 8, PP 16, DP 128, batch/DP 16,
    # 16M tokens per step at seq 8192; Sec. 3.3.2: one layer fewer on the first and last stages.
    s = load_spec(RECIPES / "llama3-405b.yaml")
    assert (s.world_size, s.parallel.tp, s.parallel.pp, s.dp) == (16384, 8, 16, 128)
    assert s.parallel.micro_batch == 1 and s.parallel.sequence_parallel
    assert s.train.global_batch // s.dp == 16
    assert s.train.global_batch * s.model.seq_len == 2048 * 8192  # 16.8M tokens
    layers = s.parallel.stage_layers
    assert layers is not None and sum(layers) == s.model.layers == 126
    assert layers[0] < max(layers) and layers[-1] < max(layers)


def test_gpt3_175b_is_the_megatron_2021_layout() -> None:
    # Narayanan et al. 2021, Table 2 (PTD-P): model-parallel size 96 = TP 8 x PP 12, batch 1536, 1536 GPUs.
    s = load_spec(RECIPES / "gpt3-175b-a100.yaml")
    assert (s.world_size, s.parallel.tp, s.parallel.pp, s.dp) == (1536, 8, 12, 16)
    assert (s.model.layers, s.model.hidden, s.model.heads) == (96, 12288, 96)
    assert s.train.global_batch == 1536 and s.cluster.gpu == "a100-80gb"


# --- the data.dtype rule (trainctl/spec/rules.py) ------------------------------------------------

_LLAMA_TEXT = """
name: t
model: {preset: llama3-8b}
parallel: {tp: 8, dp: 1}
train: {global_batch: 8, steps: 10}
cluster: {nodes: 1, gpus_per_node: 8, gpu: h100-sxm}
"""


def test_uint16_token_file_with_large_vocab_is_an_error() -> None:
    with pytest.raises(SpecError, match=r"data\.dtype = 'uint16'.*128256.*Fix: set data\.dtype: uint32"):
        load_spec_text(_LLAMA_TEXT + "data: {path: /data/x.bin, dtype: uint16}\n")


def test_uint32_or_synthetic_is_fine_for_large_vocab() -> None:
    load_spec_text(_LLAMA_TEXT + "data: {path: /data/x.bin, dtype: uint32}\n")
    load_spec_text(_LLAMA_TEXT + "data: {synthetic: true}\n")


def test_vocab_65536_fits_uint16() -> None:
    # Token ids 0..65535 are exactly the uint16 range.
    load_spec_text(_LLAMA_TEXT.replace("{preset: llama3-8b}", "{preset: llama3-8b, vocab: 65536}")
                   + "data: {path: /data/x.bin, dtype: uint16}\n")

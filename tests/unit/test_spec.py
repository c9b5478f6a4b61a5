"""The run spec: loading, overrides, consistency rules and the error messages a user sees."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paths import REPO as ROOT
from spec_utils import one_problem, problems

from trainctl.errors import SpecError
from trainctl.spec import load_spec, load_spec_text, resolved_dict, validate_spec
from trainctl.spec.loader import apply_overrides

TINY = ROOT / "recipes" / "tiny-cpu.yaml"

BASE = """
name: t
model: {preset: llama3-8b}
parallel: {tp: 8, pp: 1, dp: auto}
train: {global_batch: 64, steps: 10}
cluster: {nodes: 4, gpus_per_node: 8, gpu: h100-sxm}
"""


def test_recipe_loads_and_resolves_auto_dp():
    spec = load_spec_text(BASE)
    assert spec.dp == 4
    assert spec.micro_batches == 16
    assert spec.model.kv_heads == 8 and spec.model.ffn_hidden == 14336
    frozen = resolved_dict(spec)
    assert frozen["parallel"]["dp"] == 4
    # The frozen form is itself a valid spec that resolves to the same thing.
    again = validate_spec(yaml.safe_load(yaml.safe_dump(frozen)))
    assert resolved_dict(again) == frozen and again.backend == "slurm"


def test_preset_fields_can_be_overridden():
    spec = load_spec_text(BASE, overrides=["model.layers=16", "model.seq_len=4096"])
    assert spec.model.layers == 16 and spec.model.seq_len == 4096 and spec.model.hidden == 4096


def test_overrides_parse_yaml_values_and_create_sections():
    data = apply_overrides({"a": {"b": 1}}, ["a.b=2", "a.c=true", "x.y=[1, 2]", "p=/d/x:y"])
    assert data == {"a": {"b": 2, "c": True}, "x": {"y": [1, 2]}, "p": "/d/x:y"}


@pytest.mark.parametrize("bad", ["parallel.tp", "=3", "a..b=1"])
def test_malformed_override_is_a_spec_error(bad):
    with pytest.raises(SpecError, match="KEY.PATH=VALUE"):
        load_spec_text(BASE, overrides=[bad])


def test_override_into_a_scalar_is_explained():
    msg = one_problem(BASE, "name.x=1")
    assert "name is a str, not a section" in msg


def test_unknown_key_names_the_field_and_suggests():
    msg = one_problem(BASE, "parallel.tpp=2")
    assert msg.startswith("s.yaml: parallel.tpp: unknown key") and "did you mean `tp`" in msg


def test_world_size_mismatch_names_field_value_and_fix():
    msg = one_problem(BASE, "parallel.dp=3")
    assert "parallel.dp = 3" in msg and "8*1*3 = 24" in msg and "32" in msg and "set parallel.dp to 4" in msg


def test_heads_not_divisible_by_tp():
    found = problems(BASE, "parallel.tp=16", "cluster.gpus_per_node=16", "cluster.nvlink_domain=16")
    assert any("model.kv_heads=8 is not divisible by tp" in p for p in found)


def test_ffn_not_divisible_by_tp():
    """The MLP's columns are split over tp: an ffn_hidden tp does not divide used to pass the rules."""
    msg = one_problem(BASE, "model.ffn_hidden=14002")
    assert "model.ffn_hidden = 14002" in msg and "divisible by 8, e.g. 14008" in msg


def test_global_batch_divisibility():
    msg = one_problem(BASE, "train.global_batch=66")
    assert "train.global_batch = 66" in msg and "micro_batch*dp = 1*4 = 4" in msg and "64 or 68" in msg


def test_pipeline_needs_enough_micro_batches():
    msg = one_problem(BASE, "parallel.pp=4", "parallel.tp=2", "train.global_batch=8")
    assert "2 micro-batches" in msg and "at least pp=4" in msg


def test_interleaved_rules():
    found = problems(BASE, "parallel.schedule=interleaved")
    assert any("virtual_stages" in p for p in found) and any("needs pipeline parallelism" in p for p in found)
    msg = one_problem(BASE, "parallel.schedule=interleaved", "parallel.pp=4", "parallel.tp=2",
                      "parallel.virtual_stages=2", "train.global_batch=24")
    assert "micro-batches (6) divisible by pp=4" in msg
    msg = one_problem(BASE, "parallel.virtual_stages=2")
    assert "only apply to the interleaved, zero-bubble and zbv schedules" in msg
    msg = one_problem(BASE, "parallel.schedule=zero-bubble", "parallel.pp=4", "parallel.tp=2",
                      "train.global_batch=24")
    assert "zero-bubble schedule needs micro-batches (6) divisible by pp=4" in msg


def test_zbv_rules():
    """ZBV: two stages per rank always (virtual_stages 2 by default, any other value refused), pipeline
    parallelism, any micro-batch count >= pp (torch pads its order; no rounds of pp as interleaved has)."""
    spec = load_spec_text(BASE, overrides=["parallel.schedule=zbv", "parallel.pp=4", "parallel.tp=2",
                                           "train.global_batch=24"])
    assert spec.parallel.virtual_stages == 2 and spec.micro_batches == 6  # 6 is not a multiple of pp = 4
    assert resolved_dict(spec)["parallel"]["virtual_stages"] == 2
    msg = one_problem(BASE, "parallel.schedule=zbv", "parallel.pp=4", "parallel.tp=2", "parallel.virtual_stages=3")
    assert "parallel.virtual_stages = 3" in msg and "exactly 2 stages on each pipeline rank" in msg
    assert "set virtual_stages: 2 or leave it out" in msg
    msg = one_problem(BASE, "parallel.schedule=zbv", "parallel.virtual_stages=1", "parallel.pp=4", "parallel.tp=2")
    assert "exactly 2 stages" in msg
    # one mistake, one message: the stage count that virtual_stages = 3 would make is not judged as well
    msg = one_problem(BASE, "parallel.schedule=zbv", "parallel.pp=16", "parallel.tp=1", "parallel.virtual_stages=3",
                      "train.global_batch=32")
    assert "exactly 2 stages" in msg
    found = problems(BASE, "parallel.schedule=zbv")
    assert any("the zbv schedule needs pipeline parallelism" in p and "set parallel.pp >= 2" in p for p in found)
    msg = one_problem(BASE, "parallel.schedule=zbv", "parallel.pp=32", "parallel.tp=1", "train.global_batch=32")
    assert "fewer layers than pipeline stages (64)" in msg and "schedule: 1f1b" in msg
    msg = one_problem(BASE, "parallel.schedule=zbv", "parallel.pp=4", "parallel.tp=2", "train.global_batch=8")
    assert "at least pp=4" in msg  # the pipeline's own floor still holds
    # FSDP is allowed: the trainer keeps the unsharded weights between forward and weight pass
    load_spec_text(BASE, overrides=["parallel.schedule=zbv", "parallel.pp=4", "parallel.tp=1", "parallel.zero=3"])


def test_explicit_stage_layers_must_add_up():
    msg = one_problem(BASE, "parallel.pp=4", "parallel.tp=2", "parallel.stage_layers=[7, 9, 9, 6]")
    assert "sums to 31 but model.layers = 32" in msg
    spec = load_spec_text(BASE, overrides=["parallel.pp=4", "parallel.tp=2", "parallel.stage_layers=[7,9,9,7]"])
    assert spec.parallel.stage_layers == [7, 9, 9, 7]


def test_unknown_gpu_lists_catalog():
    msg = one_problem(BASE, "cluster.gpu=h100")
    assert "cluster.gpu = 'h100': not in the hardware catalog" in msg and "h100-sxm" in msg


def test_custom_gpu_with_explicit_figures_is_accepted():
    spec = load_spec_text(BASE, overrides=["cluster.gpu=mychip", "cluster.peak_tflops=500", "cluster.memory_gb=96"])
    assert spec.cluster.gpu == "mychip"


def test_type_and_range_errors():
    assert "parallel.tp = -2" in one_problem(BASE, "parallel.tp=-2")
    assert "Fix: use a value >= 1" in one_problem(BASE, "parallel.tp=-2")
    msg = one_problem(BASE, "model.layers=1e400")
    assert "model.layers" in msg
    msg = one_problem(BASE, "model.layers=100000000000000000000000000000")
    assert "model.layers" in msg and "<= 1000000" in msg
    assert "train.precision" in one_problem(BASE, "train.precision=fp4")
    assert "train.lr" in one_problem(BASE, "train.lr=.nan")


def test_missing_sections_named():
    found = problems("name: x\nmodel: {preset: tiny}\n")
    assert found == ["s.yaml: train: required but missing. Fix: add `train:` to the top level section"]


def test_data_source_rule():
    assert "no data source" in one_problem(BASE, "data.synthetic=false")
    assert "not both" in one_problem(BASE + "data: {path: /x.bin, dtype: uint32, synthetic: true}\n")
    # on the command line a source replaces the spec's: the last one given is the run's
    with_path = BASE + "data: {path: /x.bin, dtype: uint32}\n"
    assert load_spec_text(with_path, overrides=["data.synthetic=true"]).data.synthetic
    assert load_spec_text(with_path, overrides=["data.synthetic=true"]).data.path is None
    assert load_spec_text(BASE, overrides=["data.path=/x.bin", "data.dtype=uint32"]).data.path == "/x.bin"
    assert load_spec_text(BASE, overrides=["data.path=/y.bin", "data.synthetic=false",
                                           "data.dtype=uint32"]).data.path == "/y.bin"
    assert load_spec_text(BASE, overrides=["data.path=/x.bin", "data.dtype=uint32"]).data.path == "/x.bin"
    assert "data.dtype = 'uint16'" in one_problem(BASE, "data.path=/x.bin")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", "the spec is empty"),
        ("   \n# only a comment\n", "the spec is empty"),
        ("- a\n- b\n", "the top level is a list"),
        ("name: [unclosed", "not valid YAML at line"),
        ("\tname: x", "not valid YAML"),
        ("42", "the top level is a int"),
    ],
)
def test_not_a_spec(text, expected):
    assert expected in one_problem(text)


def test_missing_file_directory_and_binary(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(SpecError, match="not UTF-8"):
        load_spec(binary)
    huge = tmp_path / "h.yaml"
    huge.write_text("x: 1\n" * 300_000)
    with pytest.raises(SpecError, match="the most a spec may be"):
        load_spec(huge)


def test_tiny_recipe_is_the_quickstart_layout():
    spec = load_spec(TINY)
    assert (spec.parallel.tp, spec.parallel.pp, spec.dp) == (2, 2, 2)
    assert spec.cluster.gpu == "cpu" and spec.launcher.backend == "local"


# --- property tests: whatever the input, the loader returns a RunSpec or raises SpecError ----------

yaml_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(string.printable, max_size=12),
)
yaml_values = st.recursive(
    yaml_scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.text(string.ascii_lowercase + "_", max_size=10), children,
                                               max_size=4)),
    max_leaves=20,
)
SECTION_KEYS = {
    "model": ["preset", "layers", "hidden", "heads", "kv_heads", "vocab", "seq_len", "activation"],
    "parallel": ["tp", "pp", "dp", "zero", "micro_batch", "schedule", "virtual_stages", "stage_layers"],
    "train": ["global_batch", "steps", "lr", "warmup", "precision", "recompute", "seed"],
    "cluster": ["nodes", "gpus_per_node", "gpu", "peak_tflops", "nvlink_domain", "time"],
}


@st.composite
def near_specs(draw):
    """Start from a valid spec and corrupt a few fields with arbitrary values."""
    data = yaml.safe_load(BASE)
    for _ in range(draw(st.integers(1, 4))):
        section = draw(st.sampled_from(sorted(SECTION_KEYS)))
        key = draw(st.sampled_from(SECTION_KEYS[section]))
        data.setdefault(section, {})[key] = draw(yaml_values)
    return data


def _loads_or_spec_error(text: str) -> None:
    try:
        load_spec_text(text, "p.yaml")
    except SpecError as e:
        assert e.problems and all(p.strip() for p in e.problems)
        assert all("Traceback" not in p for p in e.problems)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(near_specs())
def test_loader_never_crashes_on_corrupted_specs(data):
    _loads_or_spec_error(yaml.safe_dump(data))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_loader_never_crashes_on_arbitrary_text(text):
    _loads_or_spec_error(text)


@settings(max_examples=200, deadline=None)
@given(yaml_values)
def test_loader_never_crashes_on_arbitrary_yaml(value):
    _loads_or_spec_error(yaml.safe_dump(value))


def test_tp_beyond_nvlink_domain_is_an_error_unless_allowed():
    # H100 HGX: 8 GPUs per NVLink domain (one node). TP=16 would all-reduce over InfiniBand every layer.
    layout = ["parallel.tp=16", "model.heads=64", "model.kv_heads=16", "model.hidden=8192"]
    msg = one_problem(BASE, *layout)
    assert "parallel.tp = 16" in msg and "would not fit inside a node" in msg and "e.g. 8" in msg
    assert load_spec_text(BASE, overrides=[*layout, "parallel.allow_tp_across_nodes=true"]).parallel.tp == 16
    # An explicit multi-node NVLink domain (e.g. GB200 NVL72-style, 4 GPUs per node) admits TP=8 across nodes.
    nvl = ["cluster.gpus_per_node=4", "cluster.nodes=8", "cluster.nvlink_domain=32"]
    assert load_spec_text(BASE, overrides=nvl).parallel.tp == 8
    assert "would not fit inside a node (h100-sxm)" in one_problem(BASE, *nvl[:2])
    # A GPU without NVLink (L40S: PCIe only, a domain of 1): the message says so instead of naming a domain.
    msg = one_problem(BASE, "parallel.tp=2", "cluster.gpu=l40s")
    assert "l40s has no NVLink" in msg and "PCIe" in msg and "e.g. 1" in msg


def _alias_bomb(levels: int, fan: int = 9) -> str:
    """The "billion laughs" shape: each anchor is a list of `fan` aliases to the previous one."""
    lines = ["l0: &l0 [" + ", ".join(['"lol"'] * fan) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * fan) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    import tracemalloc

    text = _alias_bomb(9)  # ~400 bytes expanding to 9^9 = 387M values: minutes and gigabytes before
    assert len(text) < 600
    tracemalloc.start()
    try:
        with pytest.raises(SpecError, match="expands to more than 20,000 values"):
            load_spec_text(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # refused before anything is expanded (measured: 26 kB at the peak; the expansion would take gigabytes)
    assert peak < 1_000_000, peak
    with pytest.raises(SpecError, match="alias refers to itself"):
        load_spec_text("name: x\nmodel: &m {preset: tiny, extra: *m}\n")
    # aliases within the bound are ordinary YAML and still work
    text = TINY.read_text().replace("steps: 20", "steps: &steps 20").replace("every_steps: 10", "every_steps: *steps")
    assert load_spec_text(text).checkpoint.every_steps == 20


def test_echoed_keys_and_values_are_cut_to_a_readable_length() -> None:
    long_key = "k" * 100_000
    with pytest.raises(SpecError) as e:
        load_spec(TINY, overrides=[f"model.{long_key}=1"])
    text = str(e.value)
    assert len(text) < 600 and "(100006 characters)" in text
    with pytest.raises(SpecError) as e:
        load_spec(TINY, overrides=["x" * 5000])
    assert len(str(e.value)) < 300
    with pytest.raises(SpecError) as e:
        load_spec(TINY, overrides=["name=" + "n" * 5000 + "\x00"])
    assert all(len(line) < 400 for line in str(e.value).splitlines())

"""The Hugging Face mapping (trainctl/hf/format.py, runtime/model/hf_weights.py) in one process, against transformers'
own classes built from our config.json with random weights (no download): our model's weights written as
safetensors load into LlamaForCausalLM / GPT2LMHeadModel / MixtralForCausalLM and give our logits; weights
transformers saved load into our model (each TP rank's shard read as a slice) and give its logits; a
config.json that does not fit the spec is refused naming the field and both values.

Tolerance: fp32, 1e-5 absolute on logits of size ~1 (the RoPE tables are computed in different precisions:
ours in fp64 rounded to fp32, transformers' in fp32)."""

from __future__ import annotations

import json

import pytest
import torch

from trainctl.errors import SpecError, UsageError
from trainctl.hf import format as hf_format
from trainctl.hf import init_source
from trainctl.model_shape import ModelShape, MoEShape
from trainctl.runtime.model import hf_weights
from trainctl.runtime.model.transformer import build_stage
from trainctl.runtime.parallel.tensor_parallel import TPContext, shard_tensor
from trainctl.spec.loader import validate_spec

transformers = pytest.importorskip("transformers")

BASE = dict(layers=2, hidden=32, heads=4, vocab=255, seq_len=16)
LLAMA = dict(norm="rmsnorm", position="rope", activation="swiglu", kv_heads=2, ffn_hidden=48, rope_theta=5e5,
             norm_eps=1e-6)
GPT2 = dict(norm="layernorm", position="learned", activation="gelu", bias=True)
MODELS = {
    "llama": dict(**LLAMA, tied_embeddings=False),
    "llama-tied-bias": dict(**LLAMA, tied_embeddings=True, bias=True),
    "gpt2": dict(**GPT2, tied_embeddings=True),
    "gpt2-untied-nobias": dict(GPT2, bias=False, tied_embeddings=False),
    "mixtral": dict(**LLAMA, tied_embeddings=False, moe=MoEShape(num_experts=4, top_k=2, expert_ffn_hidden=24)),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def ours(shape: ModelShape, seed: int = 3) -> torch.nn.Module:
    return build_stage(shape, range(shape.layers), first=True, last=True, seed=seed).eval()


def ids(shape: ModelShape) -> torch.Tensor:
    return torch.randint(0, shape.vocab, (2, shape.seq_len), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_exported_weights_give_our_logits_in_transformers(name, tmp_path):
    shape = ModelShape(**BASE, **MODELS[name])
    model = ours(shape)
    full = {n: p.detach() for n, p in model.named_parameters()}
    files = hf_weights.write_hf(tmp_path, hf_weights.to_hf(hf_format.layout(shape), full), hf_format.config(shape))
    assert files == [hf_format.WEIGHTS, hf_format.CONFIG]
    _, back = hf_format.config_shape(json.loads((tmp_path / hf_format.CONFIG).read_text()))
    assert back["bias"] == shape.bias  # a GPT-2 export of a bias-free model (zero biases) reads back bias-free
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == hf_format.layout(shape).architecture
    x = ids(shape)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["llama", "gpt2", "mixtral"])
def test_transformers_weights_load_into_our_shards(name, tmp_path):
    """save_pretrained's files (sharded, with its index) read into our model give transformers' logits; at tp 2
    each rank's slices are exactly its shard of the whole (fused q/k/v and gate/up parts, the vocabulary padded
    from 255 to 256)."""
    shape = ModelShape(**BASE, **MODELS[name])
    cfg = transformers.AutoConfig.for_model(**hf_format.config(shape))
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / hf_format.INDEX).is_file()
    model = ours(shape, seed=9)
    source = init_source.InitSource("hf", tmp_path, family=hf_format.family(shape))
    assert hf_weights.load_init([model], source, shape, TPContext.single()) == len(list(model.parameters()))
    x = ids(shape)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=0)
    lay, metas = hf_format.layout(shape), hf_weights.param_metas(shape)
    reader = hf_weights.SafetensorsReader(tmp_path)
    for n, p in model.named_parameters():
        spec = metas[n].shard.for_tp(2) if metas[n].shard is not None else None
        for r in range(2):
            want = shard_tensor(p.detach(), spec, r, 2) if spec is not None else p.detach()
            assert torch.equal(hf_weights.hf_shard(reader, lay.pieces[n], metas[n], tp_rank=r, tp_size=2), want), (n, r)
    reader.close()


def _spec(init_from: str, **model) -> object:
    return validate_spec({"name": "t", "model": {**BASE, **LLAMA, "tied_embeddings": False, **model,
                                                 "init_from": init_from},
                          "train": {"global_batch": 2, "steps": 1}, "cluster": {"gpus_per_node": 1, "gpu": "cpu"}})


def test_init_from_checks_the_config_against_the_spec(tmp_path):
    shape = ModelShape(**BASE, **MODELS["llama"])
    (tmp_path / hf_format.CONFIG).write_text(json.dumps(hf_format.config(shape)))
    with pytest.raises(SpecError, match="safetensors"):
        init_source.check(_spec(str(tmp_path)))
    (tmp_path / hf_format.WEIGHTS).write_bytes(b"")
    assert init_source.check(_spec(str(tmp_path))).family == "llama"
    with pytest.raises(SpecError) as e:
        init_source.check(_spec(str(tmp_path), hidden=64, kv_heads=4))
    assert "model.hidden = 64, source 32" in str(e.value) and "model.kv_heads = 4, source 2" in str(e.value)
    with pytest.raises(SpecError, match=r"model.norm = 'layernorm', source 'rmsnorm'"):
        init_source.check(_spec(str(tmp_path), norm="layernorm"))
    with pytest.raises(SpecError, match="no such file"):
        init_source.check(_spec(str(tmp_path / "missing")))


def test_models_without_a_transformers_class_are_refused():
    with pytest.raises(UsageError, match="MoE model is not supported yet"):
        hf_format.family(ModelShape(**BASE, **{**MODELS["mixtral"], "moe": MoEShape(4, 2, 24, shared_experts=1)}))
    with pytest.raises(UsageError, match="matches no Hugging Face class"):
        hf_format.family(ModelShape(**BASE, norm="layernorm", position="rope"))

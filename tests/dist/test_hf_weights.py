"""The Hugging Face round trip, for a Llama and a GPT-2 model, from one TP2 x PP2 run's checkpoint each
(4 real ranks, 2 steps, vocabulary 255 padded to 256 over TP, GQA for Llama, tied embeddings for GPT-2):

- `trainctl export RUN --format hf OUT` loads in transformers (AutoModelForCausalLM.from_pretrained) and gives
  the logits of the trainer's model holding the weights the ranks ended with (fp32: 1e-5 absolute);
- a run with `model.init_from: OUT` in another layout (Llama: DP2 ZeRO-1, GPT-2: DP2 ZeRO-3) starts at the
  loss transformers computes on the same batch (1e-5 relative), and its resume restores its own checkpoint
  instead of the source;
- `model.init_from: RUN` (a trainctl run) gives each rank the run's weights, resharded;
- export's usage errors, and a launch whose init_from does not fit its model: one line, exit 2, no traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from cli_utils import trainctl
from resume_utils import events, ok, set_spec, stop_after
from trainer_utils import final_weights, make_run, metrics, run_trainer

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

MODEL = {"layers": 4, "hidden": 64, "heads": 4, "vocab": 255, "seq_len": 32}
FAMILIES = {
    "llama": {**MODEL, "norm": "rmsnorm", "position": "rope", "activation": "swiglu", "kv_heads": 2,
              "ffn_hidden": 96, "tied_embeddings": False},
    "gpt2": {**MODEL, "norm": "layernorm", "position": "learned", "activation": "gelu", "bias": True,
             "tied_embeddings": True},
}
INIT_LAYOUT = {"llama": {"tp": 1, "pp": 1, "dp": 2, "zero": 1}, "gpt2": {"tp": 1, "pp": 1, "dp": 2, "zero": 3}}
TRAIN = {"global_batch": 4, "steps": 2}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def exported(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(family, the TP2 x PP2 run, its export)."""
    fam = request.param
    root = tmp_path_factory.mktemp(fam)
    run, world = make_run(root, "tp2pp2", model=FAMILIES[fam], train=TRAIN,
                          parallel={"tp": 2, "pp": 2, "dp": 1, "micro_batch": 1}, checkpoint={"every_steps": 2})
    ok(run_trainer(run, world))
    out = root / "hf"
    r = trainctl("export", str(run), "--format", "hf", str(out))
    ok(r, "export")
    assert f"exported step 2 of {run}" in r.stdout
    return fam, run, out


def our_model(fam: str, weights: dict[str, Any]):
    """The trainer's model in one process holding `weights`."""
    import torch

    from trainctl.model_shape import ModelShape
    from trainctl.runtime.model.transformer import build_stage

    shape = ModelShape(**FAMILIES[fam])
    model = build_stage(shape, range(shape.layers), first=True, last=True, seed=0).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    return model


def first_batch(run: Path):
    """The global batch of the run's first step, [global_batch, seq_len] inputs and targets."""
    from trainctl.runtime.train.loader import build_loader
    from trainctl.spec import load_spec

    spec = load_spec(run / "spec.yaml")
    x, y = build_loader(spec, 0, 1, spec.train.seed).batch_at(0)
    return x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])


def test_export_gives_the_trainers_logits_in_transformers(exported) -> None:
    import torch

    fam, run, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 255 and config["architectures"] == [{"llama": "LlamaForCausalLM",
                                                                       "gpt2": "GPT2LMHeadModel"}[fam]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.get_input_embeddings().weight.shape == (255, 64)  # the TP padding row is cut
    x, _ = first_batch(run)
    with torch.no_grad():
        ours = our_model(fam, final_weights(run))(x)
        torch.testing.assert_close(hf(x).logits, ours, atol=1e-5, rtol=0)


def test_init_from_the_export_starts_at_transformers_loss(exported) -> None:
    """Another layout, initialised from the export: the first step's loss (before any update) is transformers'
    loss on the same batch. Stopped after step 1 and resumed with the source gone: the resume restores the run's
    own checkpoint."""
    import torch
    import torch.nn.functional as F

    fam, run, out = exported
    init, world = make_run(run.parent, "init", model={**FAMILIES[fam], "init_from": str(out)}, train=TRAIN,
                           parallel=INIT_LAYOUT[fam], checkpoint={"every_steps": 1})
    ok(run_trainer(init, world, env=stop_after(1), dump=False))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x, y = first_batch(init)
    with torch.no_grad():
        logits = hf(x).logits
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    assert metrics(init)[0]["step"] == 1
    assert abs(metrics(init)[0]["loss"] - want) <= 1e-5 * want
    set_spec(init, model={"init_from": str(out.with_name("gone"))})  # a resume never reads the source
    ok(run_trainer(init, world, dump=False))
    kinds = [e["event"] for e in events(init)]
    assert kinds.count("init_from") == 1 and kinds.count("resume_from") == 1
    assert [m["step"] for m in metrics(init)] == [1, 2]


def test_init_from_a_run_reshards_its_checkpoint(exported) -> None:
    """model.init_from: RUN (a trainctl run of tp 2) read into tp 1 in one process: the run's final weights."""
    import torch

    from trainctl.checkpoint import step_dirname
    from trainctl.hf import init_source
    from trainctl.model_shape import ModelShape
    from trainctl.runtime.model.hf_weights import load_init
    from trainctl.runtime.parallel.tensor_parallel import TPContext
    from trainctl.spec.loader import validate_spec

    fam, run, _out = exported
    spec = validate_spec({"name": "t", "model": {**FAMILIES[fam], "init_from": str(run)}, "train": TRAIN,
                          "cluster": {"gpus_per_node": 1, "gpu": "cpu"}})
    source = init_source.check(spec)
    assert source.kind == "checkpoint" and source.path.name == step_dirname(2)
    model = our_model(fam, {n: torch.zeros(()) for n in final_weights(run)})
    load_init([model], source, ModelShape(**FAMILIES[fam]), TPContext.single())
    want = final_weights(run)
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name


@pytest.mark.parametrize("exported", ["llama"], indirect=True)  # one family's run is enough
def test_usage_errors(exported, tmp_path: Path) -> None:
    """export's, and launch's with an init_from that does not fit the spec: one line, exit 2, no traceback."""
    from trainctl.checkpoint import step_dirname

    _fam, run, out = exported
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "spec.yaml").write_text((run / "spec.yaml").read_text())
    corrupt = tmp_path / "corrupt"
    shutil.copytree(run / "checkpoints", corrupt / "checkpoints")
    (corrupt / "spec.yaml").write_text((run / "spec.yaml").read_text())
    shard = next((corrupt / "checkpoints" / step_dirname(2)).glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8] + b"corrupt!")
    cases = {
        (str(tmp_path / "nope"), "hf", "new"): "no such run directory",
        (str(run), "onnx", "new"): "--format onnx: unsupported export format",
        (str(run), "hf", str(out)): "exists and is not an empty directory",
        (str(empty), "hf", "new"): "no checkpoint to export",
        (str(corrupt), "hf", "new"): "no valid checkpoint (newest, step 2: ",
    }
    for (r, fmt, dest), message in cases.items():
        dest = dest if dest != "new" else str(tmp_path / "out")
        p = trainctl("export", r, "--format", fmt, dest)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, (message, p.stderr)
    p = trainctl("export", str(run), "--step", "7", "--format", "hf", str(tmp_path / "out"))
    assert p.returncode == 2 and "no checkpoint for step 7" in p.stderr and "valid steps: [2]" in p.stderr, p.stderr
    assert not (tmp_path / "out").exists()
    p = trainctl("launch", str(run / "spec.yaml"), "--run-dir", str(tmp_path / "launched"), "--set",
                 f"model.init_from={out}", "--set", "model.hidden=128")
    assert p.returncode == 2 and "model.hidden = 128, source 64" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "launched").exists()

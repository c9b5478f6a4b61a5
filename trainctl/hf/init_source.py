"""What `model.init_from` points at, checked against the spec's model before a run starts. No torch.

Three kinds of source: a Hugging Face directory (config.json + model.safetensors or a sharded
model.safetensors.index.json), a trainctl run directory (its newest valid checkpoint), or one committed
checkpoint directory (step-<N>). `launch`/`resume` call `check` beside the data check (exit 2, one line per
problem naming the field and both values); the trainer resolves the same source again before it loads it
(runtime/model/hf_weights.py). Both pass over it when the run has a checkpoint of its own, which it resumes from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainctl.checkpoint import CheckpointError, inspect_checkpoint, latest_valid, resolve_checkpoint_dir
from trainctl.checkpoint.format import MANIFEST, CheckpointInfo
from trainctl.errors import SpecError, UsageError
from trainctl.hf import format as hf_format
from trainctl.rundir.paths import RunPaths
from trainctl.spec.models import ModelSpec, RunSpec

FIELD = "model.init_from"
# the spec's model fields that fix the weights' shapes (norm_eps, rope_theta, dropout may differ: a run may
# start from weights and change them, as a long-context extension changes rope_theta)
SHAPE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "activation", "norm", "position",
                "bias", "tied_embeddings")
MOE_SHAPE_FIELDS = ("num_experts", "expert_ffn_hidden", "shared_experts", "shared_ffn_hidden", "every",
                    "first_dense")


@dataclass(frozen=True)
class InitSource:
    """A resolved `model.init_from`: `kind` "hf" (path: the directory) or "checkpoint" (path: step-<N>)."""

    kind: str
    path: Path
    family: str | None = None  # hf: llama, mixtral or gpt2
    checkpoint: CheckpointInfo | None = None


def _fail(value: str, what: str, fix: str) -> SpecError:
    return SpecError([f"{FIELD} = {value!r}: {what}. Fix: {fix}"])


def read_config(directory: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((directory / hf_format.CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"{directory / hf_format.CONFIG}: unreadable ({e})") from e
    if not isinstance(cfg, dict):
        raise UsageError(f"{directory / hf_format.CONFIG}: not a JSON object")
    return cfg


def resolve(value: str) -> InitSource:
    """The source `value` names; SpecError when it is none of the three kinds."""
    p = Path(value)
    if not p.exists():
        raise _fail(value, "no such file or directory", "give a Hugging Face model directory, a run directory or "
                    "a checkpoint directory")
    if (p / hf_format.CONFIG).is_file():
        if not ((p / hf_format.WEIGHTS).is_file() or (p / hf_format.INDEX).is_file()):
            raise _fail(value, f"has {hf_format.CONFIG} but neither {hf_format.WEIGHTS} nor {hf_format.INDEX}",
                        "save the model with safetensors (transformers' save_pretrained does by default)")
        return InitSource("hf", p)
    if (p / MANIFEST).is_file():
        info = inspect_checkpoint(p)
        if not info.valid:
            raise _fail(value, f"checkpoint is invalid: {info.reason}", "pick another checkpoint of that run")
        return InitSource("checkpoint", p, checkpoint=info)
    paths = RunPaths(p)
    if paths.spec.is_file() or paths.checkpoints.is_dir():
        ckpt_dir = resolve_checkpoint_dir(p)
        info = latest_valid(ckpt_dir)
        if info is None:
            raise _fail(value, f"run has no valid checkpoint in {ckpt_dir}", "give a run with a committed "
                        "checkpoint, or one checkpoint directory (step-<N>)")
        return InitSource("checkpoint", info.path, checkpoint=info)
    raise _fail(value, f"neither a Hugging Face directory ({hf_format.CONFIG} + safetensors) nor a trainctl run "
                "or checkpoint directory", "point it at one of those")


def _shape_of(m: ModelSpec) -> dict[str, Any]:
    d = m.model_dump(mode="json")
    out = {k: d[k] for k in SHAPE_FIELDS}
    if d.get("moe") is not None:
        out["moe"] = {k: d["moe"][k] for k in MOE_SHAPE_FIELDS}
    return out


def differences(spec_model: ModelSpec, source: dict[str, Any], seq_rows: int | None) -> list[str]:
    """'model.hidden = 64, source 128' for every shape field of the spec that differs from the source's."""
    ours = _shape_of(spec_model)
    out = []
    for k, theirs in source.items():
        mine = ours.get(k)
        if k == "moe" and isinstance(theirs, dict) and isinstance(mine, dict):
            out += [f"model.moe.{x} = {mine.get(x)!r}, source {v!r}" for x, v in theirs.items()
                    if x in mine and mine[x] != v]
        elif mine != theirs:
            out.append(f"model.{k} = {mine!r}, source {theirs!r}")
    if "moe" in ours and "moe" not in source:
        out.append("model.moe is set, the source is a dense model")
    if seq_rows is not None and spec_model.position == "learned" and spec_model.seq_len > seq_rows:
        out.append(f"model.seq_len = {spec_model.seq_len}, source has {seq_rows} learned positions")
    return out


def has_own_checkpoint(spec: RunSpec, run_dir: Path) -> bool:
    """The run in `run_dir` has a valid checkpoint, which it resumes from: init_from is not read."""
    return latest_valid(resolve_checkpoint_dir(run_dir, spec)) is not None


def check(spec: RunSpec, run_dir: Path | None = None) -> InitSource | None:
    """The spec's init_from source, resolved and checked against its model (SpecError: exit 2); None without one,
    or when the run in `run_dir` has a checkpoint of its own (a resume needs no source)."""
    value = spec.model.init_from
    if not value or (run_dir is not None and has_own_checkpoint(spec, run_dir)):
        return None
    src = resolve(value)
    if src.kind == "hf":
        cfg = read_config(src.path)
        fam, shape = hf_format.config_shape(cfg)
        diffs = differences(spec.model, shape, hf_format.positions_rows(cfg))
        src = InitSource("hf", src.path, family=fam)
    else:
        assert src.checkpoint is not None
        saved = (src.checkpoint.meta or {}).get("model")
        if not saved:
            raise _fail(value, "checkpoint was not written by the trainctl trainer (no model in its manifest)",
                        "give a trainctl checkpoint or a Hugging Face directory")
        try:
            theirs = ModelSpec.model_validate(saved)
        except ValueError as e:
            raise CheckpointError(f"{src.path}: unreadable model record in {MANIFEST}: {e}") from e
        diffs = differences(spec.model, _shape_of(theirs), theirs.seq_len)
    if diffs:
        raise SpecError([f"{FIELD} = {value!r} does not match the spec's model: {d}. Fix: set the spec's model to "
                         "the source's shape, or start from another source" for d in diffs])
    return src

"""Weights in and out: a checkpoint gathered into full tensors and written in Hugging Face's format
(`trainctl export --format hf`), and `model.init_from` read into this rank's shards.

The name mapping is trainctl/hf/format.py's (torch-free); the source checks are trainctl/hf/init_source.py's.

- Gathering a checkpoint needs no process group: DCP keys are global parameter names (+ `@tp<r>of<t>` for a
  TP shard, runtime/checkpoint/state.py), so one process loads every key at its saved TP-local shape with
  `dcp.load(no_dist=True)` (DCP assembles the ZeRO-1/2 ranges, FSDP2 row shards, pipeline stages and expert
  ranks) and rebuilds each TP-sharded tensor with the model's own ShardSpec, which also cuts the padded
  vocabulary back to the real one.
- Reading Hugging Face weights, each rank reads only its shard: safetensors' slices give the rows (and
  columns) of this TP rank's part of each tensor, for the parameters of its own stages and experts.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from trainctl.checkpoint import CheckpointError
from trainctl.errors import UsageError
from trainctl.fileio import default_mode
from trainctl.hf import format as hf_format
from trainctl.hf.format import HFLayout, Piece
from trainctl.hf.init_source import InitSource
from trainctl.model_shape import ModelShape
from trainctl.runtime.checkpoint.state import parse_param_key
from trainctl.runtime.parallel.tensor_parallel import ParamMeta, TPContext, shard_tensor, unshard_tensors

MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size for save_pretrained


def _need_safetensors() -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError as e:
        raise UsageError("Hugging Face weights need the safetensors package",
                         hint="pip install 'trainctl[hf]' (or pip install safetensors)") from e


def param_metas(shape: ModelShape) -> dict[str, ParamMeta]:
    """Every parameter of the whole model (all stages, all experts) by global name, built on the meta device."""
    from trainctl.runtime.model.transformer import StageModule

    with torch.device("meta"):
        stage = StageModule(shape, range(shape.layers), first=True, last=True)
    return stage.named_param_meta()


# --- out: a checkpoint in Hugging Face's format ---------------------------------------------------------


def gather_checkpoint(path: Path, metas: dict[str, ParamMeta], names: Iterable[str] | None = None
                      ) -> dict[str, Tensor]:
    """Full (logical, unpadded) fp32 tensors of the parameters `names` (default: all) from the committed
    checkpoint at `path`, whatever layout wrote it. One process, no process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved: dict[str, list[tuple[int, int, str]]] = {}  # name -> [(tp rank, tp, key)]
    for key, item in md.items():
        if not key.startswith("model.") or not isinstance(item, TensorStorageMetadata):
            continue
        name, r, t = parse_param_key(key[len("model."):])
        saved.setdefault(name, []).append((r, t, key[len("model."):]))
    wanted = list(metas if names is None else names)
    missing = [n for n in wanted if n not in saved]
    if missing:
        raise CheckpointError(f"{path}: the checkpoint has no weights for {', '.join(missing[:3])}"
                              + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""))
    state = {key: torch.empty(tuple(md[f"model.{key}"].size), dtype=torch.float32)
             for n in wanted for _r, _t, key in saved[n]}
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load({"model": state}, storage_reader=FileSystemReader(str(path)), no_dist=True)
    out = {}
    for n in wanted:
        shards = sorted(saved[n])
        spec = metas[n].shard.for_tp(shards[0][1]) if metas[n].shard is not None and shards[0][1] > 1 else None
        out[n] = unshard_tensors([state[key] for _r, _t, key in shards], spec)
    return out


def to_hf(lay: HFLayout, full: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers' state dict of the model whose full tensors are `full` (tensors nothing maps to, GPT-2's
    biases of a model without them, stay zero)."""
    unmapped = sorted(set(full) - set(lay.pieces))
    if unmapped:
        raise UsageError(f"no Hugging Face name for {', '.join(unmapped[:3])}")
    out = {key: torch.zeros(shape, dtype=torch.float32) for key, shape in lay.shapes.items()}
    for name, pieces in lay.pieces.items():
        row = 0
        for p in pieces:
            _view(out[p.key], p)[p.start:p.start + p.length] = full[name][row:row + p.length]
            row += p.length
    return out


def _view(t: Tensor, p: Piece) -> Tensor:
    """The tensor whose rows a piece takes (a view: writes reach `t`): transposed for GPT-2's Conv1D."""
    return t.t() if p.transposed and t.dim() == 2 else t


def write_hf(out: Path, tensors: dict[str, Tensor], config: dict[str, Any],
             max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """config.json and safetensors (one file, or shards with transformers' index past `max_shard_bytes`) into
    the directory `out`; the files written."""
    _need_safetensors()
    from safetensors.torch import save_file

    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    names = ([hf_format.WEIGHTS] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(out / name), metadata={"format": "pt"})
        os.chmod(out / name, default_mode())  # safetensors creates 0600; others read exported models
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards, strict=True) for k in shard}}
        (out / hf_format.INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        names.append(hf_format.INDEX)
    (out / hf_format.CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return [*names, hf_format.CONFIG]


def export_hf(checkpoint: Path, shape: ModelShape, out: Path, max_shard_bytes: int = MAX_SHARD_BYTES
              ) -> list[str]:
    """The checkpoint at `checkpoint` (of a model of `shape`) as a transformers model in the new or empty
    directory `out`, written beside it first and renamed into place; the files written."""
    lay = hf_format.layout(shape)  # UsageError for a model no transformers class matches
    _need_safetensors()
    full = gather_checkpoint(checkpoint, param_metas(shape))
    tensors = to_hf(lay, full)
    out = out.absolute()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        files = write_hf(tmp, tensors, hf_format.config(shape), max_shard_bytes)
        if out.exists():
            out.rmdir()  # checked empty by the caller
        os.replace(tmp, out)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files


# --- in: model.init_from into this rank's shards -------------------------------------------------------


class SafetensorsReader:
    """transformers' tensors in a directory (one file or an index of shards), read by slices."""

    def __init__(self, directory: Path) -> None:
        _need_safetensors()
        from safetensors import safe_open

        self.dir = directory
        index = directory / hf_format.INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        else:
            with safe_open(str(directory / hf_format.WEIGHTS), "pt") as f:
                weight_map = {k: hf_format.WEIGHTS for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
        self.files = weight_map
        self._open: dict[str, Any] = {}
        self._safe_open = safe_open

    def _key(self, key: str) -> str:
        if key in self.files:
            return key
        for prefix in hf_format.PREFIXES:  # an old GPT-2 file: "h.0.attn..." for "transformer.h.0.attn..."
            if key.startswith(prefix) and key[len(prefix):] in self.files:
                return key[len(prefix):]
        raise UsageError(f"{self.dir}: no tensor {key} in its safetensors",
                         hint="the directory's weights do not match its config.json")

    def slice(self, key: str) -> Any:
        key = self._key(key)
        name = self.files[key]
        if name not in self._open:
            self._open[name] = self._safe_open(str(self.dir / name), "pt").__enter__()
        return self._open[name].get_slice(key)

    def close(self) -> None:
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()


def _piece_block(reader: SafetensorsReader, p: Piece, rows: tuple[int, int], cols: tuple[int, int] | None
                 ) -> Tensor:
    """Rows [rows) (of the piece's own rows) and columns [cols) (None: all) of one piece, read as a slice."""
    sl = reader.slice(p.key)
    r = slice(p.start + rows[0], p.start + rows[1])
    if len(sl.get_shape()) == 1:
        return sl[r]
    c = slice(*cols) if cols is not None else slice(None)
    if p.transposed:  # GPT-2's Conv1D: our rows are its columns
        return sl[c, r].t()
    return sl[r, c]


def _read_rows(reader: SafetensorsReader, pieces: list[Piece], lo: int, hi: int,
               cols: tuple[int, int] | None, like: tuple[int, ...]) -> Tensor:
    """Our rows [lo, hi) of the tensor made of `pieces` (rows past them: zeros, the padded vocabulary)."""
    blocks, row = [], 0
    for p in pieces:
        a, b = max(lo, row), min(hi, row + p.length)
        if a < b:
            blocks.append(_piece_block(reader, p, (a - row, b - row), cols).to(torch.float32))
        row += p.length
    have = sum(x.shape[0] for x in blocks)
    if have < hi - lo:
        width = list(like[1:]) if cols is None else [cols[1] - cols[0]]
        blocks.append(torch.zeros([hi - lo - have, *width]))
    return torch.cat(blocks) if len(blocks) > 1 else blocks[0]


def hf_shard(reader: SafetensorsReader, pieces: list[Piece], meta: ParamMeta, tp_rank: int, tp_size: int) -> Tensor:
    """This TP rank's shard of one parameter (ShardSpec: each part split evenly, padded rows zero)."""
    rows = meta.full_shape[0]
    spec = meta.shard.for_tp(tp_size) if meta.shard is not None else None
    if spec is None or tp_size == 1:
        full = _read_rows(reader, pieces, 0, rows, None, meta.full_shape)
        return shard_tensor(full, spec, rank=tp_rank, size=tp_size) if spec is not None else full
    ranges, offset = [], 0
    for part in spec.parts:
        n = part // tp_size
        ranges.append((offset + tp_rank * n, offset + (tp_rank + 1) * n))
        offset += part
    if spec.dim == 0:
        return torch.cat([_read_rows(reader, pieces, a, b, None, meta.full_shape) for a, b in ranges])
    return torch.cat([_read_rows(reader, pieces, 0, rows, (a, b), meta.full_shape) for a, b in ranges], dim=1)


@torch.no_grad()
def load_init(modules: list[nn.Module], source: InitSource, shape: ModelShape, tp: TPContext) -> int:
    """Copy `source` (checked by init_source.check) into this rank's parameters, before any ZeRO/FSDP wrapping
    (which then starts from them); the number of parameters written."""
    wanted = [(name, p, m.named_param_meta()[name]) for m in modules for name, p in m.named_parameters()]
    if source.kind == "hf":
        lay = hf_format.layout(shape)
        reader = SafetensorsReader(source.path)
        try:
            values = {name: hf_shard(reader, lay.pieces[name], meta, tp_rank=tp.rank, tp_size=tp.size)
                      for name, _p, meta in wanted}
        finally:
            reader.close()
    else:
        metas = {name: meta for name, _p, meta in wanted}
        full = gather_checkpoint(source.path, metas)
        values = {name: shard_tensor(full[name].narrow(0, 0, meta.full_shape[0]), meta.shard.for_tp(tp.size)
                                     if meta.shard is not None else None, tp.rank, tp.size)
                  for name, meta in metas.items()}
    for name, p, _meta in wanted:
        v = values[name]
        if tuple(v.shape) != tuple(p.shape):
            raise UsageError(f"model.init_from {source.path}: {name} has shape {tuple(v.shape)} here, the model "
                             f"needs {tuple(p.shape)}")
        p.copy_(v)
    return len(wanted)

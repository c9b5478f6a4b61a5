"""Deterministic parameter initialisation that does not depend on the parallel layout.

Every parameter's FULL (unsharded, unpadded) tensor is generated from a generator seeded by
(run seed, global parameter name), then this rank's tensor-parallel shard is sliced out of it. So a parameter
has the same values whatever the TP size, the pipeline split (layers are named by their global index) or the
dtype (values are drawn in fp32, then cast): one process and any 3-D layout start from the same model, which is
what every equivalence test and every cross-layout checkpoint relies on.

Rules (GPT-2 / Megatron): matmul weights and embeddings ~ N(0, 0.02); the output projections of attention and
MLP ~ N(0, 0.02 / sqrt(2 * layers)); norm weights 1; biases 0; padded vocab rows 0 (they are masked anyway).

TODO(scale): generating each full tensor on every TP rank costs O(full size) time and host memory per rank,
fine for the models we test on but wasteful for, say, a 128k x 8k embedding at tp=8. For large models build on
the meta device and generate only this rank's shard (e.g. a counter-based generator addressed by element index,
or generate the full tensor chunk by chunk and keep the slice).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from trainctl.runtime.parallel.tensor_parallel import ParamMeta, TPContext, shard_tensor


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run seed and a parameter's global name (stable across Python runs)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_tensor(meta: ParamMeta, seed: int, name: str) -> torch.Tensor:
    """The full logical tensor of one parameter, fp32 on the CPU."""
    if meta.init == "ones":
        return torch.ones(meta.full_shape)
    if meta.init == "zeros":
        return torch.zeros(meta.full_shape)
    if meta.init == "normal":
        g = torch.Generator(device="cpu")
        g.manual_seed(param_seed(seed, name))
        return torch.randn(meta.full_shape, generator=g, dtype=torch.float32) * meta.std
    raise ValueError(f"unknown init {meta.init!r} for {name}")


def iter_param_meta(module: nn.Module):
    """(global name, parameter, ParamMeta) for every parameter of a module that declares `param_meta`."""
    seen: set[int] = set()
    for mod_name, m in module.named_modules():
        metas: dict[str, ParamMeta] = getattr(m, "param_meta", None) or {}
        for pname, meta in metas.items():
            p = getattr(m, pname, None)
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            yield (f"{mod_name}.{pname}" if mod_name else pname), p, meta


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, tp: TPContext) -> None:
    """Initialise every parameter of `module` from its full tensor (see the module docstring).

    Raises if a parameter has no ParamMeta: nothing may be left to torch's layout-dependent default init."""
    covered = set()
    for name, p, meta in iter_param_meta(module):
        full = full_tensor(meta, seed, name)
        shard = shard_tensor(full, meta.shard, tp.rank, tp.size)
        if tuple(shard.shape) != tuple(p.shape):
            raise RuntimeError(f"{name}: shard shape {tuple(shard.shape)} != parameter shape {tuple(p.shape)}")
        p.copy_(shard.to(dtype=p.dtype, device=p.device))
        covered.add(id(p))
    missing = [n for n, p in module.named_parameters() if id(p) not in covered]
    if missing:
        raise RuntimeError(f"parameters without init metadata: {missing}")

"""What a rank really holds: exact bytes of weights, gradients and optimizer state, and the peak bytes of
activations saved for backward. These are the figures the planner's memory model is held against
(docs/design/memory.md, "Memory model").

- Model states are counted tensor by tensor, each storage once (a view into a flat bucket is not counted
  twice): parameters (local shards under FSDP), gradient buffers (DP buckets, ZeRO shards, low-precision
  reduction copies), optimizer state (moments, fp32 master slices).
- Activations: on the CPU, `torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd saves for
  backward; a storage counts from its first save until the last reference the graph keeps is dropped
  (after its backward), so the peak over a step is the activation memory of the schedule actually run,
  pipeline micro-batches in flight included. Recomputed regions save only their inputs, as on a GPU. On a
  GPU the CUDA allocator's peak is the figure instead (it includes everything).
The hooks cost Python time per saved tensor, so the trainer measures only the first steps (the pattern
repeats every step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn


def _storage_key(t: Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def tensor_bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes of the storages behind `tensors`, each storage once (DTensors by their local shard)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.device.type == "meta":
            continue
        key = _storage_key(local)
        if key not in seen:
            seen.add(key)
            total += key[1]
    return total


def optimizer_tensors(opt: torch.optim.Optimizer) -> Iterator[Tensor]:
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, Tensor):
                yield v


class SavedTensorMeter:
    """Live and peak bytes of tensors saved for backward, while `measuring()` is active."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[tuple[int, int], int] = {}

    def _pack(self, t: Tensor) -> Any:
        if t.device.type == "meta" or not t.untyped_storage().nbytes() or _is_parameter(t):
            return t
        return _Saved(self, t)

    def _add(self, key: tuple[int, int]) -> None:
        n = self._refs.get(key, 0)
        self._refs[key] = n + 1
        if n == 0:
            self.live += key[1]
            self.peak = max(self.peak, self.live)

    def _drop(self, key: tuple[int, int]) -> None:
        n = self._refs.get(key, 0) - 1
        if n <= 0:
            self._refs.pop(key, None)
            self.live -= key[1]
        else:
            self._refs[key] = n

    @contextlib.contextmanager
    def measuring(self) -> Iterator[SavedTensorMeter]:
        self.live = self.peak = 0
        self._refs.clear()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield self


def _is_parameter(t: Tensor) -> bool:
    """A weight saved for backward (itself, or a view such as the transpose a matmul keeps): counted as
    weights already, not as an activation. FSDP's gathered weights are parameters too."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class _Saved:
    """A saved tensor, counted until autograd drops it (after the backward that used it)."""

    __slots__ = ("meter", "tensor", "key")

    def __init__(self, meter: SavedTensorMeter, t: Tensor) -> None:
        self.meter, self.tensor, self.key = meter, t, _storage_key(t)
        meter._add(self.key)

    def __del__(self) -> None:
        self.meter._drop(self.key)


def _unpack(packed: Any) -> Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed

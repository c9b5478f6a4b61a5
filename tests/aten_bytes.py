"""What the tests that count HBM bytes in aten ops share: the ops that make views (they move nothing) and the
tensors among an op's nested arguments."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

VIEWS = {"view", "_unsafe_view", "reshape", "detach", "alias", "expand", "t", "transpose", "unsqueeze", "squeeze",
         "select", "slice", "as_strided", "split", "split_with_sizes", "chunk", "unbind", "permute", "view_as"}


def tensors(xs: Iterable[Any]) -> Iterator[Any]:
    """The torch tensors in an aten op's arguments and results, lists and tuples opened."""
    import torch

    for x in xs:
        if isinstance(x, list | tuple):
            yield from tensors(x)
        elif isinstance(x, torch.Tensor):
            yield x

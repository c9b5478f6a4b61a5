"""The one way a command prints `--json`: strict RFC 8259 JSON. No torch.

Python's json module writes a NaN or infinite float as the bare words `NaN` / `Infinity`, which strict parsers
(jq, JavaScript's JSON.parse, Go, serde) reject. A run whose loss went NaN (the divergence guard skips those
steps, but their loss is still NaN in metrics.jsonl) would make every report of it unreadable by a script.
Here a non-finite number becomes null, and `allow_nan=False` makes any that slipped through an error rather
than invalid output. Objects json cannot encode (paths) become their string, as `str()` writes them.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every NaN/inf float (at any depth) replaced by None; dict keys become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, *, compact: bool = False) -> str:
    """Strict JSON text: indented, or `compact` (no spaces) for outputs of millions of numbers."""
    style: dict[str, Any] = {"separators": (",", ":")} if compact else {"indent": 2}
    try:  # the common case has nothing to replace: skip the copy (plan --json --ranks at 16k GPUs)
        return json.dumps(value, allow_nan=False, default=str, **style)
    except ValueError:
        return json.dumps(finite(value), allow_nan=False, default=str, **style)


def print_json(value: Any, *, compact: bool = False) -> None:
    print(dumps(value, compact=compact))


__all__ = ["dumps", "finite", "print_json"]

"""The one way a command prints `--json`: strict RFC 8259 JSON, as trainctl writes every JSON file
(trainctl/fileio.py `json_text`: a NaN or infinite number becomes null). No torch.
"""

from __future__ import annotations

from typing import Any

from trainctl.fileio import finite
from trainctl.fileio import json_text as dumps


def print_json(value: Any, *, compact: bool = False) -> None:
    print(dumps(value, compact=compact))


__all__ = ["dumps", "finite", "print_json"]

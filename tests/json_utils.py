"""Strict JSON for tests: what jq, JavaScript's JSON.parse or Go accept (RFC 8259), not Python's superset
that reads the bare words NaN, Infinity and -Infinity."""

from __future__ import annotations

import json
from typing import Any


def _refuse(word: str) -> Any:
    raise ValueError(f"not RFC 8259 JSON: bare {word}")


def strict_loads(text: str) -> Any:
    return json.loads(text, parse_constant=_refuse)

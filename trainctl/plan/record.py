"""How far the uncalibrated plan has been from the published record, per GPU part: the measured step of every
published run on that part over the step the plan predicted for it (docs/validation.md). An uncalibrated plan
prints the range beside its calibration line, so a user reads its step, days and dollars with the error the
record shows, not as a measurement.

record.json is written by `python -m trainctl.plan.validation --write` with docs/validation.md, and
tests/unit/test_published_runs.py checks that both are current. Torch-free, like every planner module.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

RECORD = Path(__file__).with_name("record.json")
DOC = "docs/validation.md"


def summarize(ratios: dict[str, list[float]]) -> dict[str, Any]:
    """record.json's content from each part's step ratios (published step / predicted step, one per run)."""
    return {"source": f"{DOC} (python -m trainctl.plan.validation --write)",
            "parts": {gpu: {"runs": len(r), "step_ratio_min": round(min(r), 3), "step_ratio_max": round(max(r), 3)}
                      for gpu, r in sorted(ratios.items())}}


@cache
def _load() -> dict[str, Any]:
    try:
        return json.loads(RECORD.read_text())
    except (OSError, ValueError):  # an install without the file prints no range rather than failing the plan
        return {}


def band(gpu: str) -> dict[str, Any] | None:
    """The record's range for a GPU part (None where no published run used it)."""
    part = _load().get("parts", {}).get(gpu)
    return {"gpu": gpu, **part} if part else None


def band_text(b: dict[str, Any]) -> str:
    runs = "run" if b["runs"] == 1 else "runs"
    return (f"on {b['gpu']}, {b['runs']} published {runs} took {b['step_ratio_min']:.2f}x-{b['step_ratio_max']:.2f}x "
            f"the uncalibrated step ({DOC})")

"""The run directory layout (design.md), shared by launch, runtime and report. No torch.

    RUN/spec.yaml          frozen, fully resolved spec
    RUN/plan.json          the planner's prediction at launch time
    RUN/launch.sh          the rendered launch script / command lines
    RUN/job.json           backend, ids, attempts, git commit
    RUN/logs/              per-rank and launcher logs
    RUN/metrics.jsonl      one JSON object per training step (rank 0)
    RUN/events.jsonl       starts, restarts, checkpoints, preemptions, failures
    RUN/checkpoints/step-N/
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def spec(self) -> Path:
        return self.root / "spec.yaml"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def launch_script(self) -> Path:
        return self.root / "launch.sh"

    @property
    def job(self) -> Path:
        return self.root / "job.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON object as one line; a single write() so concurrent appenders do not interleave."""
    line = json.dumps(record, separators=(",", ":")) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


def record_event(paths: RunPaths, kind: str, **fields: Any) -> None:
    append_jsonl(paths.events, {"time": time.time(), "event": kind, "pid": os.getpid(), **fields})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read a JSONL file, skipping a torn last line (a writer killed mid-line)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out

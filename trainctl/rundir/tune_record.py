"""A tune directory's own record: which layouts `plan --auto` ranked, what it predicted for each, and where
the measured best goes. No torch.

A tune directory is a sweep directory (rundir/sweep_record.py: sweep.json, events.jsonl, run-<i>/), one run per
layout, so `status`, `cancel`, `resume` and `mfu-report` take it as they take a sweep. It adds:

    TUNE/tune.json          the spec and overrides tuned, the steps per run, each layout (run-<i>) with its
                            `parallel` section, recompute, predicted rank and predicted figures
    TUNE/tune-result.json   once every run has ended: predicted against measured per layout, the winner
    TUNE/best.yaml          the spec with the measured fastest layout (or where --out put it)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainctl.fileio import write_atomic

RECORD = "tune.json"
RESULT = "tune-result.json"
BEST = "best.yaml"


@dataclass
class TunedLayout:
    dir: str  # the run directory, relative to the tune directory
    predicted_rank: int  # 1 = the plan's best
    describe: str  # the layout in plan --auto's words, e.g. "tp1 pp1 dp4 zero1 mb1 1f1b"
    parallel: dict[str, Any]  # the spec's `parallel` section for this layout
    recompute: str  # train.recompute, part of the layout --auto searches
    predicted: dict[str, float | None]  # step_time_s, tokens_per_s, mfu (None: the peak is unknown)


@dataclass
class TuneRecord:
    spec: str  # the spec file tuned (absolute)
    sets: list[str]  # its --set overrides (the measured best keeps them)
    steps: int  # training steps of each run
    top: int
    peak_known: bool  # the plan's step times are absolute (else ranked at a nominal peak)
    out: str  # where the measured best's spec is written (absolute)
    layouts: list[TunedLayout] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TuneRecord:
        return cls(**{**data, "layouts": [TunedLayout(**x) for x in data.get("layouts", [])]})


def is_tune_dir(path: Path) -> bool:
    return (path / RECORD).is_file()


def read_record(root: Path) -> TuneRecord:
    return TuneRecord.from_json(json.loads((root / RECORD).read_text(encoding="utf-8")))


def write_record(root: Path, record: TuneRecord) -> None:
    write_atomic(root / RECORD, json.dumps(record.to_json(), indent=2) + "\n")

"""A sweep directory's record: the grid and its runs. No torch.

    SWEEP/sweep.json        the spec, the --set overrides, the grid, the backend, each run's grid values,
                            and on Slurm the job array (id, script, submission command)
    SWEEP/events.jsonl      the sweep's own events (a cancel of the whole sweep, resumes)
    SWEEP/run-<i>/          ordinary run directories (trainctl.rundir.paths), one per grid point
    SWEEP/array.sh          Slurm: the job array's batch script (element i runs run-<i>/launch.sh)

A run directory is named by its index so that Slurm's --output pattern (run-%a/logs/slurm-%j.out) puts each
array element's log where the run's own log is.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainctl.fileio import write_atomic

RECORD = "sweep.json"
EVENTS = "events.jsonl"
ARRAY_SCRIPT = "array.sh"
RUN_PREFIX = "run-"


def run_dir_name(index: int) -> str:
    return f"{RUN_PREFIX}{index}"


@dataclass
class SweepRun:
    index: int
    dir: str  # relative to the sweep directory
    values: dict[str, str]  # grid key -> the value this run has (as given)


@dataclass
class SweepRecord:
    spec: str
    sets: list[str]
    grid: dict[str, list[str]]
    backend: str
    runs: list[SweepRun]
    created: str
    concurrency: int | None = None
    array: dict[str, Any] = field(default_factory=dict)  # Slurm: job_id, script, submit_command

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SweepRecord:
        runs = [SweepRun(**r) for r in data.get("runs", [])]
        return cls(**{**data, "runs": runs})


def is_sweep_dir(path: Path) -> bool:
    return (path / RECORD).is_file()


def read_record(root: Path) -> SweepRecord:
    return SweepRecord.from_json(json.loads((root / RECORD).read_text(encoding="utf-8")))


def write_record(root: Path, record: SweepRecord) -> None:
    write_atomic(root / RECORD, json.dumps(record.to_json(), indent=2) + "\n")


def run_dirs(root: Path, record: SweepRecord) -> list[Path]:
    return [root / r.dir for r in record.runs]

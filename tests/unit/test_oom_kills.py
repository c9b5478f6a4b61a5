"""The out-of-memory verdict on a SIGKILLed rank: the counters it recorded at its start against the same
counters now (trainctl/hardware/oom_kills.py). The real kernel kill is tests/dist/test_ctrl_c.py's."""

from __future__ import annotations

import json
import socket
from dataclasses import asdict
from pathlib import Path

from trainctl.hardware import oom_kills


def recorded(tmp_path: Path, counter: Path, kills: int, host: str | None = None) -> Path:
    start = oom_kills.OomCounters(host=host or socket.gethostname(), pid=1234, cgroup_file=str(counter),
                                  cgroup_kills=kills, node_kills=None)
    path = tmp_path / "oom-rank1.json"
    path.write_text(json.dumps(asdict(start)))
    return path


def test_a_grown_cgroup_count_is_out_of_memory_and_nothing_else_is(tmp_path: Path) -> None:
    counter = tmp_path / "memory.events"  # v2's format: "name value" lines
    counter.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    start = recorded(tmp_path, counter, 2)
    assert oom_kills.killed_by_oom(start) is None  # no kill since the start: a kill -9
    counter.write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 3\n")
    assert oom_kills.killed_by_oom(start) == f"memory cgroup {tmp_path}: 1 OOM kill(s) since it started"
    # another node's counters are not the ones readable here
    assert oom_kills.killed_by_oom(recorded(tmp_path, counter, 2, host="elsewhere")) is None
    assert oom_kills.killed_by_oom(tmp_path / "missing.json") is None


def test_this_process_counters_are_readable_here() -> None:
    """Where the machine has a memory cgroup (this one and CI do), the rank's record holds its counter."""
    c = oom_kills.counters()
    assert c.pid > 0 and c.host == socket.gethostname()
    if oom_kills.cgroup_dir() is not None:
        assert c.cgroup_file is not None and c.cgroup_kills is not None and c.cgroup_kills >= 0

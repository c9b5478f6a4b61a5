"""Was a rank killed by the kernel's out-of-memory killer? Its SIGKILL looks like any `kill -9`; the kernel's
counters tell them apart (docs/design/run-states.md, "Out-of-memory kills"). No torch.

- the oom_kill count of the process's memory cgroup: cgroup v1 `memory.oom_control`, v2 `memory.events`
  (a job's cgroup under Slurm, a container's, a test's);
- the node's count, /proc/vmstat `oom_kill` (Linux 4.13+): the machine ran out, no cgroup limit involved.

A rank records both when it starts (RUN/logs/oom-rank<N>.json); when it later dies by SIGKILL, the launcher on
the same node reads them again: a count that grew names the cause. A node the launcher is not on is not read
(its counters are not visible from here).

The test-only fault `oom_at_step` (InjectedOom) makes a rank join a memory cgroup the test made, then allocate
at one step until the kernel kills it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainctl.fileio import write_atomic
from trainctl.hardware.hostname import this_host

PROC_VMSTAT = Path("/proc/vmstat")
MOUNTINFO = Path("/proc/self/mountinfo")
# an injected OOM allocates only inside a cgroup whose limit is below this: never the machine's own memory
INJECT_MAX_LIMIT = 4 << 30


@dataclass(frozen=True)
class OomCounters:
    host: str
    pid: int
    cgroup_file: str | None  # the counter file of the process's memory cgroup; None: none found
    cgroup_kills: int | None
    node_kills: int | None


def _count(path: Path, key: str = "oom_kill") -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def _cgroup_mounts() -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """((root, mount point) of the v1 memory hierarchy, (root, mount point) of the v2 hierarchy)."""
    v1 = v2 = None
    try:
        lines = MOUNTINFO.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        fstype, options = after[0], after[2] if len(after) > 2 else ""
        if fstype == "cgroup" and "memory" in options.split(","):
            v1 = (fields[3], fields[4])
        elif fstype == "cgroup2":
            v2 = (fields[3], fields[4])
    return v1, v2


def _under(mount: tuple[str, str], path: str) -> Path:
    root, point = mount
    rel = path[len(root):] if root != "/" and path.startswith(root) else path
    return Path(point) / rel.lstrip("/")


def cgroup_dir() -> tuple[Path, str] | None:
    """(directory, counter file name) of the memory cgroup this process is in; None where none is visible."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    v1, v2 = _cgroup_mounts()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if v1 is not None and "memory" in controllers.split(","):
            return _under(v1, path), "memory.oom_control"
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        if v2 is not None and hier == "0" and controllers == "":
            return _under(v2, path), "memory.events"
    return None


def counters() -> OomCounters:
    """This process's counters now."""
    where = cgroup_dir()
    file = where[0] / where[1] if where else None
    return OomCounters(this_host(), os.getpid(), str(file) if file else None,
                       _count(file) if file else None, _count(PROC_VMSTAT))


def record(path: Path) -> None:
    """At a rank's start: its counters now (a rank that cannot write its log directory has bigger trouble)."""
    path.parent.mkdir(exist_ok=True)  # RUN/logs; not its parents: a deleted run directory stays deleted
    write_atomic(path, json.dumps(asdict(counters())) + "\n")


def killed_by_oom(path: Path) -> str | None:
    """Why the kernel's OOM killer is the likely killer of the rank whose start counters are at `path`, or
    None: no record, another node, or no count grew since."""
    try:
        then = OomCounters(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if then.host != this_host():
        return None
    if then.cgroup_file and then.cgroup_kills is not None:
        now = _count(Path(then.cgroup_file))
        if now is not None and now > then.cgroup_kills:
            return (f"memory cgroup {Path(then.cgroup_file).parent}: {now - then.cgroup_kills} OOM kill(s) since "
                    "it started")
    now_node = _count(PROC_VMSTAT)
    if then.node_kills is not None and now_node is not None and now_node > then.node_kills:
        return f"{then.host}: {now_node - then.node_kills} OOM kill(s) on the node since it started"
    return None


class InjectedOom:
    """Test-only (fault oom_at_step=<rank>:<step>:<cgroup dir>): the rank joins that memory cgroup before it
    records its counters, then at that step allocates and touches memory until the kernel kills it."""

    def __init__(self, rank: int, value: str | None) -> None:
        self.step = 0
        self.cgroup: Path | None = None
        if value:
            r, s, d = value.split(":", 2)
            if int(r) == rank:
                self.step, self.cgroup = int(s), Path(d)

    def join(self) -> None:
        if self.cgroup is not None:
            (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))

    def at(self, step: int) -> None:
        if step != self.step or self.cgroup is None:
            return
        where = cgroup_dir()
        limit = _limit(where[0]) if where else None
        if limit is None or limit >= INJECT_MAX_LIMIT:
            raise RuntimeError(f"fault oom_at_step: {where} has no memory limit under {INJECT_MAX_LIMIT} bytes; "
                               "not allocating the machine's memory")
        hog = []
        while True:  # ends by the kernel's SIGKILL
            hog.append(bytearray(b"\1" * (16 << 20)))
            time.sleep(0.001)


def _limit(d: Path) -> int | None:
    """The memory limit of cgroup directory `d` (v1 memory.limit_in_bytes, v2 memory.max; None: "max")."""
    for name in ("memory.limit_in_bytes", "memory.max"):
        try:
            return int((d / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return None

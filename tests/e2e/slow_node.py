"""Make one node of the local Slurm cluster slow, for real: its slurmd goes into a CPU cgroup with a quota
(cgroup v1 `cpu` controller, or v2), and every job step it starts afterwards (slurmstepd, then the tasks)
inherits the cgroup. slurm/README.md, "A slow node".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
PERIOD_US = 10_000  # short periods: a 100 ms measurement spans ten, so the quota shows in every window


def slurmd_pid(node: str) -> int:
    """The pid of `slurmd -N NODE`, from /proc."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if Path(argv[0].decode()).name == "slurmd" and node.encode() in argv:
            return int(proc.name)
    raise RuntimeError(f"no slurmd -N {node} is running")


def cgroup_root() -> tuple[Path, bool]:
    """(the cpu hierarchy's root, whether it is cgroup v2)."""
    if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
        return CGROUP_V1, False
    if (CGROUP_V2 / "cgroup.controllers").exists() and "cpu" in (CGROUP_V2 / "cgroup.controllers").read_text():
        return CGROUP_V2, True
    raise RuntimeError("no writable cpu cgroup controller under /sys/fs/cgroup")


def _group(node: str, fraction: float) -> tuple[Path, Path]:
    """(the cpu hierarchy's root, NODE's cgroup at `fraction` of one core)."""
    root, v2 = cgroup_root()
    group = root / f"trainctl-slow-{node}"
    group.mkdir(exist_ok=True)
    quota = max(1000, int(PERIOD_US * fraction))
    if v2:
        (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    else:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    return root, group


def _release(root: Path, group: Path) -> None:
    for line in (group / "cgroup.procs").read_text().split():  # slurmd and anything still running
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            (root / "cgroup.procs").write_text(line)
    with contextlib.suppress(OSError):
        group.rmdir()


@contextlib.contextmanager
def slow_node(node: str, fraction: float) -> Iterator[Path]:
    """Confine NODE's slurmd (and what it starts from now on) to `fraction` of one core; undone on exit."""
    root, group = _group(node, fraction)
    (group / "cgroup.procs").write_text(str(slurmd_pid(node)))
    try:
        yield group
    finally:
        _release(root, group)


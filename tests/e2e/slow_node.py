"""Make one node of the local Slurm cluster slow, for real, the way `cpulimit` throttles a process: every
process the node's job steps run (its tasks and their children) is stopped with SIGSTOP for all but
`fraction` of each 50 ms period and continued with SIGCONT for the rest. slurm/README.md, "A slow node".

`trainctl preflight` judges a node by its best 100 ms window of matmuls, and measured n2 at 20% of the time
at 0.16-0.29x of n1, idle or beside the layout matrix; under the first version, a 20% CPU cgroup quota that
this sandbox enforces loosely, it measured up to 0.50x. A rank's step time is another matter: the scheduler
makes up for the stopped time when the rank runs on a loaded host (tests/e2e/test_straggler_exclusion_e2e.py).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

PERIOD_S = 0.05  # two periods in each of preflight's 100 ms windows
RESCAN_EVERY = 2  # periods between looks for new processes: a new task runs free for at most 100 ms
SLURM_DAEMONS = ("slurmd", "slurmstepd")  # the node's daemons stay responsive; only their tasks are slowed


class NodeProcesses:
    """The processes NODE's job steps run, found by the environment Slurm gives every task
    (SLURMD_NODENAME), which their children inherit. slurmstepd is not slurmd's child (slurmd forks twice),
    so the process tree does not lead there; each process's environment is read once, when it first shows."""

    def __init__(self, node: str) -> None:
        self.marker = f"SLURMD_NODENAME={node}".encode()
        self.known: dict[int, bool | None] = {}  # pid -> whether it runs for the node (None: ask again)

    def _runs_for_node(self, pid: int) -> bool | None:
        """None for a Slurm daemon: a task is forked by slurmstepd and shows as one until it execs."""
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() in SLURM_DAEMONS:
                return None
            return self.marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # it ended meanwhile, or is a kernel thread
            return False

    def __call__(self) -> list[int]:
        pids = {int(n) for n in os.listdir("/proc") if n.isdigit()}
        self.known = {p: self.known.get(p) if self.known.get(p) is not None else self._runs_for_node(p)
                      for p in pids}
        return [p for p, mine in self.known.items() if mine]


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class Throttle(threading.Thread):
    """The duty cycle over one node's job processes; `seen` holds every process it slowed."""

    def __init__(self, node: str, fraction: float) -> None:
        super().__init__(name="slow-node", daemon=True)
        self.processes, self.fraction = NodeProcesses(node), fraction
        self.seen: set[int] = set()
        self.done = threading.Event()

    def run(self) -> None:
        pids: list[int] = []
        try:
            for period in itertools.count():
                if self.done.is_set():
                    break
                if period % RESCAN_EVERY == 0:
                    pids = self.processes()
                    self.seen.update(pids)
                _signal(pids, signal.SIGSTOP)
                time.sleep(PERIOD_S * (1 - self.fraction))
                _signal(pids, signal.SIGCONT)
                time.sleep(PERIOD_S * self.fraction)
        finally:  # nothing is left stopped
            _signal(pids + self.processes(), signal.SIGCONT)


@contextlib.contextmanager
def slow_node(node: str, fraction: float) -> Iterator[Throttle]:
    """Let NODE's job processes run `fraction` of the time (as they start, until the block ends)."""
    throttle = Throttle(node, fraction)
    throttle.start()
    try:
        yield throttle
    finally:
        throttle.done.set()
        throttle.join()

"""Make one node of the local Slurm cluster slow, for real, the way `cpulimit` throttles a process: every
process the node's job steps run (its tasks and their children) is stopped with SIGSTOP for all but
`fraction` of each 50 ms period and continued with SIGCONT for the rest, its threads at nice 19 so that a load on
the host slows it further rather than excusing it. slurm/README.md, "A slow node".

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


def _lowest_priority(pids: list[int], done: set[int]) -> None:
    """Nice 19 for every thread of `pids` not yet in `done` (Linux keeps a nice value per thread). Stopped for
    most of each period, a process is owed CPU time, and on a loaded host the scheduler pays it back in the
    moments it runs: held to 10% of the time beside six busy loops, n2 still measured 0.35x of n1. At nice 19 it
    gets 1.5% of a core against each busy neighbour, so a load slows n2 further instead of excusing it."""
    for pid in pids:
        with contextlib.suppress(OSError):  # it ended meanwhile
            for tid in {int(t) for t in os.listdir(f"/proc/{pid}/task")} - done:
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, tid, 19)
                    done.add(tid)


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
        self.reniced: set[int] = set()  # thread ids
        self.done = threading.Event()

    def run(self) -> None:
        # On a loaded host a late wake-up would let the node run free past its share: the thread that keeps
        # time runs at the highest priority where it may.
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -20)
        pids: list[int] = []
        try:
            for period in itertools.count():
                if self.done.is_set():
                    break
                stopped_at = time.monotonic()
                _signal(pids, signal.SIGSTOP)
                if period % RESCAN_EVERY == 0:
                    # while the known ones are stopped: a scan of /proc on a busy host took long enough that
                    # n2, free during it, measured 0.61x of n1 at 10% of the time
                    pids = self.processes()
                    _signal([p for p in pids if p not in self.seen], signal.SIGSTOP)
                    self.seen.update(pids)
                    _lowest_priority(pids, self.reniced)
                time.sleep(max(0.0, PERIOD_S * (1 - self.fraction) - (time.monotonic() - stopped_at)))
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

"""The process tree a local launcher owns: torchrun and its ranks (Linux /proc; no torch).

torchrun starts each worker with its own session, so signalling torchrun's process group misses them:
the tree is read from /proc/PID/task/TID/children instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from pathlib import Path

MAX_CHILDREN = 4096  # a bound on what one launcher may have started
PR_SET_PDEATHSIG = 1  # prctl(2)


def children(pid: int) -> list[int]:
    """Direct child processes of `pid` (empty where /proc is missing or the process is gone)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Child processes of `pid`, recursively."""
    out: list[int] = []
    todo = [pid]
    while todo and len(out) < MAX_CHILDREN:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out[:MAX_CHILDREN]


def handles(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler installed for `sig` (SigCgt in /proc/PID/status), so that `sig` is
    a request to it rather than its death (False where the process is gone or /proc is missing)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) >> (sig - 1) & 1)


def signal_all(pids: list[int], sig: int) -> int:
    """Send `sig` to each pid that still exists; how many were signalled."""
    sent = 0
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)
            sent += 1
    return sent


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything it started."""
    signal_all([*descendants(pid), pid], signal.SIGKILL)


def die_with_parent() -> None:
    """For Popen's preexec_fn: the child gets SIGKILL when the thread that started it dies (prctl
    PR_SET_PDEATHSIG), so torchrun never outlives a launcher killed with SIGKILL. Its ranks notice the lost
    parent and stop themselves after a checkpoint (runtime/train/signals.py, parent watch). No-op off Linux."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

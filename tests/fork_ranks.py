"""Start NPROC ranks as srun does (RANK, WORLD_SIZE, MASTER_*: no torchrun agent), forked from one interpreter
that has already imported torch and the trainer:

    python tests/fork_ranks.py NPROC -m trainctl.runtime RUN_DIR     (what torchrun -m would run)
    python tests/fork_ranks.py NPROC tests/dist/WORKER.py ARGS...

Each rank is a real process running the module or script as __main__, with its own gloo connections, files
and exit status; only the 3 s of imports per rank are paid once. On two cores those imports were most of the
cost of a multi-rank test. The tests of the trainer's numbers (resume, resharding, faults inside the
trainer, the equivalence matrix, the test workers) start their ranks this way (trainer_utils.fork_ranks); the
tests of launching itself keep torchrun and `trainctl launch`.

As torchrun does, the first rank that fails makes the others get SIGTERM (SIGKILL 30 s later), and the exit
status is 0 when every rank exited 0, else 1.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time

from trainer_utils import free_port  # tests/ is sys.path[0]: this file runs as a script

from trainctl.runtime.trainer import Trainer  # noqa: F401  (imported here, once, before the fork)

KILL_AFTER_S = 30.0


def run_main(target: list[str]) -> int:
    """Run `-m MODULE ARGS` or `SCRIPT ARGS` as __main__ in this process; its exit status."""
    module = target[0] == "-m"
    name, args = (target[1], target[2:]) if module else (target[0], target[1:])
    sys.argv = [name, *args]
    try:
        if module:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(name)))  # as `python SCRIPT` does
            runpy.run_path(name, run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1


def start(nproc: int, target: list[str]) -> list[int]:
    port = str(free_port())
    pids: list[int] = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                              LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            code = run_main(target)  # the trainer and the workers end with os._exit themselves
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # never back into the parent's loop
        pids.append(pid)
    return pids


def wait(pids: list[int]) -> int:
    live = set(pids)
    failed = False
    kill_at: float | None = None
    while live:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if kill_at is not None and time.monotonic() > kill_at:
                for p in live:
                    os.kill(p, signal.SIGKILL)
                kill_at = None
            time.sleep(0.05)
            continue
        live.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            for p in live:
                os.kill(p, signal.SIGTERM)
            kill_at = time.monotonic() + KILL_AFTER_S
    return 1 if failed else 0


if __name__ == "__main__":
    sys.stdout.flush()
    sys.exit(wait(start(int(sys.argv[1]), sys.argv[2:])))

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

    python tests/fork_ranks.py --serve SOCKET

keeps one such warmed interpreter for a whole pytest session (trainer_utils.fork_ranks starts it on first
use): each request on the Unix socket (one JSON line: nproc, target, env, cwd, out, err) forks a job that
takes the request's environment, working directory and output files, then starts and waits for its ranks
exactly as above, in a process group of its own (so a timeout kills every rank). The server answers the
job's pid, then its exit status. It never runs torch itself (forking after a parallel region is unsafe), and
it exits when its parent (pytest) is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
from typing import Any

# Imported here, once, before the fork. Besides the trainer, what every rank would import lazily:
# torch.optim's Optimizer.__init__ imports torch._dynamo (0.7 s of CPU per rank), the pipeline schedules
# torch.distributed.pipelining.
import torch._dynamo  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
from trainer_utils import free_port  # tests/ is sys.path[0]: this file runs as a script

from trainctl.runtime.train.trainer import Trainer  # noqa: F401

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


def run_job(request: dict[str, Any]) -> None:
    """In a forked job: take the request's environment, directory and output files, run its ranks, exit."""
    os.setpgid(0, 0)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for fd, path in ((1, request["out"]), (2, request["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    try:
        code = wait(start(int(request["nproc"]), request["target"]))
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(path: str) -> None:
    """Answer requests on the Unix socket `path`: fork the job, send its pid, wait for it, send its exit
    status. Requests are answered as they come, so a test may run jobs side by side (its own threads); the
    forks happen in this main thread only, each waited for by a small thread. Stop once the parent (pytest)
    is gone."""
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX)
    server.bind(path + ".tmp")
    server.listen()
    os.rename(path + ".tmp", path)  # the path appears only once it accepts
    server.settimeout(1.0)
    while os.getppid() == parent:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        request = json.loads(conn.makefile().readline())
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            server.close()
            conn.close()
            run_job(request)
        with contextlib.suppress(OSError):  # also done in the child: whichever runs first
            os.setpgid(pid, pid)
        threading.Thread(target=_answer, args=(conn, pid), daemon=True).start()


def _answer(conn: socket.socket, pid: int) -> None:
    """Send the job's pid, wait for it, send its exit status."""
    with conn:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        with contextlib.suppress(OSError):  # the client gave up (timeout) and killed the job
            conn.sendall(json.dumps({"code": code}).encode() + b"\n")


if __name__ == "__main__":
    sys.stdout.flush()
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
    else:
        sys.exit(wait(start(int(sys.argv[1]), sys.argv[2:])))

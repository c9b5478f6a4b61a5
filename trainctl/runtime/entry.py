"""`python -m trainctl.runtime RUN_DIR`: what every launcher runs on every rank.

Exit status, on every path: 0 success, 1 a failure (traceback on this rank's stderr, then one summary
line; a TrainctlError such as an unusable checkpoint gives the line alone), 2 a spec error, 75 stopped by
SIGTERM/SIGUSR1/SIGUSR2 after committing a checkpoint (requeue me). The exit itself goes through
distributed.exit_now (barrier on success, flush, os._exit) because interpreter shutdown after gloo/FSDP
aborts at random (docs/design/checked-facts.md, "Checked facts: PyTorch distributed on CPU/gloo").
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import torch

from trainctl.errors import SpecError, TrainctlError, UsageError
from trainctl.hardware.hostname import this_host
from trainctl.launch import package_origin
from trainctl.rundir.paths import SPEC, RunPaths, read_jsonl, record_event
from trainctl.runtime.parallel.process_groups import RankEnv, exit_now
from trainctl.runtime.train import signals

USAGE = f"usage: python -m trainctl.runtime RUN_DIR   (RUN_DIR holds the frozen {SPEC})"


def main(argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        exit_now(0 if args and args[0] in ("-h", "--help") else 2, barrier=False)
    paths = RunPaths(Path(args[0]))
    # First thing: a stop request from now on is recorded (the ranks stop at their next step boundary, or
    # before the first step), and a rank whose parent dies stops itself (runtime/train/signals.py).
    signals.STOP.install().watch_parent()
    env = RankEnv.from_env()
    _threads()
    try:
        from trainctl.spec import load_spec

        spec = load_spec(paths.spec)
        from trainctl.launch.resume import unrecorded_edits

        if edits := unrecorded_edits(paths):
            raise SpecError([f"{paths.spec} was edited since trainctl last wrote it ({'; '.join(edits)}): a "
                             "restart does not train on an edit no one saw; `trainctl resume "
                             f"{paths.root}` shows and records it, or put the file back"])
    except SpecError as e:
        print(f"trainctl: rank {env.rank}: {e}", file=sys.stderr)
        with contextlib.suppress(OSError):  # a failure of the run, not of its start (rundir/runstate.py)
            record_event(paths, "failure", rank=env.rank, host=this_host(),
                         error=f"SpecError: {str(e).splitlines()[0]}")
        exit_now(2, barrier=False)
    try:
        paths.refuse_links()  # a Slurm requeue or torchrun restart writes nothing through a link either
        if (wrong := package_origin.problem()) is not None:  # before any step: not at the first checkpoint
            raise UsageError(wrong, hint=package_origin.PROBLEM_HINT)
        from trainctl.plan.elastic import for_world, resize_event
        from trainctl.runtime.parallel.placement_proof import prove_placement
        from trainctl.runtime.parallel.process_groups import init
        from trainctl.runtime.train.trainer import Trainer

        nominal, spec = spec, for_world(spec, env.world_size)  # elastic: the layout of the nodes torchrun found
        par = init(spec, env)
        if par.rank == 0 and (resize := resize_event(nominal, spec, read_jsonl(paths.events))) is not None:
            record_event(paths, "elastic_resize", **resize)
            print(f"trainctl: {resize['message']}", flush=True)
        # Every rank reports where it really runs; rank 0 writes RUN/placement.json (fails on a split TP group).
        prove_placement(spec, paths, par.rank, par.env.local_rank, par.world_size)
        # A stop asked for before this rank could handle it (runtime/train/signals.recorded_stop): the ranks stop
        # before their first step. Read after the process groups exist: every rank reads the same record.
        signals.STOP.request(signals.recorded_stop(paths))
        code = Trainer(spec, par, paths).run()
    except TrainctlError as e:  # a known condition (e.g. an unusable checkpoint): one line + hint, no traceback
        print(f"trainctl: rank {env.rank} failed: {e.message}" + (f" (hint: {e.hint})" if e.hint else ""),
              file=sys.stderr)
        with contextlib.suppress(OSError):
            record_event(paths, "failure", rank=env.rank, host=this_host(), error=e.message.splitlines()[0])
        exit_now(1, barrier=False)
    except BaseException as e:  # every failure ends in one clear line and exit status 1
        traceback.print_exc()
        summary = failure_summary(e)
        print(f"trainctl: rank {env.rank} failed: {summary}", file=sys.stderr)
        with contextlib.suppress(OSError):  # an unwritable run dir must not hide the real error
            record_event(paths, "failure", rank=env.rank, host=this_host(), error=summary)
        exit_now(1, barrier=False)
    exit_now(code, barrier=True)  # 0, or checkpointing.requeue_code() after a stop signal


def _first_line(e: BaseException) -> str:
    text = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def failure_summary(e: BaseException) -> str:
    """One line: the exception and, when it wraps another (pipelining re-raises a peer's lost connection as
    "Failed to run stage backward"), the root of its chain, whose words tell a first cause from the
    consequence of another rank's death (rundir/runstate.py)."""
    root = e
    while (nxt := root.__cause__ or root.__context__) is not None and nxt is not root:
        root = nxt
    outer = _first_line(e)
    return outer if root is e else f"{outer} (caused by {_first_line(root)})"


def _threads() -> None:
    """One intra-op thread per rank unless the launcher said otherwise (OMP_NUM_THREADS)."""
    n = os.environ.get("OMP_NUM_THREADS")
    if n and n.isdigit() and int(n) > 0:
        torch.set_num_threads(int(n))

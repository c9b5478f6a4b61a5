"""The entry point of a measuring job's ranks (`trainctl calibrate`, `trainctl preflight`): read the run
directory's frozen spec, start the process group, do the work, and leave as the trainer does (exit_now):
a spec error is a usage error (exit 2), any other failure one clear line per rank (exit 1, the traceback
above it in the rank's log; torchrun stops the rest)."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

from trainctl.errors import EXIT_USAGE, SpecError
from trainctl.rundir.paths import RunPaths
from trainctl.runtime.parallel.process_groups import RankEnv, exit_now, runs_on_gpu, start_process_group
from trainctl.spec.models import RunSpec

Work = Callable[[RunSpec, RankEnv, torch.device, RunPaths], None]


def worker_main(module: str, what: str, work: Work, argv: list[str] | None = None) -> NoReturn:
    """`python -m MODULE RUN_DIR` on every rank: `work(spec, env, device, paths)`; `what` names the job in
    the failure line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m {module} RUN_DIR", file=sys.stderr)
        exit_now(EXIT_USAGE, barrier=False)
    paths = RunPaths(Path(args[0]))
    env = RankEnv.from_env()
    try:
        from trainctl.spec import load_spec

        spec = load_spec(paths.spec)
    except SpecError as e:
        print(f"trainctl: rank {env.rank}: {e}", file=sys.stderr)
        exit_now(EXIT_USAGE, barrier=False)
    try:
        work(spec, env, start_process_group(env, runs_on_gpu(spec)), paths)
    except BaseException as e:  # one clear line per failed rank; torchrun stops the rest
        traceback.print_exc()
        print(f"trainctl: {what}: rank {env.rank} failed: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        exit_now(1, barrier=False)
    exit_now(0, barrier=True)

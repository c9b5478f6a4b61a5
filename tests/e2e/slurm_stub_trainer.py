"""A stand-in for `python -m trainctl.runtime RUN` in the Slurm signal-chain test (until the trainer
checkpoints on USR1): every rank joins the process group, runs the placement proof, marks itself up,
and on the first attempt waits for SIGUSR1 (marking that it arrived) and exits 0; later attempts just
mark themselves done. Run with tests/ on PYTHONPATH: `python -m slurm_stub_trainer RUN`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

from trainctl.rundir.paths import RunPaths, record_event
from trainctl.runtime.parallel.placement_proof import prove_placement
from trainctl.runtime.parallel.process_groups import RankEnv
from trainctl.spec import load_spec


def main() -> None:
    paths = RunPaths(Path(sys.argv[1]))
    env = RankEnv.from_env()
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    marks = paths.root / "stub"
    marks.mkdir(exist_ok=True)
    got: list[int] = []
    signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    env.export()
    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)
    prove_placement(load_spec(paths.spec), paths, env.rank, env.local_rank, env.world_size)
    if env.rank == 0:  # what the trainer records once it trains (trainctl status: RUNNING)
        record_event(paths, "start", world_size=env.world_size, slurm_restart=attempt)
    (marks / f"up-{env.rank}-{attempt}").write_text(os.environ.get("SLURMD_NODENAME", "?"))
    if attempt == 0:
        deadline = time.monotonic() + 90
        while not got and time.monotonic() < deadline:
            time.sleep(0.1)
        if got:
            (marks / f"usr1-{env.rank}-{attempt}").write_text("")
    else:
        (marks / f"done-{env.rank}-{attempt}").write_text("")
        if env.rank == 0:
            record_event(paths, "finish", steps=0)
    sys.stdout.flush()
    os._exit(0)  # no gloo teardown (see trainctl.runtime.parallel.process_groups.exit_now)


if __name__ == "__main__":
    main()

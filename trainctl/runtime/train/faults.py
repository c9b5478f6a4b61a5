"""Test-only fault injection behind one switch: TRAINCTL_FAULTS (docs/design/testing.md, "Fault injection").

    TRAINCTL_FAULTS="fail_at_step=3,fail_rank=1"

Production code asks `get`/`get_int`/`get_float` for a fault by name and never reads the environment for it
itself. An unknown name is an error, so a typo cannot silently switch a test's fault off. No torch here.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ENV = "TRAINCTL_FAULTS"

# name -> what it does (the one list of faults; values are parsed by the code that uses them)
FAULTS: dict[str, str] = {
    "fail_at_step": "raise InjectedFailure on `fail_rank` when step N (1-based) starts",
    "fail_rank": "the rank that fail_at_step fails (default: the last rank)",
    "fail_attempt": "fail only in torchrun attempt N (0 = the first), so a restart can succeed",
    "hang": "<rank>:<step>: that rank blocks forever at that step (the hang watchdog must end it)",
    "slow_rank": "<rank>:<seconds>[+<rank>:<seconds>...]: those ranks sleep that long every step",
    "slow_work": "<rank>:<factor>[+...]: those ranks do each step's forward and backward work <factor> times "
                 "over, as CPU time (a slow device: behind by that factor at any host load)",
    "oom_at_step": "<rank>:<step>:<memory cgroup dir>: that rank joins the cgroup (which the test made with a "
                   "small limit) at start, then allocates at that step until the kernel's OOM killer kills it",
    "slow_write_s": "a checkpoint writer sleeps this long after writing, before the commit",
    "slow_write_from_step": "slow_write_s slows only the saves of this step and later (default: every save)",
    "slow_gather_s": "ZeRO's all-gather of the updated weights waits this long first, on every rank",
    "stop_after_step": "checkpoint after step N, then stop as if signalled (exit 0)",
    "host_memory": "bytes of host memory the TP-reshard check believes are available",
    "nan_at_step": "N or N-M: the steps that read batch N (..M) get a NaN gradient on `nan_rank` (the "
                   "divergence guard must skip them); tied to the data position, so a rollback that skips "
                   "the window does not meet it again",
    "nan_rank": "the rank whose gradients nan_at_step poisons (default: the last rank)",
    "crash_mtbf_s": "seconds: rank crashes (SIGKILL) as a Poisson process with this mean time between them, in "
                    "wall time from the run's first step on, through restarts too: a crash due while no rank is "
                    "up (a restart) kills the next attempt's rank as it starts (crash_schedule, arm_crashes)",
    "crash_seed": "the seed of crash_mtbf_s's times and victims (default 0)",
    "start_fail_attempts": "Slurm: these attempts of the job (SLURM_RESTART_COUNT, `+`-separated) fail to "
                           "launch: srun starts a program that does not exist, as a revoked credential or a lost "
                           "node fails a launch (the batch script must retry)",
}


class FaultSpecError(ValueError):
    """TRAINCTL_FAULTS names a fault that does not exist or is malformed."""


def active(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The faults TRAINCTL_FAULTS switches on, by name."""
    text = (os.environ if environ is None else environ).get(ENV, "")
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in FAULTS:
            raise FaultSpecError(f"{ENV}: unknown or malformed fault {item[:60]!r}; known: {', '.join(FAULTS)} "
                                 "(each as name=value)")
        out[name] = value
    return out


def get(name: str, environ: dict[str, str] | None = None) -> str | None:
    if name not in FAULTS:
        raise KeyError(f"no fault named {name!r}")  # a programming error: add it to FAULTS
    return active(environ).get(name)


def get_int(name: str, default: int = 0, environ: dict[str, str] | None = None) -> int:
    value = get(name, environ)
    return default if value in (None, "") else int(value)


def get_float(name: str, default: float = 0.0, environ: dict[str, str] | None = None) -> float:
    value = get(name, environ)
    return default if value in (None, "") else float(value)


def encode(**faults: object) -> dict[str, str]:
    """The environment that switches `faults` on: encode(fail_at_step=3, fail_rank=1)."""
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise KeyError(f"no fault named {sorted(unknown)}")
    return {ENV: ",".join(f"{k}={v}" for k, v in faults.items())}


def crash_schedule(mtbf_s: float, seed: int, world: int) -> Iterator[tuple[int, float, int]]:
    """(number, seconds after the run's first step, victim rank) of crash_mtbf_s's crashes, endless: one seeded
    Poisson process for the whole run, the same on every rank and in every attempt."""
    rng, t, n = random.Random(seed), 0.0, 0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        n += 1
        yield n, t, rng.randrange(world)


def crash_dir(run_dir: Path) -> Path:
    """Where the crash fault keeps its clock (`origin`: the first step's wall time) and one file per crash spent."""
    return Path(run_dir) / "faults"


def start_crash_clock(run_dir: Path) -> None:
    """The run's first step begins: crash_mtbf_s's clock starts (once; a resumed attempt keeps the first)."""
    if not get_float("crash_mtbf_s"):
        return
    d = crash_dir(run_dir)
    d.mkdir(exist_ok=True)
    origin = d / "origin"
    if not origin.exists():
        tmp = d / f"origin.{os.getpid()}"
        tmp.write_text(repr(time.time()))
        os.replace(tmp, origin)


def arm_crashes(run_dir: Path, rank: int, world: int) -> None:
    """Under crash_mtbf_s, a thread that SIGKILLs this rank at its crashes' times. A crash already due when the
    process starts (it fell in a restart, with no rank up to take it) is spent at once: the restart starts over."""
    mtbf = get_float("crash_mtbf_s")
    if not mtbf:
        return
    seed = get_int("crash_seed")

    def run() -> None:
        d = crash_dir(run_dir)
        while not (d / "origin").exists():  # the first attempt: crashes start with its first step
            time.sleep(0.05)
        origin = float((d / "origin").read_text())
        for n, t, victim in crash_schedule(mtbf, seed, world):
            spent = d / f"crash-{n}"
            if victim != rank or spent.exists():  # another rank's, or it ended an earlier attempt
                continue
            time.sleep(max(0.0, origin + t - time.time()))
            spent.write_text(json.dumps({"rank": rank, "time": time.time(), "due": origin + t}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=run, name="trainctl-crash-fault", daemon=True).start()


def crash_record(run_dir: Path) -> tuple[float, list[float]]:
    """(the crash clock's origin, the wall-clock times at which crashes killed a rank, ascending) of a run that
    ran under crash_mtbf_s."""
    d = crash_dir(run_dir)
    struck = sorted(json.loads(p.read_text())["time"] for p in d.glob("crash-*"))
    return float((d / "origin").read_text()), struck


def main(argv: list[str]) -> int:
    """`python -m trainctl.runtime.train.faults get NAME`: the value (or nothing), for the Slurm batch script."""
    if len(argv) != 2 or argv[0] != "get" or argv[1] not in FAULTS:
        print(f"usage: python -m trainctl.runtime.train.faults get {{{'|'.join(FAULTS)}}}", file=sys.stderr)
        return 2
    print(get(argv[1]) or "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

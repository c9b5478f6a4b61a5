"""Test-only fault injection behind one switch: TRAINCTL_FAULTS (docs/ARCHITECTURE.md, "Fault injection").

    TRAINCTL_FAULTS="fail_at_step=3,fail_rank=1"

Production code asks `get`/`get_int`/`get_float` for a fault by name and never reads the environment for it
itself. An unknown name is an error, so a typo cannot silently switch a test's fault off. No torch here.
"""

from __future__ import annotations

import os
import sys

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
    "stop_after_step": "checkpoint after step N, then stop as if signalled (exit 0)",
    "host_memory": "bytes of host memory the TP-reshard check believes are available",
    "nan_at_step": "N or N-M: the steps that read batch N (..M) get a NaN gradient on `nan_rank` (the "
                   "divergence guard must skip them); tied to the data position, so a rollback that skips "
                   "the window does not meet it again",
    "nan_rank": "the rank whose gradients nan_at_step poisons (default: the last rank)",
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


def main(argv: list[str]) -> int:
    """`python -m trainctl.runtime.train.faults get NAME`: the value (or nothing), for the Slurm batch script."""
    if len(argv) != 2 or argv[0] != "get" or argv[1] not in FAULTS:
        print(f"usage: python -m trainctl.runtime.train.faults get {{{'|'.join(FAULTS)}}}", file=sys.stderr)
        return 2
    print(get(argv[1]) or "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

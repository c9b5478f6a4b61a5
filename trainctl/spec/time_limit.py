"""A Slurm time limit (cluster.time) in seconds, and the stop warning's share of it (launcher.grace_s).

Slurm sends the warning signal grace seconds before the limit (`--signal=B:USR1@GRACE`), counted from the
start of every attempt: a grace as long as the limit stops each attempt as it starts, and a large share of
it leaves most of every allocation unused. No torch, no Slurm: `validate`, `plan` and `launch` use it.
"""

from __future__ import annotations

import re

from trainctl.units import dur

UNLIMITED_S = 10**12  # UNLIMITED / infinite: longer than any grace
GRACE_WARN_SHARE = 0.25  # a grace above this share of the limit leaves too little of each attempt for training
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def seconds(text: str) -> int | None:
    """Slurm's time formats (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in seconds; None if malformed."""
    t = text.strip()
    if t.upper() in ("UNLIMITED", "INFINITE"):
        return UNLIMITED_S
    m = _TIME.fullmatch(t)
    if not m:
        return None
    days, a, b, c = (int(x) if x is not None else None for x in m.groups())
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        h, mi, s = a or 0, b or 0, c or 0
    elif c is not None:  # HH:MM:SS
        h, mi, s = a or 0, b or 0, c
    elif b is not None:  # MM:SS
        h, mi, s = 0, a or 0, b
    else:  # minutes
        h, mi, s = 0, a or 0, 0
    return ((days or 0) * 24 + h) * 3600 + mi * 60 + s


def limit_s(time: str | None) -> int | None:
    """cluster.time in seconds; None when unset or malformed (the rules name a malformed one)."""
    return None if time is None else seconds(time)


def grace_warning(time: str | None, grace_s: int) -> str | None:
    """The warning takes a large share of every attempt: the ranks are told to stop this early. (A grace as
    long as the limit is an error of the spec rules.)"""
    limit = limit_s(time)
    if limit is None or grace_s >= limit or grace_s <= GRACE_WARN_SHARE * limit:
        return None
    return (f"launcher.grace_s = {grace_s} is {grace_s / limit:.0%} of cluster.time = {time!r} ({dur(limit)}): "
            f"every attempt is told to checkpoint and stop after {dur(limit - grace_s)}, and the last "
            f"{dur(grace_s)} of its allocation go unused; lower launcher.grace_s (enough to save a checkpoint) "
            "or raise cluster.time")

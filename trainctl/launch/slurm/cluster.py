"""What the cluster offers (sinfo) and what would make a job impossible on it. No torch.

Checked before anything is submitted (and shown by --dry-run), so a job that could never start is refused
with the field to change, instead of waiting in the queue forever.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainctl.errors import RunError, UsageError
from trainctl.launch.slurm.tools import run_slurm
from trainctl.spec import RunSpec, time_limit


@dataclass(frozen=True)
class NodeInfo:
    partition: str
    default: bool
    available: str  # up/down/drain/inact
    max_time_min: int | None  # None: UNLIMITED
    node: str
    state: str
    gpus: int
    cpus: int


SINFO_FORMAT = "%P|%a|%l|%N|%t|%G|%c"  # partition(* = default)|avail|timelimit|node|state|gres|cpus


def parse_time(text: str) -> int | None:
    """Slurm time limit -> minutes (rounded up); None if malformed. UNLIMITED/infinite -> a huge number."""
    total_s = time_limit.seconds(text)
    if total_s is None:
        return None
    return 10**9 if total_s == time_limit.UNLIMITED_S else -(-total_s // 60)


def parse_gres_gpus(gres: str) -> int:
    """'gpu:4', 'gpu:a100:8(S:0-1)', 'gpu:2,shard:4' -> GPUs; '(null)' -> 0."""
    total = 0
    for item in gres.split(","):
        item = re.sub(r"\(.*?\)", "", item)
        parts = item.split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def parse_sinfo(text: str) -> list[NodeInfo]:
    out = []
    for line in text.splitlines():
        f = line.strip().split("|")
        if len(f) != 7:
            continue
        part, avail, limit, node, state, gres, cpus = f
        out.append(NodeInfo(partition=part.rstrip("*"), default=part.endswith("*"), available=avail,
                            max_time_min=parse_time(limit) if limit not in ("", "n/a") else None,
                            node=node, state=state, gpus=parse_gres_gpus(gres),
                            cpus=int(cpus) if cpus.isdigit() else 0))
    return out


def query_sinfo() -> list[NodeInfo]:
    proc = run_slurm("sinfo", "-h", "-N", "-o", SINFO_FORMAT)
    if proc.returncode != 0:
        raise RunError(f"sinfo failed: {proc.stderr.strip() or proc.stdout.strip()}",
                       hint="is slurmctld up? try `sinfo`")
    return parse_sinfo(proc.stdout)


DEAD_STATES = ("down", "drain", "drng", "fail", "maint", "unk", "npc", "futr", "inval")


def _up(n: NodeInfo) -> bool:
    return not n.state.rstrip("*~#!%$@^-").startswith(DEAD_STATES)


def partition_of(spec: RunSpec, nodes: list[NodeInfo]) -> str | None:
    """The partition the job goes to: cluster.partition, or the cluster's default one (None: it has none)."""
    if spec.cluster.partition is not None:
        return spec.cluster.partition
    default = sorted({n.partition for n in nodes if n.default})
    return default[0] if default else None


def check_cluster(spec: RunSpec, nodes: list[NodeInfo]) -> list[str]:
    """What would make this job impossible on this cluster: each a message naming the field and the fix."""
    c = spec.cluster
    parts = sorted({n.partition for n in nodes})
    name = partition_of(spec, nodes)
    if name is None:
        return [f"cluster.partition is not set and the cluster has no default partition; set "
                f"cluster.partition to one of: {', '.join(parts)}"]
    mine = [n for n in nodes if n.partition == name]
    if not mine:
        return [f"cluster.partition = {name!r}: no such partition; use one of: {', '.join(parts) or '(none)'}"]
    problems = []
    where = f"partition {name!r}" + (" (the default)" if c.partition is None else "")
    if mine[0].available != "up":
        problems.append(f"{where} is {mine[0].available}, jobs will not start; pick another cluster.partition")
    count = len({n.node for n in mine})
    usable = {n.node for n in mine if _up(n)}
    if c.nodes > count:
        problems.append(f"cluster.nodes = {c.nodes} but {where} has {count} node(s); lower cluster.nodes or pick "
                        f"a bigger partition")
    elif c.nodes > len(usable):
        problems.append(f"cluster.nodes = {c.nodes} but only {len(usable)} node(s) of {where} are up; the job "
                        "would wait until nodes return (lower cluster.nodes or pick another partition)")
    if c.gpu != "cpu":
        with_gpus = {n.node for n in mine if n.gpus >= c.gpus_per_node}
        most = max((n.gpus for n in mine), default=0)
        if len(with_gpus) < c.nodes:
            problems.append(f"cluster.gpus_per_node = {c.gpus_per_node} but {where} has "
                            f"{len(with_gpus)} node(s) with that many GPUs (at most {most} per node, from gres); "
                            "lower cluster.gpus_per_node or pick a GPU partition")
    limit = mine[0].max_time_min
    if c.time is not None and limit is not None:
        want = parse_time(c.time)
        if want is not None and want > limit:
            problems.append(f"cluster.time = {c.time!r} is over {where}'s limit of {_fmt_minutes(limit)}; lower "
                            "cluster.time (the run requeues itself at the limit and resumes) or pick another "
                            "partition")
    return problems


def too_few_left(spec: RunSpec, nodes: list[NodeInfo], excluded: list[str]) -> str | None:
    """Why the spec's job could not start without `excluded` (and cluster.exclude), or None: the nodes of its
    partition that are up, less those, must still hold cluster.nodes."""
    name = partition_of(spec, nodes)
    out = set(excluded) | {x for x in (spec.cluster.exclude or "").split(",") if x}
    usable = {n.node for n in nodes if n.partition == name and _up(n)}
    left = usable - out
    if len(left) >= spec.cluster.nodes:
        return None
    return (f"partition {name!r} would keep {len(left)} usable node(s) without {', '.join(sorted(out & usable))}, "
            f"and cluster.nodes = {spec.cluster.nodes}")


def _fmt_minutes(m: int) -> str:
    d, rest = divmod(m, 24 * 60)
    h, mi = divmod(rest, 60)
    return f"{d}-{h:02d}:{mi:02d}:00" if d else f"{h:02d}:{mi:02d}:00"


def require_cluster_fits(spec: RunSpec) -> None:
    problems = check_cluster(spec, query_sinfo())
    if problems:
        raise UsageError("\n".join(problems), hint="`sinfo` shows the partitions, nodes, GPUs and time limits")


"""Is the checkpoint directory of a multi-node run on storage every node sees? No torch.

Every rank writes its shard of a checkpoint and any rank may read any shard at a resume on another layout or
other nodes, so a multi-node run needs the directory on a shared filesystem. From the launching machine we
cannot prove it is shared, but two cases are certainly not: a RAM-backed filesystem (tmpfs, ramfs: per node,
and gone at reboot) found in /proc/mounts, and the paths clusters conventionally keep node-local (/tmp,
/var/tmp, /dev/shm, /run, /local, /scratch/local, /lscratch, /mnt/local, /raid, /nvme).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainctl.checkpoint import resolve_checkpoint_dir

if TYPE_CHECKING:
    from trainctl.spec import RunSpec

WARNING_CODE = "CHECKPOINT_NODE_LOCAL"  # plan's warning; launch and resume say it in their check before training
RAM_FILESYSTEMS = ("tmpfs", "ramfs")
NODE_LOCAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/local", "/scratch/local", "/lscratch",
                       "/mnt/local", "/raid", "/nvme")


def mount_of(path: Path, mounts: str) -> tuple[str, str] | None:
    """(mount point, filesystem type) of the longest mount point containing `path`, from /proc/mounts text."""
    best: tuple[str, str] | None = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (path == Path(point) or Path(point) in path.parents) and (best is None or len(point) > len(best[0])):
            best = (point, fields[2])
    return best


def _mounts() -> str:
    try:
        return Path("/proc/mounts").read_text()
    except OSError:
        return ""


def storage_problem(spec: RunSpec, run_dir: Path, mounts: str | None = None) -> str | None:
    """One line when a multi-node run would checkpoint to node-local storage; None otherwise."""
    if spec.cluster.nodes < 2 or not (spec.checkpoint.every_steps or spec.checkpoint.every_minutes):
        return None
    ckdir = resolve_checkpoint_dir(run_dir, spec).absolute()
    where = None
    mount = mount_of(ckdir.resolve(), _mounts() if mounts is None else mounts)  # symlinks of what exists followed
    if mount is not None and mount[1] in RAM_FILESYSTEMS:
        where = f"a {mount[1]} (RAM, per node) mounted at {mount[0]}"
    elif any(ckdir == Path(p) or Path(p) in ckdir.parents for p in NODE_LOCAL_PREFIXES):
        where = "a path clusters keep node-local"
    if where is None:
        return None
    return (f"checkpoint directory {ckdir} is on {where}: each of the {spec.cluster.nodes} nodes would keep only its "
            "own shards and a restart on other nodes could not load them; set checkpoint.dir to a shared "
            "filesystem (Lustre, GPFS, NFS, ...)")

"""A multi-node run's checkpoint directory on node-local storage is named before a GPU-hour is spent
(checkpoint/storage.py): in `plan` when checkpoint.dir is given, at `launch`/`resume` for the resolved one."""

from __future__ import annotations

from pathlib import Path

from cli_utils import trainctl
from paths import REPO

from trainctl.checkpoint.storage import mount_of, storage_problem
from trainctl.plan.plan import build_plan
from trainctl.spec import load_spec

LLAMA_8B = REPO / "recipes" / "llama3-8b.yaml"  # 4 nodes, checkpoint.dir /shared/ckpt/llama3-8b
MOUNTS = """/dev/sda1 / ext4 rw,relatime 0 0
tmpfs /scratch tmpfs rw,size=1g 0 0
fs1:/export /shared nfs4 rw,vers=4.2 0 0
lustre@o2ib:/work /shared/lustre lustre rw 0 0
"""


def test_mount_of_takes_the_longest_mount_point():
    assert mount_of(Path("/shared/lustre/run/ck"), MOUNTS) == ("/shared/lustre", "lustre")
    assert mount_of(Path("/shared/x"), MOUNTS) == ("/shared", "nfs4")
    assert mount_of(Path("/sharedX/x"), MOUNTS) == ("/", "ext4")  # a prefix of the name is not a parent
    assert mount_of(Path("/scratch/ck"), MOUNTS) == ("/scratch", "tmpfs")


def test_node_local_checkpoint_dirs_of_a_multi_node_run():
    def problem(ckdir: str, *sets: str) -> str | None:
        spec = load_spec(LLAMA_8B, overrides=[f"checkpoint.dir={ckdir}", *sets])
        return storage_problem(spec, Path("/shared/runs/x"), mounts=MOUNTS)

    ram = problem("/scratch/ck")
    assert ram is not None and "on a tmpfs (RAM, per node) mounted at /scratch" in ram and "4 nodes" in ram
    assert "node-local" in (problem("/tmp/ck") or "") and "node-local" in (problem("/raid/ck") or "")
    assert problem("/shared/lustre/ck") is None and problem("/shared/ck") is None
    assert problem("/tmp/ck", "cluster.nodes=1", "parallel.dp=4") is None  # one node: local disk is fine
    assert problem("/tmp/ck", "checkpoint.every_steps=null") is None  # no checkpoints, nothing to share


def test_plan_and_launch_name_a_node_local_checkpoint_dir(tmp_path):
    j = build_plan(load_spec(LLAMA_8B, overrides=["checkpoint.dir=/dev/shm/ck"])).to_json()
    (w,) = [w for w in j["warnings"] if w["code"] == "CHECKPOINT_NODE_LOCAL"]
    assert "/dev/shm/ck is on a tmpfs" in w["message"]
    assert not [w for w in build_plan(load_spec(LLAMA_8B)).to_json()["warnings"]
                if w["code"] == "CHECKPOINT_NODE_LOCAL"]
    # launch, dry run: the default checkpoint directory lies in the run directory, here under /tmp
    run = Path("/tmp") / tmp_path.name / "run"
    p = trainctl("launch", str(LLAMA_8B), "--dry-run", "--run-dir", str(run), "--set", "checkpoint.dir=null",
                 "--set", "data.synthetic=true", "--set", "data.path=null")
    assert p.returncode == 0, p.stderr
    assert f"warning: checkpoint directory {run}/checkpoints is on a" in " ".join((p.stdout + p.stderr).split())

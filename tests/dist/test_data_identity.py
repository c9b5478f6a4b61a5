"""The identity of the data a run trains on (trainctl.data.identity): recorded in job.json and in every
checkpoint, checked by `trainctl resume` (a changed file is refused with one line naming it;
--accept-data-change continues knowingly and records it) and by the ranks at every start; a token file truncated
under a running rank ends the run naming it, not with "killed by SIGBUS"."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_utils import TRAINCTL, trainctl
from resume_utils import events, wait_for_step
from spec_utils import write_spec
from trainer_utils import ROOT, rank_env

from trainctl.checkpoint import latest_valid, list_checkpoints
from trainctl.runtime.train import faults

SIZE = 4_000_000  # bytes: 2M uint16 tokens, so a step's windows fall past 100 kB all but surely


def identity_of(entries: list[dict]) -> list[tuple[str, int, str]]:
    return [(d["path"], d["size"], d["sha256"]) for d in entries]


@pytest.mark.slow
def test_a_changed_token_file_is_named_under_a_running_rank_at_resume_and_at_a_restart(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.bin"
    original = np.random.default_rng(0).integers(0, 256, SIZE // 2, dtype="<u2").tobytes()
    tokens.write_bytes(original)
    trained = [(str(tokens), SIZE, hashlib.sha256(original).hexdigest())]
    run = tmp_path / "run"
    one_rank = {"parallel": {"dp": 1}, "cluster": {"gpus_per_node": 1}, "train": {"steps": 400},
                "checkpoint": {"every_steps": 2, "keep_last": 5}, "data": {"synthetic": False, "path": str(tokens)}}
    spec = write_spec(tmp_path / "spec.yaml", one_rank)
    # each save takes 3 s more before its commit, so the failure comes while a save is in flight
    launch = subprocess.Popen([*TRAINCTL, "launch", str(spec), "--run-dir", str(run)], cwd=ROOT,
                              env={**os.environ, **faults.encode(slow_write_s=3)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(run, 3)
        with open(tokens, "r+b") as f:  # truncated under the rank, which reads it every step
            f.truncate(100_000)
        out, _ = launch.communicate(timeout=300)
    finally:
        launch.kill()
    assert launch.returncode == 1, out[-3000:]
    assert (f"exception: data file {tokens} was truncated under the running run: it is 100,000 bytes, 4,000,000 "
            "when this rank started") in out, out[-3000:]
    assert "SIGBUS" not in out

    # the run and every checkpoint record the file it trained on
    assert identity_of(json.loads((run / "job.json").read_text())["data"]) == trained
    # the save in flight when the run failed (of a step that completed) committed before the exit: none torn
    saved = [i for i in list_checkpoints(run / "checkpoints") if i.valid]
    assert saved and all(identity_of(i.meta["data"]) == trained for i in saved)
    assert not list((run / "checkpoints").glob("*.tmp-*"))
    step = latest_valid(run / "checkpoints").step

    # resume refuses the truncated file, then another file of the same size, launching nothing
    r = trainctl("resume", str(run))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"data file {tokens} changed since checkpoint step {step}: size 4,000,000 -> 100,000 bytes" in r.stderr
    other = np.random.default_rng(1).integers(0, 256, SIZE // 2, dtype="<u2").tobytes()
    tokens.write_bytes(other)
    r = trainctl("resume", str(run))
    assert r.returncode == 2 and f"data file {tokens} changed since checkpoint step {step}: same size, other " \
                                  "content" in r.stderr, r.stderr
    assert len(json.loads((run / "job.json").read_text())["attempts"]) == 1

    # ranks started again without `trainctl resume` (as a Slurm requeue or a torchrun restart starts them)
    r = subprocess.run(["bash", str(run / "launch.sh")], capture_output=True, text=True, timeout=300, env=rank_env())
    assert r.returncode != 0
    failure = [e for e in events(run) if e["event"] == "failure" and e["rank"] == 0][-1]  # rank 0 checks the data
    assert failure["error"].startswith(f"data file {tokens} changed since the run recorded it (job.json): same "
                                       "size, other content"), failure

    # another path is a deliberate spec change, said as such: no refusal
    moved = tmp_path / "moved.bin"
    moved.write_bytes(original)
    r = trainctl("resume", str(run), "--set", f"data.path={moved}", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"spec change: data.path: '{tokens}' -> '{moved}'" in r.stdout and "data change" not in r.stdout

    # knowingly: the change is recorded, and the run and its new checkpoints record the new file
    r = trainctl("resume", str(run), "--accept-data-change", "--set", f"train.steps={step + 2}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"data change (--accept-data-change): {tokens}: same size, other content" in " ".join(r.stdout.split())
    changed = [e for e in events(run) if e["event"] == "data_changed"]
    assert len(changed) == 1 and changed[0]["changes"][0].startswith(f"{tokens}: same size, other content")
    now = [(str(tokens), SIZE, hashlib.sha256(other).hexdigest())]
    assert identity_of(json.loads((run / "job.json").read_text())["data"]) == now
    assert identity_of(latest_valid(run / "checkpoints").meta["data"]) == now


def test_a_token_file_rewritten_in_place_with_its_size_and_mtime_restored_is_refused(tmp_path: Path) -> None:
    """Every token changed, the size, mtime and inode as before (the stat key of the cached hash): the sampled
    hash read at every check differs, so the file is hashed again and refused, by `resume` and by the ranks
    started again without it (a Slurm requeue runs launch.sh's command) (was: trained on, no word)."""
    tokens = tmp_path / "tokens.bin"
    original = np.random.default_rng(0).integers(0, 256, 3_000_000, dtype="<u2").tobytes()  # 6 MB: sampled
    tokens.write_bytes(original)
    spec = write_spec(tmp_path / "spec.yaml", {"train": {"steps": 4}, "checkpoint": {"every_steps": 2},
                                               "data": {"synthetic": False, "path": str(tokens)}})
    run = tmp_path / "run"
    r = trainctl("launch", str(spec), "--run-dir", str(run), env=faults.encode(stop_after_step=2))
    assert r.returncode == 75, r.stdout[-2000:] + r.stderr[-2000:]

    r = trainctl("resume", str(run), "--dry-run")  # judged unchanged, and said how, with what it cannot see
    assert r.returncode == 0, r.stderr
    assert ("data: 1 token file(s) unchanged since checkpoint step 2 (size, mtime and inode, and a sha256 of 64 "
            "blocks of 64 KiB spread over each; not seen: an in-place edit that restores size and mtime and touches "
            "none of those blocks)") in " ".join(r.stdout.split()), r.stdout

    st = os.stat(tokens)
    with open(tokens, "r+b") as f:  # in place: the same inode
        f.write(bytes((b + 1) % 256 if i % 2 == 0 else b for i, b in enumerate(original)))  # every token
    os.utime(tokens, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(tokens).st_size, os.stat(tokens).st_mtime_ns, os.stat(tokens).st_ino) == \
        (st.st_size, st.st_mtime_ns, st.st_ino)

    r = trainctl("resume", str(run))
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"data file {tokens} changed since checkpoint step 2: same size, other content" in r.stderr, r.stderr
    r = subprocess.run(["bash", str(run / "launch.sh")], capture_output=True, text=True, timeout=300, env=rank_env())
    assert r.returncode != 0
    failure = [e for e in events(run) if e["event"] == "failure"][-1]
    assert failure["error"].startswith(f"data file {tokens} changed since the run recorded it (job.json): same "
                                       "size, other content"), failure

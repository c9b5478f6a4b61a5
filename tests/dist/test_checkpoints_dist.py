"""Checkpoint save/load with torch: real multi-process runs (DP=2, reshard to 1, SIGKILL mid-save) and
in-process single-rank cases (corruption, retention, unwritable or full directories, async snapshot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from paths import REPO as ROOT  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # noqa: E402
from trainer_utils import fork_ranks  # noqa: E402

from trainctl.checkpoint import MARKER, CheckpointError, list_checkpoints, stale_dirs, step_dirname  # noqa: E402
from trainctl.runtime.checkpoint.storage import CheckpointManager, rng_state, set_rng_state  # noqa: E402
from trainctl.runtime.train import faults  # noqa: E402

WORKER = str(Path(__file__).with_name("ckpt_worker.py"))
OPTS = StateDictOptions(flatten_optimizer_state_dict=True)
# pytest resets warning filters per test; the runtime module's own filter is for real runs.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def run_worker(nproc: int, *args: str, check: bool = True, env: dict[str, str] | None = None):
    if nproc > 1:
        out = fork_ranks(nproc, [str(WORKER), *args], env=env)
    else:
        out = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True, cwd=ROOT, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def load_pt(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k  # bitwise
        else:
            assert a[k] == b[k], k


@pytest.mark.slow
def test_dp2_save_load_bitwise_async_snapshot_and_reshard_to_one(tmp_path):
    ck, out = tmp_path / "ck", tmp_path / "out"
    # ~70 MB of state (weights + AdamW moments); step 4 is saved async while training goes on to 6.
    run_worker(2, "train", str(ck), str(out), "--hidden", "2400", "--steps", "6", "--save-at", "2,4",
             "--async-at", "4")
    timing = json.loads((out / "timing-rank0.json").read_text())
    print(f"\nsync save call {timing['save-2']['call_s']:.3f}s, async save call {timing['save-4']['call_s']:.3f}s "
          f"(background write {timing['last_async_stats']['write_s']:.3f}s)")
    assert [i.step for i in list_checkpoints(ck) if i.valid] == [2, 4]

    run_worker(2, "load", str(ck), str(tmp_path / "l2"), "--hidden", "2400")  # latest valid = 4, same layout
    for r in (0, 1):
        got, want = load_pt(tmp_path / "l2" / f"loaded-rank{r}.pt"), load_pt(out / f"saved-4-rank{r}.pt")
        assert got["step"] == 4 and got["extra"] == {"step": 4, "tokens": 64} and got["meta"] == {"tokens": 64}
        assert_same_state(got["state"], want["state"])  # the state at save time, not after steps 5-6
        rs, ws = got["rank_state"], want["rank_state"]
        assert torch.equal(rs["torch"], ws["torch"]) and rs["python"] == ws["python"] and rs["data_pos"] == 64

    run_worker(1, "load", str(ck), str(tmp_path / "l1"), "--hidden", "2400", "--step", "2")  # 2 ranks → 1
    got, want = load_pt(tmp_path / "l1" / "loaded-rank0.pt"), load_pt(out / "saved-2-rank0.pt")
    assert_same_state(got["state"], want["state"])
    assert got["rank_state"] is None  # world size changed: per-rank RNG streams do not map


@pytest.mark.slow
def test_fsdp2_async_save_reshards_to_one_rank_and_back(tmp_path):
    ck, out = tmp_path / "ck", tmp_path / "out"
    run_worker(2, "train", str(ck), str(out), "--fsdp", "--steps", "5", "--save-at", "2,4", "--async-at", "4")
    want = load_pt(out / "saved-4-rank0.pt")["state"]  # full tensors gathered at save time
    run_worker(1, "load", str(ck), str(tmp_path / "l1"))  # DTensor shards → one plain model
    assert_same_state(load_pt(tmp_path / "l1" / "loaded-rank0.pt")["state"], want)
    run_worker(2, "load", str(ck), str(tmp_path / "l2"), "--fsdp")  # and back into FSDP2 at DP=2
    for r in (0, 1):
        assert_same_state(load_pt(tmp_path / "l2" / f"loaded-rank{r}.pt")["state"], want)


@pytest.mark.slow
def test_sigkill_during_async_save_leaves_previous_as_latest(tmp_path):
    ck, out = tmp_path / "ck", tmp_path / "out"
    res = run_worker(2, "train", str(ck), str(out), "--steps", "6", "--save-at", "2,4", "--async-at", "4",
                   "--slow-at", "4", "--kill-rank", "1", "--kill-after", "1", check=False)
    assert res.returncode != 0 and (out / "killing").exists(), res.stderr[-2000:]
    infos = list_checkpoints(ck)
    assert [(i.step, i.valid) for i in infos] == [(2, True), (4, False)]
    assert "incomplete" in infos[1].reason and not (infos[1].path / MARKER).exists()
    assert not (ck / step_dirname(4)).exists()
    run_worker(2, "load", str(ck), str(tmp_path / "l2"))
    got = load_pt(tmp_path / "l2" / "loaded-rank0.pt")
    assert got["step"] == 2
    assert_same_state(got["state"], load_pt(out / "saved-2-rank0.pt")["state"])
    assert stale_dirs(ck) == []  # the next start removed the torn staging directory


# --- single process, in pytest ----------------------------------------------------------------

def tiny(seed: int = 0, hidden: int = 16) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step_(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(4, 8)).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, optim, options=OPTS)
    return {"model": msd, "optim": osd}


def flat_clone(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, optim, options=OPTS)
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in {**msd, **osd}.items()}


def test_async_save_snapshots_at_call_time(tmp_path, monkeypatch):
    model, optim = tiny()
    step_(model, optim)
    before = flat_clone(model, optim)
    mgr = CheckpointManager(tmp_path, keep_last=3, async_save=True)
    monkeypatch.setenv(faults.ENV, faults.encode(slow_write_s=1.0)[faults.ENV])
    rng = torch.get_rng_state()
    mgr.save(1, state(model, optim), {"rng": rng})
    assert mgr.in_flight()
    for _ in range(3):
        step_(model, optim)  # mutate params and moments while the write is in flight
    assert not (tmp_path / step_dirname(1)).exists()  # not committed yet
    mgr.wait()
    monkeypatch.delenv(faults.ENV)
    fresh, fopt = tiny(seed=7)
    st = state(fresh, fopt)
    info, rank_state = mgr.load(None, st)
    assert info.step == 1 and torch.equal(rank_state["rng"], rng)
    assert_same_state({**st["model"], **st["optim"]}, before)


def test_corrupt_newest_is_skipped_and_explicit_step_refused(tmp_path, capsys):
    model, optim = tiny()
    mgr = CheckpointManager(tmp_path, keep_last=10, async_save=False)
    snaps = {}
    for s in (1, 2, 3, 4):
        step_(model, optim)
        snaps[s] = flat_clone(model, optim)
        mgr.save(s, state(model, optim), meta={"s": s})
    (tmp_path / step_dirname(4) / MARKER).unlink()  # a deleted marker
    shard = next((tmp_path / step_dirname(3)).glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # a truncated shard
    shard2 = next((tmp_path / step_dirname(2)).glob("__0_*.distcp"))
    data = bytearray(shard2.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte: only the checksum sees it
    shard2.write_bytes(bytes(data))
    assert mgr.latest_valid().step == 2  # shallow: sizes still match
    err = capsys.readouterr().err
    assert "missing COMMITTED marker" in err and "truncated shard" in err
    fresh, fopt = tiny(seed=9)
    st = state(fresh, fopt)
    info, _ = mgr.load(None, st)
    assert info.step == 1 and "checksum mismatch" in capsys.readouterr().err
    assert_same_state({**st["model"], **st["optim"]}, snaps[1])
    with pytest.raises(CheckpointError, match="step 2 is invalid: checksum mismatch"):
        mgr.load(2, state(*tiny()))
    with pytest.raises(CheckpointError, match="step 3 is invalid: truncated shard"):
        mgr.load(3, state(*tiny()))


def test_shape_mismatch_is_refused(tmp_path):
    model, optim = tiny(hidden=16)
    step_(model, optim)
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, state(model, optim))
    with pytest.raises(CheckpointError, match=r"does not match this model: .*shape \(16, 8\), model has \(32, 8\)"):
        mgr.load(None, state(*tiny(hidden=32)))


@pytest.mark.parametrize("async_save", [False, True])
def test_retention_keeps_last_and_milestones(tmp_path, async_save):
    model, optim = tiny()
    mgr = CheckpointManager(tmp_path, keep_last=2, milestone_every=3, async_save=async_save)
    for s in range(1, 8):
        step_(model, optim)
        mgr.save(s, state(model, optim))
    mgr.wait()
    infos = list_checkpoints(tmp_path)
    assert [(i.step, i.milestone) for i in infos] == [(3, True), (6, True), (7, False)]
    assert all(i.valid for i in infos) and stale_dirs(tmp_path) == []


def test_resave_same_step_replaces_atomically(tmp_path):
    model, optim = tiny()
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(5, state(model, optim))
    step_(model, optim)
    want = flat_clone(model, optim)
    mgr.save(5, state(model, optim))  # a rewound run reaching step 5 again
    st = state(*tiny(seed=3))
    mgr.load(5, st)
    assert_same_state({**st["model"], **st["optim"]}, want)
    assert [i.step for i in list_checkpoints(tmp_path)] == [5] and stale_dirs(tmp_path) == []


def test_checkpoint_dir_that_is_a_file_fails_loudly(tmp_path):
    bad = tmp_path / "checkpoints"
    bad.write_text("not a directory")
    with pytest.raises(CheckpointError, match=f"checkpoint directory {bad} is not writable"):
        CheckpointManager(bad)
    with pytest.raises(CheckpointError, match="not writable"):
        CheckpointManager(bad / "sub")  # ENOTDIR: fails even as root


def test_read_only_directory_fails_loudly(tmpfs):
    ro = tmpfs("1m", ro=True)
    with pytest.raises(CheckpointError, match=f"checkpoint directory {ro / 'ck'} is not writable.*Read-only"):
        CheckpointManager(ro / "ck")


@pytest.mark.parametrize("async_save", [False, True])
def test_full_directory_fails_loudly_and_keeps_previous(tmpfs, async_save):
    d = tmpfs("2m")
    model, optim = tiny(hidden=2000)  # ~0.3 MB of state per save
    mgr = CheckpointManager(d, keep_last=10, async_save=async_save)
    with pytest.raises(CheckpointError, match=rf"disk full: saving checkpoint step \d+ in {d} failed: .* free, "
                       r".* needed per checkpoint; newest valid checkpoint: step \d+ "):
        for s in range(1, 50):
            step_(model, optim)
            mgr.save(s, state(model, optim))  # async: a failed save surfaces at the next save()
    infos = list_checkpoints(d)
    saved = len(infos)
    assert saved >= 1 and [i.step for i in infos] == list(range(1, saved + 1)) and all(i.valid for i in infos)
    assert mgr.latest_valid().step == saved and stale_dirs(d) == []  # the failed staging dir was removed


def test_a_failed_async_save_is_known_before_the_next_save(tmpfs):
    """failed() tells the training loop, without waiting, that the save in flight failed (it stops there);
    wait() then raises the error once."""
    d = tmpfs("1m")
    model, optim = tiny(hidden=2000)  # ~0.3 MB of state per save: the 4th cannot fit
    mgr = CheckpointManager(d, keep_last=10, async_save=True)
    for s in range(1, 5):
        assert not mgr.failed()
        mgr.save(s, state(model, optim))
        while mgr.in_flight():
            time.sleep(0.01)
        if mgr.failed():
            break
    assert mgr.failed(), [i.step for i in list_checkpoints(d)]
    with pytest.raises(CheckpointError, match=rf"disk full: saving checkpoint step {s} in {d}"):
        mgr.wait()
    assert not mgr.failed()
    mgr.wait()  # raised once


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    import random

    import numpy as np

    model, optim = tiny()
    mgr = CheckpointManager(tmp_path, async_save=True)
    mgr.save(1, state(model, optim), rng_state())
    want = (random.random(), np.random.rand(), torch.rand(3))
    mgr.wait()
    random.random(), np.random.rand(), torch.rand(5)  # move every stream on
    _, rs = mgr.load(None, state(*tiny(seed=4)))
    set_rng_state(rs)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])

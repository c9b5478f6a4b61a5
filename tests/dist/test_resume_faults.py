"""Resume under faults and changed allocations, through the real trainer: a rank SIGKILLed mid async save,
damaged checkpoints, a different model, tp 2 -> 4 -> 1, an unusable checkpoint directory, DP 4 -> 2 (and PP)
changes, ep 2 -> 2 (dp 4, FSDP) -> 1 (tp 2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from resume_utils import curve, events, ok, set_spec, spawn_ranks, stop_after, wait_all
from trainer_utils import ROOT, make_run, max_rel_diff, rank_env, run_trainer

from trainctl.checkpoint import MARKER, list_checkpoints, stale_dirs, step_dirname
from trainctl.runtime.train import faults

pytestmark = pytest.mark.slow


def last_occurrence(run: Path) -> list[tuple[int, float, float]]:
    """The curve a report shows: each step's last logged run (earlier runs of a step were replayed)."""
    by_step = {s: (s, loss, g) for s, loss, g in curve(run)}
    return [by_step[s] for s in sorted(by_step)]


def assert_layout_chain_stays_on_the_curve(tmp_path: Path, layouts: list[dict[str, Any]], what: str,
                                           env: dict[str, str] | None = None, **sections: dict[str, Any]) -> None:
    """Six steps with checkpoints every two: straight on one rank, and in layouts[0], [1], [2] for two steps
    each (each a resume with the next layout). The global batch is kept; every step's loss equals the
    straight run's to fp32 rounding (another layout sums in another order, so not bitwise)."""
    env = {"TRAINCTL_BUCKET_NUMEL": "20000", **(env or {})}
    sections = {"train": {"steps": 6}, "checkpoint": {"every_steps": 2}, **sections}
    straight, _ = make_run(tmp_path, "straight", **sections)
    ok(run_trainer(straight, 1, env=env, dump=False))
    run, _ = make_run(tmp_path, "changing", parallel=layouts[0], **sections)
    for i, layout in enumerate(layouts):
        if i:
            set_spec(run, parallel=layout)
        nproc = layout.get("tp", 1) * layout.get("cp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
        last = i == len(layouts) - 1
        ok(run_trainer(run, nproc, env=env if last else {**env, **stop_after(2 * i + 2)}, dump=False), str(layout))
    got, want = curve(run), curve(straight)
    assert [s for s, _, _ in got] == [1, 2, 3, 4, 5, 6]
    rel = max_rel_diff([x[1] for x in got], [x[1] for x in want])
    print(f"{what}: max relative loss difference to the uninterrupted run {rel:.2e}")
    assert rel <= 1e-5
    assert max_rel_diff([x[2] for x in got], [x[2] for x in want]) <= 1e-4
    resumes = [e for e in events(run) if e["event"] == "resume_from"]
    assert [(e["step"], e["same_layout"]) for e in resumes] == [(2, False), (4, False)]


def test_dp4_to_dp2_then_pp2_stays_on_the_curve(tmp_path: Path) -> None:
    """DP=4/ZeRO-1 -> DP=2/ZeRO-2 -> PP=2: more micro-batches per replica, the sharded optimizer state
    resharded by parameter name."""
    assert_layout_chain_stays_on_the_curve(tmp_path, [
        {"dp": 4, "zero": 1}, {"dp": 2, "zero": 2}, {"dp": 1, "zero": 0, "pp": 2}], "dp4 -> dp2 -> pp2")


TP_CHAINS = {
    # A vocab of 250 is padded to 250, 252, 250 rows; SwiGLU's fused gate-up, the fused QKV and their biases
    # are split per part; the untied head is vocab-sharded; ZeRO-1 moments are DP-chunked, FSDP's are row shards.
    "tp2-zero1 -> tp4 -> tp1-fsdp": (
        [{"tp": 2, "dp": 2, "zero": 1}, {"tp": 4, "dp": 1, "zero": 0}, {"tp": 1, "dp": 2, "zero": 3}],
        {"vocab": 250, "activation": "swiglu", "bias": True, "tied_embeddings": False}),
    # Tied embeddings across pipeline stages (one key on the first and last stage), interleaved chunks,
    # Llama-style blocks, a vocab of 254 (padded to 254, 254, 256), unequal stages (1 and 3 layers).
    "tp2-pp2-interleaved -> tp1-pp2-dp2-zero2 -> tp4": (
        [{"tp": 2, "pp": 2, "dp": 1, "schedule": "interleaved", "virtual_stages": 2},
         {"tp": 1, "pp": 2, "dp": 2, "zero": 2, "schedule": "1f1b", "virtual_stages": 1, "stage_layers": [1, 3]},
         {"tp": 4, "pp": 1, "dp": 1, "zero": 0, "stage_layers": None}],
        {"vocab": 254, "norm": "rmsnorm", "position": "rope", "activation": "swiglu"}),
}


@pytest.mark.parametrize("chain", list(TP_CHAINS))
def test_tp_change_reshards_and_stays_on_the_curve(tmp_path: Path, chain: str) -> None:
    layouts, model = TP_CHAINS[chain]
    # The second chain reads old shards in batches of 200 kB: several loads per rank, and a different number
    # on the two pipeline stages (the collective loads must still pair up).
    env = {"TRAINCTL_RESHARD_BATCH_BYTES": "200000"} if "pp2" in chain else {}
    assert_layout_chain_stays_on_the_curve(tmp_path, layouts, chain, model=model, env=env)


def test_ep_change_moves_experts_and_stays_on_the_curve(tmp_path: Path) -> None:
    """Experts are saved by global index: EP 2 / ZeRO-1 (each expert on one rank: its state unsliced) ->
    DP 4 / EP 2 / ZeRO-3 (experts row-sharded over an expert-DP mesh of 2) -> TP 2 + SP without EP (every
    expert on every rank, split over TP): every expert's weights and moments change hands twice."""
    model = {"norm": "rmsnorm", "position": "rope", "activation": "swiglu", "tied_embeddings": False,
             "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden": 64, "shared_experts": 1,
                     "aux_loss_coeff": 0.01, "z_loss_coeff": 0.001}}
    assert_layout_chain_stays_on_the_curve(tmp_path, [
        {"dp": 2, "ep": 2, "zero": 1}, {"dp": 4, "ep": 2, "zero": 3},
        {"tp": 2, "dp": 1, "ep": 1, "zero": 0, "sequence_parallel": True}], "ep2 -> dp4-ep2-fsdp -> tp2-sp",
        model=model)


def test_sigkill_mid_async_save_resumes_from_the_previous_checkpoint(tmp_path: Path) -> None:
    sections = {"train": {"steps": 8}, "checkpoint": {"every_steps": 2, "keep_last": 5}}
    straight, world = make_run(tmp_path, "straight", parallel={"dp": 2}, **sections)
    ok(run_trainer(straight, world, dump=False))
    run, _ = make_run(tmp_path, "killed", parallel={"dp": 2}, **sections)
    ck = run / "checkpoints"
    procs = spawn_ranks(run, 2, env={**faults.encode(slow_write_s=4), "TRAINCTL_TIMEOUT_S": "30"})
    try:  # wait until step 2 is committed and step 4 is being written (its staging dir exists)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            names = [p.name for p in ck.iterdir()] if ck.exists() else []
            if step_dirname(2) in names and any(n.startswith(step_dirname(4) + ".tmp-") for n in names):
                break
            assert all(p.poll() is None for p in procs), "a rank exited early"
            time.sleep(0.05)
        else:
            raise AssertionError("the async save of step 4 never started")
        os.kill(procs[1].pid, signal.SIGKILL)  # a node dies while the write is in flight
        time.sleep(0.5)
        procs[0].kill()
    finally:
        wait_all(procs, timeout=30)
    infos = list_checkpoints(ck)
    assert [(i.step, i.valid) for i in infos] == [(2, True), (4, False)], infos
    assert "incomplete" in (infos[1].reason or "")
    logged = [s for s, _, _ in curve(run)]
    r = run_trainer(run, 2, dump=False)  # the restart (what torchrun/Slurm would do)
    ok(r, "restart")
    assert "resumed from checkpoint step 2" in r.stdout
    resume = next(e for e in events(run) if e["event"] == "resume_from")
    assert resume["step"] == 2 and resume["replayed_steps"] == len([s for s in logged if s > 2])
    assert stale_dirs(ck) == []  # the torn staging directory was removed at start
    assert last_occurrence(run) == curve(straight)  # bitwise, replayed steps included


def run_plain(run: Path) -> subprocess.CompletedProcess[str]:
    """One rank without torchrun, so stderr and the exit status are the trainer's own."""
    return subprocess.run([sys.executable, "-m", "trainctl.runtime", str(run)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _run_with_checkpoints(tmp_path: Path, steps: int = 6) -> Path:
    run, world = make_run(tmp_path, "run", train={"steps": steps},
                          checkpoint={"every_steps": 2, "keep_last": 5, "async": False})
    ok(run_trainer(run, world, dump=False))
    return run


def test_truncated_shard_and_missing_marker_are_skipped_with_a_warning(tmp_path: Path) -> None:
    run = _run_with_checkpoints(tmp_path)
    ck = run / "checkpoints"
    assert [i.step for i in list_checkpoints(ck) if i.valid] == [2, 4, 6]
    shard = next((ck / step_dirname(6)).glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    (ck / step_dirname(4) / MARKER).unlink()
    set_spec(run, train={"steps": 8})
    r = run_trainer(run, 1, dump=False)
    ok(r)
    for text in ("skipping checkpoint", "truncated shard", "missing COMMITTED marker"):
        assert text in r.stderr, text
    skipped = {e["step"]: e["reason"] for e in events(run) if e["event"] == "checkpoint_skipped"}
    assert set(skipped) == {4, 6}
    assert next(e for e in events(run) if e["event"] == "resume_from")["step"] == 2
    assert [s for s, _, _ in curve(run)] == [1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 7, 8]  # 3-6 replayed, not lost


def test_other_model_shape_is_refused_before_training(tmp_path: Path) -> None:
    run = _run_with_checkpoints(tmp_path, steps=2)
    n = len(curve(run))
    set_spec(run, model={"hidden": 128}, train={"steps": 4})
    r = run_plain(run)
    assert r.returncode == 1
    assert "different model shape (model.hidden: checkpoint 64, this run 128" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr  # a known condition: one line with a hint
    assert len(curve(run)) == n  # refused before any step ran
    # a TP reshard that would not fit in host memory is refused up front (here: a node with 1 MB free)
    set_spec(run, model={"hidden": 64}, parallel={"tp": 2, "micro_batch": 4})
    r = run_trainer(run, 2, env=faults.encode(host_memory=10**6), dump=False)
    assert r.returncode == 1
    assert "resharding tp 1 -> 2 reads whole old TP shards (weights and moments) in batches" in r.stderr, \
        r.stderr[-2000:]
    assert "--set parallel.tp=1" in r.stderr  # (torchrun adds its own agent traceback after our line)
    assert len(curve(run)) == n


def test_unwritable_checkpoint_dir_fails_with_one_line_and_keeps_the_run_dir(tmp_path: Path) -> None:
    run, world = make_run(tmp_path, "run", train={"steps": 2}, checkpoint={"dir": str(tmp_path / "afile" / "ck")})
    (tmp_path / "afile").write_text("a file where the checkpoint directory should be")
    r = run_plain(run)
    assert r.returncode == 1
    line = next(x for x in r.stderr.splitlines() if "trainctl: rank 0 failed" in x)
    assert "is not writable" in line and "hint:" in line
    assert "Traceback" not in r.stderr
    assert (run / "spec.yaml").exists()
    assert [e["event"] for e in events(run)][-1] == "failure"


def test_read_only_checkpoint_dir_fails_loudly(tmp_path: Path, tmpfs) -> None:
    ro = tmpfs("1m", ro=True)
    run, world = make_run(tmp_path, "run", train={"steps": 2}, checkpoint={"dir": str(ro / "ck")})
    r = run_trainer(run, world, dump=False)
    assert r.returncode != 0 and "is not writable" in r.stderr and "Read-only" in r.stderr


def test_full_checkpoint_dir_fails_loudly_and_keeps_metrics(tmp_path: Path, tmpfs) -> None:
    full = tmpfs("1m")  # one checkpoint of the tiny model is ~2.6 MB
    run, world = make_run(tmp_path, "run", train={"steps": 6}, checkpoint={"dir": str(full), "every_steps": 2})
    r = run_trainer(run, world, dump=False)
    assert r.returncode != 0
    line = next(x for x in r.stderr.splitlines() if "trainctl: rank 0 failed" in x)
    assert f"disk full: saving checkpoint step 2 in {full} failed: " in line, r.stderr[-2000:]
    assert "needed per checkpoint; newest valid checkpoint: none" in line
    assert [s for s, _, _ in curve(run)][:2] == [1, 2]  # training data written before the failure is kept
    assert list_checkpoints(full) == [] and stale_dirs(full) == []


def test_torchrun_restart_resumes_by_itself(tmp_path: Path) -> None:
    """A rank fails in torchrun's first attempt; torchrun restarts the workers, which find the checkpoint."""
    from trainer_utils import TORCHRUN

    sections = {"train": {"steps": 6}, "checkpoint": {"every_steps": 2, "async": False}}
    straight, world = make_run(tmp_path, "straight", parallel={"dp": 2}, **sections)
    ok(run_trainer(straight, world, dump=False))
    run, _ = make_run(tmp_path, "restarted", parallel={"dp": 2}, **sections)
    env = rank_env({"TRAINCTL_TIMEOUT_S": "60", **faults.encode(fail_at_step=4, fail_rank=1, fail_attempt=0)})
    r = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", "-m", "trainctl.runtime",
                        str(run)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ok(r, "torchrun with one restart")
    resume = [e for e in events(run) if e["event"] == "resume_from"]
    assert [(e["step"], e["replayed_steps"]) for e in resume] == [(2, 1)]  # step 3 ran twice
    assert [s for s, _, _ in curve(run)] == [1, 2, 3, 3, 4, 5, 6]
    assert last_occurrence(run) == curve(straight)

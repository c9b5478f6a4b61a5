"""The divergence guard through real runs (torchrun, gloo, CPU; docs/design/trainer.md, "Divergence guard"):
lr=1e9 without clipping diverges from step 2 and stops with exit 3 keeping the last finite checkpoint (DP2
through `trainctl launch`, PP2 through `trainctl resume`); a NaN injected into one rank's gradients at one step
is skipped by every rank; with rollback the run reloads the checkpoint before the NaN window, skips that data
and completes."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_utils import trainctl
from json_utils import strict_loads
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from trainer_utils import make_run, metrics, run_trainer

from trainctl.checkpoint import list_checkpoints
from trainctl.errors import EXIT_DIVERGED
from trainctl.rundir.paths import read_jsonl
from trainctl.runtime.train import faults

pytestmark = pytest.mark.slow

DIVERGE = ["--set", "train.lr=1e9", "--set", "train.grad_clip=null"]


def events(run: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run / "events.jsonl") if e.get("event") == kind]


def checkpoint_state(path: Path, tmp: Path) -> dict[str, Any]:
    """A committed DCP checkpoint as one dict (model, optim, extra), read in this process."""
    out = tmp / f"{path.parent.parent.name}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"{part}.{k}": v for part in ("model", "optim") for k, v in state[part].items()
            if isinstance(v, torch.Tensor)}


def steps_of_rank_logs(run: Path) -> dict[int, int]:
    """rank -> the last step in its logs/steptimes-rank<N>.jsonl: where every rank really stopped."""
    out = {}
    for f in sorted((run / "logs").glob("steptimes-rank*.jsonl")):
        rows = [r for r in read_jsonl(f) if "step" in r and "step_s" in r]
        out[int(f.stem.split("rank")[1])] = max(r["step"] for r in rows)
    return out


def assert_diverged(run: Path, proc: subprocess.CompletedProcess[str], first_bad: int, in_row: int, kept: int,
                    tmp: Path) -> None:
    assert proc.returncode == EXIT_DIVERGED, proc.stdout + proc.stderr
    stop = first_bad + in_row - 1
    assert f"diverged at step {stop}; last finite checkpoint step {kept}" in proc.stdout, proc.stdout
    skipped = [r["step"] for r in metrics(run) if r.get("skipped")]
    assert skipped == list(range(first_bad, stop + 1))
    (ev,) = events(run, "diverged")
    assert (ev["step"], ev["first_skipped_step"], ev["last_finite_checkpoint"]) == (stop, first_bad, kept)
    assert not [e for e in events(run, "finish") if e["time"] > events(run, "start")[-1]["time"]]
    assert set(steps_of_rank_logs(run).values()) == {stop}  # every rank stopped after the same step
    # no checkpoint was written once the skips began; the one kept holds only finite numbers
    ckpts = [c for c in list_checkpoints(run / "checkpoints") if c.valid]
    assert [c.step for c in ckpts] == [kept]
    state = checkpoint_state(ckpts[0].path, tmp)
    assert all(torch.isfinite(t).all() for t in tensors(state).values())
    job = json.loads((run / "job.json").read_text())
    assert job["attempts"][-1]["status"] == "diverged"


def test_lr_1e9_dp2_diverges_with_exit_3_and_keeps_the_finite_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "dp2"
    proc = trainctl("launch", "--run-dir", str(run), "--set", "parallel.tp=1", "--set", "parallel.pp=1",
                    "--set", "parallel.dp=2", "--set", "parallel.sequence_parallel=false",
                    "--set", "cluster.gpus_per_node=2", "--set", "train.steps=12", "--set", "checkpoint.every_steps=1",
                    "--set", "train.divergence.max_consecutive_skips=3", *DIVERGE)
    assert_diverged(run, proc, first_bad=2, in_row=3, kept=1, tmp=tmp_path)
    # mfu-report marks the skipped steps and the divergence
    rep = trainctl("mfu-report", str(run), "--json")
    assert rep.returncode == 0, rep.stderr
    r = strict_loads(rep.stdout)["runs"][0]
    assert r["divergence"]["skipped_steps"] == [2, 3, 4]
    assert r["divergence"]["diverged"]["step"] == 4
    assert [s["step"] for s in r["series"] if s["skipped"]] == [2, 3, 4]
    assert any("diverged at step 4" in w for w in r["warnings"])
    # Every --json output of this run is strict RFC 8259 JSON: the skipped steps' NaN loss becomes null.
    assert math.isnan(metrics(run)[-1]["loss"])
    assert r["summary"]["final_loss"] is None and [s["loss"] for s in r["series"]][1:] == [None] * 3
    for args in (["checkpoints", str(run)], ["resume", str(run), "--dry-run", "--set", "train.steps=13"],
                 ["validate", str(run / "spec.yaml")], ["plan", str(run / "spec.yaml")],
                 ["plan", str(run / "spec.yaml"), "--ranks"]):
        out = trainctl(*args, "--json")
        assert out.returncode == 0, (args, out.stderr)
        assert strict_loads(out.stdout), args


def test_lr_1e9_pp2_diverges_on_every_stage(tmp_path: Path) -> None:
    """PP2: the loss lives on the last stage only, the decision reaches the first stage too. Launched at a
    normal lr for 2 steps, then resumed with lr=1e9 (`trainctl resume` surfaces the exit code as well)."""
    run = tmp_path / "pp2"
    layout = ["--set", "parallel.tp=1", "--set", "parallel.pp=2", "--set", "parallel.dp=1",
              "--set", "parallel.sequence_parallel=false", "--set", "cluster.gpus_per_node=2"]
    ok = trainctl("launch", "--run-dir", str(run), *layout, "--set", "train.steps=2",
                  "--set", "checkpoint.every_steps=2")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    proc = trainctl("resume", str(run), "--set", "train.steps=12", "--set", "train.divergence.max_consecutive_skips=2",
                    *DIVERGE)
    # step 3 applies the huge update (finite), step 4 on is NaN; the save due at step 4 is not written
    assert_diverged(run, proc, first_bad=4, in_row=2, kept=2, tmp=tmp_path)


def test_one_nan_on_one_rank_is_skipped_by_every_rank(tmp_path: Path) -> None:
    """DP2, ZeRO 0: the NaN lands in rank 1's gradient replica, which the global norm does not count (only
    dp rank 0's copy is), so only the all-reduced flag can tell rank 0. The weights and AdamW state after
    the skipped step 3 (the final checkpoint) equal those after step 2, on every rank."""
    run, world = make_run(tmp_path, "nan-once", parallel={"dp": 2},
                          train={"steps": 3}, checkpoint={"every_steps": 2})
    proc = run_trainer(run, world, env=faults.encode(nan_at_step=3, nan_rank=1), dump=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = {r["step"]: r for r in metrics(run)}
    assert [s for s, r in rec.items() if r.get("skipped")] == [3]
    assert math.isfinite(rec[3]["loss"]) and math.isfinite(rec[3]["grad_norm"])  # rank 1's copy is not counted
    assert "gradient norm on 1 rank" in rec[3]["skip_reason"]
    (fin,) = events(run, "finish")
    assert fin["skipped_steps"] == 1
    ckpts = {c.step: c for c in list_checkpoints(run / "checkpoints") if c.valid}
    assert sorted(ckpts) == [2, 3]
    before, after = (tensors(checkpoint_state(ckpts[s].path, tmp_path)) for s in (2, 3))
    assert before.keys() == after.keys() and before
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_rollback_skips_the_nan_window_and_completes(tmp_path: Path) -> None:
    """Batches 4-5 hold NaN gradients: steps 4 and 5 are skipped, the run rolls back to checkpoint 2 and
    goes on with batch 6 (PaLM's remedy), so it completes with no skip in its final curve."""
    run, world = make_run(tmp_path, "rollback", parallel={"dp": 2},
                          train={"steps": 7, "divergence": {"max_consecutive_skips": 2, "rollback": True,
                                                            "max_rollbacks": 1}},
                          checkpoint={"every_steps": 2})
    proc = run_trainer(run, world, env=faults.encode(nan_at_step="4-5"), dump=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (rb,) = events(run, "rollback")
    assert (rb["step"], rb["to_step"], rb["batches"], rb["skipped_batches"]) == (5, 2, [3, 5], 3)
    steps = [(r["step"], bool(r.get("skipped"))) for r in metrics(run)]
    assert steps == [(1, False), (2, False), (3, False), (4, True), (5, True),
                     (3, False), (4, False), (5, False), (6, False), (7, False)]
    (fin,) = events(run, "finish")
    assert (fin["skipped_steps"], fin["rollbacks"]) == (2, 1)
    assert not events(run, "diverged")
    assert [c.step for c in list_checkpoints(run / "checkpoints") if c.valid][-1] == 7

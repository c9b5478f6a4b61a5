"""PowerSGD (parallel.grad_compression.powersgd, runtime/parallel/powersgd.py): one compression round equals torch's
DDP powerSGD_hook on the same inputs; training on the tiny recipe's model tracks the uncompressed loss; a resume
mid-run is bitwise (Q and the error feedback are in the checkpoint); a resume on another layout restarts them
with a warning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from resume_utils import assert_resumed_bitwise, curve, ok, set_spec, straight_and_resumed
from trainer_utils import fork_ranks, make_run, metrics, run_trainer

from trainctl.checkpoint import list_checkpoints, rank_state_filename
from trainctl.checkpoint.format import MANIFEST, MARKER, marker_bytes
from trainctl.fileio import HASH, file_digest
from trainctl.plan.memory import dp_bucket_numel
from trainctl.plan.plan import build_plan
from trainctl.spec.loader import validate_spec

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("powersgd_ref_worker.py")


def test_one_round_matches_torch_powersgd_hook(tmp_path: Path) -> None:
    r = fork_ranks(2, [str(WORKER), str(tmp_path)], timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["peers_equal"]  # the approximation (and the uncompressed rest) is the same on every DP rank
        torch.testing.assert_close(got["ours"], got["hook"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["ours_q"], got["hook_q"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["ours_e"], got["hook_e"], rtol=1e-5, atol=1e-6)  # this rank's own error
        assert torch.linalg.matrix_rank(got["ours"]) == 4
        assert torch.equal(got["rest"], torch.full((5,), 1.5))  # uncompressed: the DP mean of 1 and 2


STEPS = 50
PSGD = {"powersgd": {"rank": 4, "start_step": 5}}


def test_tracks_the_uncompressed_loss_and_resumes_bitwise(tmp_path: Path) -> None:
    """The tiny model at DP2 for 50 steps: ZeRO-0 uncompressed, ZeRO-0 and ZeRO-1 with PowerSGD rank 4. The
    compressed runs end within 2% of the uncompressed loss (mean of the last 5 steps), yet really compressed
    (their losses differ from step 6 on), and ZeRO-1 compresses as ZeRO-0 does (the same gradients, another
    optimizer layout). Then the ZeRO-1 run's checkpoint at step 25, resumed in fresh processes, retraces steps
    26-50 bit for bit; stripped of PowerSGD's state it does not (that state is what makes it exact). The
    measured gradient memory (PowerSGD's buffers included) is the plan's."""
    sections = {"train": {"steps": STEPS, "global_batch": 8}, "model": {"preset": "tiny", "seq_len": 32}}
    plain, world = make_run(tmp_path, "plain", parallel={"dp": 2}, **sections)
    ok(run_trainer(plain, world, dump=False), "uncompressed")
    z0, _ = make_run(tmp_path, "z0", parallel={"dp": 2, "grad_compression": PSGD}, **sections)
    ok(run_trainer(z0, world, dump=False), "PowerSGD ZeRO-0")
    straight, resumed = straight_and_resumed(tmp_path, {"dp": 2, "zero": 1, "grad_compression": PSGD}, STEPS,
                                             **sections)
    assert_resumed_bitwise(straight, resumed, STEPS)
    stripped = tmp_path / "stripped"
    shutil.copytree(resumed, stripped)
    latest = max(list_checkpoints(stripped / "checkpoints"), key=lambda c: c.step)
    shutil.rmtree(latest.path)  # back to step 25 (the resumed run saved step 50 again)
    (first,) = [c for c in list_checkpoints(stripped / "checkpoints") if c.step == STEPS // 2]
    manifest = json.loads((first.path / MANIFEST).read_text())
    for rank in range(world):
        f = first.path / rank_state_filename(rank)
        st = torch.load(f, weights_only=False)
        st.pop("powersgd")
        torch.save(st, f)
        size, digest = file_digest(f)
        manifest["files"][f.name].update({"size": size, HASH: digest})  # a valid checkpoint, just without it
    data = json.dumps(manifest).encode()
    (first.path / MANIFEST).write_bytes(data)
    (first.path / MARKER).write_bytes(marker_bytes(data))
    r = run_trainer(stripped, world, dump=False)
    ok(r, "resumed without PowerSGD's state")
    assert "without this layout's PowerSGD state" in r.stdout + r.stderr
    assert curve(stripped)[-1][1] != curve(straight)[-1][1]

    ref = [m["loss"] for m in metrics(plain)]
    assert [m["loss"] for m in metrics(z0)][:5] == ref[:5]  # steps before start_step reduce uncompressed
    for run in (z0, straight):
        got = [m["loss"] for m in metrics(run)]
        assert len(got) == len(ref) == STEPS
        assert all(a != b for a, b in zip(got[5:], ref[5:], strict=True))
        end, end_ref = sum(got[-5:]) / 5, sum(ref[-5:]) / 5
        print(f"{run.name}: loss {got[0]:.4f} -> {end:.4f}, uncompressed -> {end_ref:.4f} "
              f"({(end - end_ref) / end_ref:+.2%})")
        assert abs(end - end_ref) <= 0.02 * end_ref
    assert ref[-1] < 0.8 * ref[0]  # it trained: the comparison is not between two flat lines
    for run in (z0, straight):  # the plan's gradient memory holds PowerSGD's buffers as the trainer does
        spec = validate_spec(yaml.safe_load((run / "spec.yaml").read_text()))
        want = build_plan(spec).to_json()["memory"]["per_pp_rank"][0]
        (line,) = [m for m in metrics(run) if "memory" in m]
        for got in line["memory"]["per_rank"]:
            padding = 4 * (2 - 1) * (round(want["params"]) // dp_bucket_numel() + 2)  # buckets pad to dp
            assert 0 <= got["gradients"] - want["gradients"] <= padding, (run.name, got, want)


def test_resume_without_its_state_warns_and_restarts_compression(tmp_path: Path) -> None:
    """A checkpoint resumed on another layout (DP2 -> DP4 here) reshards the model and optimizer but not
    PowerSGD's per-rank state: the run warns once and restarts the error feedback and Q."""
    sections = {"train": {"steps": 4}, "checkpoint": {"every_steps": 2}}
    run, world = make_run(tmp_path, "run", parallel={"dp": 2, "grad_compression": {"powersgd": {"rank": 2,
                                                                                                 "start_step": 1}}},
                          **sections)
    ok(run_trainer(run, world, dump=False), "first")
    set_spec(run, parallel={"dp": 4}, train={"steps": 6})
    r = run_trainer(run, 4, dump=False)
    ok(r, "resumed at DP4")
    assert (r.stdout + r.stderr).count("without this layout's PowerSGD state") == 1
    assert [m["step"] for m in metrics(run)][-2:] == [5, 6]

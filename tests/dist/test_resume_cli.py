"""`trainctl resume RUN [--from-step N] [--set k=v]`: local relaunch into the same run directory, rewinds,
usage errors, the Slurm hand-off, and no torch in the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_utils import TRAINCTL, trainctl
from resume_utils import curve, events, stop_after
from spec_utils import write_spec
from trainer_utils import ROOT

from trainctl.checkpoint import list_checkpoints
from trainctl.errors import EXIT_STOPPED

DP2 = {"parallel": {"dp": 2}, "cluster": {"gpus_per_node": 2}, "train": {"steps": 6},
       "checkpoint": {"every_steps": 2, "keep_last": 5}}


@pytest.mark.slow
def test_resume_local_appends_and_from_step_rewinds(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = trainctl("launch", str(write_spec(tmp_path / "spec.yaml", DP2)), "--run-dir", str(run), env=stop_after(3))
    assert r.returncode == EXIT_STOPPED, r.stderr[-3000:]  # stopped with steps left: resumable
    assert [s for s, _, _ in curve(run)] == [1, 2, 3]
    batch = yaml.safe_load((run / "spec.yaml").read_text())["train"]["global_batch"]
    dry = trainctl("resume", str(run), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["resume_step"] == 3 and plan["backend"] == "local" and "torch.distributed.run" in plan["command"]
    r = trainctl("resume", str(run))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resuming" in r.stdout and "from step 3" in r.stdout
    first = curve(run)
    assert [s for s, _, _ in first] == [1, 2, 3, 4, 5, 6]  # appended, nothing repeated or skipped
    job = json.loads((run / "job.json").read_text())
    assert [(a["attempt"], a["kind"], a["status"]) for a in job["attempts"]] == [
        (1, "launch", "stopped"), (2, "resume", "completed")]
    assert [i.step for i in list_checkpoints(run / "checkpoints")] == [2, 3, 4, 6]

    # rewind to step 2: newer checkpoints are moved aside (never resumed by a later restart), steps 3-6 rerun;
    # the directory was copied without its logs (they are not needed to resume)
    shutil.rmtree(run / "logs")
    r = trainctl("resume", str(run), "--from-step", "2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert [i.step for i in list_checkpoints(run / "checkpoints")] == [2, 4, 6]  # 4, 6 re-saved by the rerun
    assert len(list((run / "checkpoints").glob("step-*.abandoned-*"))) == 3
    ev = [e for e in events(run) if e["event"] == "resume_from"]
    assert ev[-1]["step"] == 2 and ev[-1]["replayed_steps"] == 4 and ev[-1]["replayed_from"] == 3
    again = curve(run)
    assert [s for s, _, _ in again] == [1, 2, 3, 4, 5, 6, 3, 4, 5, 6]
    assert again[6:] == first[2:]  # the rerun is bitwise the same training
    # --set: a longer run continues from the final checkpoint with the changed spec frozen in the run dir
    for steps, where in ((6, "already at"), (5, "already past")):  # nothing left to train: one line, exit 2
        r = trainctl("resume", str(run), "--set", f"train.steps={steps}")
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert f"checkpoint step 6 is {where} train.steps={steps}: nothing to run" in r.stderr
        assert "(N > 6)" in r.stderr and "Traceback" not in r.stderr
    r = trainctl("resume", str(run), "--set", "train.steps=7", "--dry-run")
    assert r.returncode == 0 and not (run / "spec.prev-1.yaml").exists()
    assert "warning" not in r.stdout
    # a new global batch with the old learning rate: the scaling rules are named, the choice left to the user
    r = trainctl("resume", str(run), "--set", "train.steps=7", "--set", f"train.global_batch={2 * batch}", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"warning: train.global_batch {batch} -> {2 * batch} (x2) with train.lr unchanged" in " ".join(
        r.stdout.split())

    # another model shape is refused before anything is launched or changed; another layout is resharded
    r = trainctl("resume", str(run), "--set", "train.steps=8", "--set", "model.hidden=128")
    assert r.returncode == 2 and "different model shape (model.hidden: checkpoint 64, this run 128" in r.stderr
    assert len(json.loads((run / "job.json").read_text())["attempts"]) == 3
    new_layout = ["--set", "train.steps=8", "--set", "parallel.tp=2", "--set", "parallel.dp=1"]
    dry = trainctl("resume", str(run), *new_layout, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["layout_changes"] == ["tp 1 -> 2", "dp 2 -> 1"]
    r = trainctl("resume", str(run), *new_layout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "layout change: tp 1 -> 2" in r.stdout
    assert [s for s, _, _ in curve(run)][-2:] == [7, 8]


def test_resume_usage_errors(tmp_path: Path) -> None:
    r = trainctl("resume", str(tmp_path / "missing"))
    assert r.returncode == 2 and "no such run directory" in r.stderr
    run = tmp_path / "run"
    run.mkdir()
    write_spec(run / "spec.yaml", DP2)
    r = trainctl("resume", str(run))
    assert r.returncode == 2 and "not a run directory" in r.stderr
    (run / "job.json").write_text(json.dumps({"backend": "local", "attempts": []}))
    r = trainctl("resume", str(run), "--from-step", "4")
    assert r.returncode == 2 and "no checkpoint for step 4" in r.stderr


def test_slurm_run_is_handed_to_the_slurm_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI glue only (the real resubmission runs on the local cluster in test_launch_slurm_e2e.py)."""
    from trainctl.cli.app import main
    from trainctl.launch.slurm import submit

    run = tmp_path / "run"
    run.mkdir()
    write_spec(run / "spec.yaml", DP2)
    (run / "job.json").write_text(json.dumps({"backend": "slurm", "attempts": []}))
    calls = []
    monkeypatch.setattr(submit, "resubmit", lambda paths, say: calls.append(paths.root) or "42")
    with pytest.raises(SystemExit) as e:
        main(["resume", str(run)])
    assert e.value.code == 0
    assert calls == [run.absolute()] and "submitted job 42" in capsys.readouterr().out
    assert [e["event"] for e in events(run)] == ["resume_requested"]


def test_resume_cli_does_not_import_torch(tmp_path: Path) -> None:
    code = ("import sys\nfrom trainctl.cli.app import main\n"
            "try:\n    main(['resume', '--help'])\nexcept SystemExit as e:\n    assert e.code in (0, None)\n"
            "import trainctl.launch.resume\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\nassert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def _rank_pid(run: Path, rank: int) -> int:
    """The pid of one trainer rank (torchrun's own command line names the module too, but has no RANK)."""
    out = subprocess.run(["pgrep", "-f", f"trainctl.runtime {run}"], capture_output=True, text=True).stdout
    for pid in map(int, out.split()):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(v.startswith(b"LOCAL_RANK=") for v in env):
            return pid
    raise AssertionError(f"no process for rank {rank} of {run}")


@pytest.mark.parametrize("target", ["launcher", "rank"])
def test_sigterm_to_trainctl_launch_checkpoints_then_resume_finishes(tmp_path: Path, target: str) -> None:
    """SIGTERM to the launcher (-> every rank), or SIGTERM to one rank only: a checkpoint at the next step, the
    attempt is recorded as stopped (exit 75, though torchrun exits 0), and `trainctl resume` completes the run
    without a gap."""
    import os
    import signal

    from resume_utils import wait_for_step

    run = tmp_path / "run"
    spec = write_spec(tmp_path / "spec.yaml", DP2, {"train": {"steps": 40}, "checkpoint": {"every_steps": 100}})
    proc = subprocess.Popen([*TRAINCTL, "launch", str(spec), "--run-dir", str(run)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
    try:
        wait_for_step(run, 3)
        if target == "launcher":
            proc.send_signal(signal.SIGTERM)
        else:
            os.kill(_rank_pid(run, 1), signal.SIGTERM)
        assert proc.wait(timeout=120) == EXIT_STOPPED
    finally:
        proc.kill()
    job = json.loads((run / "job.json").read_text())
    assert job["attempts"][0]["status"] == "stopped"
    stop = next(e for e in events(run) if e["event"] == "checkpoint_on_signal")
    assert stop["signal"] == "SIGTERM" and [i.step for i in list_checkpoints(run / "checkpoints")] == [stop["step"]]
    r = trainctl("resume", str(run))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert [s for s, _, _ in curve(run)] == list(range(1, 41))

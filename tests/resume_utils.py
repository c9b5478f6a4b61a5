"""Helpers for the resume tests: runs that checkpoint, stop after step N, resume, and compare bitwise; and
ranks started directly (srun-style, no torchrun) so each rank's own exit status and pid are visible."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from spec_utils import deep_update, write_spec
from trainer_utils import ROOT, final_weights, free_port, make_run, metrics, rank_env, run_trainer

from trainctl.checkpoint import abandoned_dirname, list_checkpoints
from trainctl.runtime.train import faults


def stop_after(step: int) -> dict[str, str]:
    """The environment that makes the trainer checkpoint after `step` and stop as if signalled (exit 0)."""
    return faults.encode(stop_after_step=step)


def set_spec(run: Path, **sections: dict[str, Any]) -> None:
    """Edit the run's spec.yaml in place (a resume with another allocation), as `trainctl resume --set` would:
    job.json's record of the frozen spec follows, so the ranks started on it directly take the edit as seen."""
    from trainctl.launch.create import frozen_spec_record

    path = run / "spec.yaml"
    write_spec(path, sections, base=yaml.safe_load(path.read_text()), one_node=True)
    job = run / "job.json"
    if job.exists():
        record = json.loads(job.read_text())
        record["frozen_spec"] = frozen_spec_record(path.read_text())
        job.write_text(json.dumps(record, indent=2) + "\n")


def ok(r: subprocess.CompletedProcess, what: str = "run") -> None:
    assert r.returncode == 0, f"{what} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


def curve(run: Path) -> list[tuple[int, float, float]]:
    """(step, loss, grad_norm) of every metrics line, in file order."""
    return [(m["step"], m["loss"], m["grad_norm"]) for m in metrics(run)]


def events(run: Path) -> list[dict[str, Any]]:
    from trainctl.rundir.paths import read_jsonl

    return read_jsonl(run / "events.jsonl")


def assert_same_weights(a: Path, b: Path) -> None:
    import torch

    wa, wb = final_weights(a), final_weights(b)
    assert set(wa) == set(wb) and wa
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k  # bitwise


def straight_and_resumed(root: Path, parallel: dict[str, Any], steps: int, env: dict[str, str] | None = None,
                         **sections: dict[str, Any]) -> tuple[Path, Path]:
    """One run straight through `steps`, checkpointing after steps/2 and at the end without stopping, and a
    copy of its directory rewound to steps/2 (the newer checkpoint moved aside, as `trainctl resume
    --from-step` does) resumed in fresh processes: (straight, resumed). The resume must retrace the straight
    run's second half bit for bit (assert_resumed_bitwise). Saving while the run goes on also checks that a
    checkpoint is the state at its step, not what the next steps made of it; stopping after a checkpoint and
    resuming is what the layout-change chains do (test_resume_faults)."""
    sections = deep_update({"train": {"steps": steps}, "checkpoint": {"every_steps": steps // 2, "keep_last": 2}},
                           sections)
    straight, world = make_run(root, "straight", parallel=parallel, **sections)
    ok(run_trainer(straight, world, env=env), "straight run")
    resumed = root / "resumed"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("final_weights"))
    for info in list_checkpoints(resumed / "checkpoints"):
        if info.step > steps // 2:
            os.replace(info.path, info.path.with_name(abandoned_dirname(info.step, "rewound")))
    ok(run_trainer(resumed, world, env=env), "resumed half")
    return straight, resumed


def assert_resumed_bitwise(straight: Path, resumed: Path, steps: int) -> dict[str, Any]:
    """The resumed copy's steps after steps/2 equal the straight run's: losses, grad norms (==) and final
    weights (torch.equal); returns its resume_from event."""
    want, got = curve(straight), curve(resumed)
    half = steps // 2
    assert [s for s, _, _ in want] == list(range(1, steps + 1))
    assert [s for s, _, _ in got[steps:]] == list(range(half + 1, steps + 1))  # nothing repeated or skipped
    assert got[steps:] == want[half:], (got[steps:], want[half:])
    assert_same_weights(straight, resumed)
    (ev,) = [e for e in events(resumed) if e["event"] == "resume_from"]
    assert ev["step"] == half and ev["same_layout"] and ev["replayed_steps"] == steps - half, ev
    return ev


def spawn_ranks(run: Path, nproc: int, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start the trainer's ranks as plain processes (RANK/WORLD_SIZE/MASTER_* as srun + our entry would)."""
    port = str(free_port())
    procs = []
    for r in range(nproc):
        e = rank_env({"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": port, **(env or {})})
        log = open(run / f"rank{r}.log", "w")  # noqa: SIM115  (closed by the child's exit)
        procs.append(subprocess.Popen([sys.executable, "-m", "trainctl.runtime", str(run)], cwd=ROOT, env=e,
                                      stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float = 300) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def wait_for_step(run: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(m.get("step", 0) >= step for m in metrics(run)):
            return
        time.sleep(0.05)
    raise AssertionError(f"{run}: step {step} not reached in {timeout} s")


def rank_log(run: Path, r: int) -> str:
    return (run / f"rank{r}.log").read_text(errors="replace")

"""The hang watchdog in one process (fast): a blocked main thread gets its stacks dumped, a "hang" event, a
heartbeat marked hung and a non-zero exit; progress keeps it quiet. With real ranks: a rank stopped by SIGSTOP
is named (not the rank that waited for it) and killed, so the launch ends. The hang fault's multi-rank case is
in tests/dist/test_report_runs.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cli_utils import TRAINCTL, trainctl
from paths import REPO as ROOT

from trainctl.rundir.paths import RunPaths, read_jsonl
from trainctl.runtime.observe import watchdog
from trainctl.runtime.train import faults

SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from trainctl.rundir.paths import RunPaths
    from trainctl.runtime.observe.watchdog import Watchdog, hang_forever, hang_step
    paths = RunPaths(Path(sys.argv[1]))
    wd = Watchdog(paths, rank=3, timeout_s=float(sys.argv[2]), heartbeat_every_s=0.0).start()
    for step in range(1, 6):
        if hang_step(3) == step:
            hang_forever()
        time.sleep(0.05)
        wd.beat(step)
    wd.stop()
    print("done")
""")


def _run(tmp_path: Path, timeout_s: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(timeout_s)], cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=60)


def test_hung_rank_dumps_stacks_records_event_and_exits(tmp_path):
    proc = _run(tmp_path, 0.5, faults.encode(hang="3:4"))
    assert proc.returncode == watchdog.HANG_EXIT_CODE, proc.stderr
    assert "done" not in proc.stdout
    assert "watchdog: no step progress" in proc.stderr
    assert "last completed step 3" in proc.stderr
    # faulthandler's dump: every thread, the main one blocked inside hang_forever
    assert "Thread 0x" in proc.stderr and "hang_forever" in proc.stderr and "_loop" in proc.stderr
    hang = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "hang"]
    assert len(hang) == 1 and hang[0]["rank"] == 3 and hang[0]["step"] == 3
    beat = json.loads((tmp_path / "logs" / "heartbeat-rank3").read_text())
    assert beat["state"] == "hung" and beat["step"] == 3


def test_progress_keeps_the_watchdog_quiet(tmp_path):
    proc = _run(tmp_path, 2.0, {})
    assert proc.returncode == 0, proc.stderr
    assert "done" in proc.stdout
    assert not (tmp_path / "events.jsonl").exists()
    beat = json.loads((tmp_path / "logs" / "heartbeat-rank3").read_text())
    assert beat["state"] == "stopped" and beat["step"] == 5


class _Spec:
    class train:  # noqa: N801 - mimics spec.train
        watchdog_s = 42.0


def test_timeout_env_overrides_spec_and_can_disable():
    assert watchdog.timeout_from(_Spec, env={}) == 42.0
    assert watchdog.timeout_from(_Spec, env={watchdog.WATCHDOG_ENV: "7.5"}) == 7.5
    assert watchdog.timeout_from(_Spec, env={watchdog.WATCHDOG_ENV: "off"}) is None
    assert watchdog.timeout_from(_Spec, env={watchdog.WATCHDOG_ENV: "0"}) is None
    assert watchdog.timeout_from(object(), env={}) == watchdog.DEFAULT_TIMEOUT_S


def test_spec_field_default_and_null():
    from trainctl.spec import load_spec_text

    base = """
name: t
model: {preset: tiny}
train: {global_batch: 8, steps: 2}
data: {synthetic: true}
cluster: {nodes: 1, gpus_per_node: 1, gpu: cpu}
launcher: {backend: local}
"""
    assert load_spec_text(base).train.watchdog_s == 600.0
    off = load_spec_text(base.replace("steps: 2}", "steps: 2, watchdog_s: null}"))
    assert off.train.watchdog_s is None
    assert watchdog.timeout_from(off, env={}) is None


def test_hang_fault_parsing():
    assert watchdog.hang_step(1, env=faults.encode(hang="1:5")) == 5
    assert watchdog.hang_step(0, env=faults.encode(hang="1:5")) is None
    assert watchdog.hang_step(0, env={}) is None
    with pytest.raises(ValueError, match="<rank>:<step>"):
        watchdog.hang_step(0, env=faults.encode(hang="x"))


def wait_for_step(heartbeat: Path, step: int, proc: subprocess.Popen) -> dict:
    """The heartbeat file once it shows `step` (or later); fails if the launch ends first (or hangs)."""
    give_up = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < give_up:
        try:
            beat = json.loads(heartbeat.read_text())
            if beat["step"] >= step:
                return beat
        except (OSError, ValueError):
            pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
    proc.kill()
    raise AssertionError(f"the launch ended (status {proc.returncode}) before {heartbeat.name} showed step {step}")


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_killed(tmp_path):
    """Rank 1 is SIGSTOPped mid-run: rank 0, waiting for it in a collective, is the one whose watchdog fires,
    but the line names rank 1 (its heartbeat went stale; rank 0's kept being rewritten), and rank 0 kills it,
    so the launch ends instead of torchrun waiting for a process that cannot act on its SIGTERM."""
    run = tmp_path / "run"
    sets = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=2", "cluster.gpus_per_node=2", "train.steps=100000",
            "checkpoint.every_steps=null"]
    env = {**os.environ, watchdog.WATCHDOG_ENV: "4", "OMP_NUM_THREADS": "1"}
    env.pop(faults.ENV, None)
    terminal = tmp_path / "terminal.txt"
    with open(terminal, "w") as console:
        proc = subprocess.Popen([*TRAINCTL, "launch", str(ROOT / "recipes" / "tiny-cpu.yaml"),
                                 "--run-dir", str(run), *(x for s in sets for x in ("--set", s))],
                                cwd=ROOT, env=env, stdout=console, stderr=subprocess.STDOUT)
    beat = wait_for_step(RunPaths(run).heartbeat(1), 3, proc)
    os.kill(beat["pid"], signal.SIGSTOP)
    try:
        proc.wait(timeout=240)
    finally:  # whatever failed: leave no stopped rank behind
        proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(beat["pid"], signal.SIGKILL)
    out = terminal.read_text()
    assert proc.returncode == 1, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("run failed: rank 1 on ") and "hang: no step progress after step" in last, last
    assert "its process stopped running" in last and "rank 0's watchdog fired" in last, last
    assert "Thread 0x" not in out  # rank 0's stack dump is in its log, not on the terminal
    hangs = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "hang"]
    assert hangs and all(h["rank"] == 1 and h["detected_by"] == 0 and h["killed"] for h in hangs), hangs
    status = trainctl("status", str(run), env=env)
    assert "FAILED" in status.stdout and "rank 1" in status.stdout, status.stdout

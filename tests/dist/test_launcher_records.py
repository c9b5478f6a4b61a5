"""What the local launcher, `status` and `mfu-report` say of how an attempt ended, through the real `trainctl`
command: one first cause, named the same by all three, whatever order the ranks' records reached events.jsonl;
and the launcher's exit status when a SIGTERM comes as it makes the run directory or in its last moments.

Two ranks that fail microseconds apart (a token file truncated under both) append their `failure` events in
either order. The launcher here runs a stand-in for torchrun (launcher.python: a script that appends the two
records as that race can leave them, the later failure first, and exits 1 as torchrun does), so the order is
the same on every run; the launcher, `status` and `mfu-report` are the real ones."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cli_utils import TRAINCTL, trainctl
from spec_utils import write_spec

from trainctl.errors import EXIT_RUN_FAILED, EXIT_STOPPED
from trainctl.rundir.paths import read_jsonl

RACED_RANKS = """#!{python}
# torchrun's stand-in: its ranks 0 and 1 fail 40 microseconds apart, rank 1's record appended first
import json, sys, time
run = sys.argv[-1]
t = time.time()
with open(run + "/events.jsonl", "a") as f:
    for rank, late in ((1, 40e-6), (0, 0.0)):
        f.write(json.dumps({{"time": t + late, "event": "failure", "rank": rank, "host": "here",
                            "error": f"data file tokens.bin was truncated (rank {{rank}})"}}) + "\\n")
sys.exit(1)
"""


def test_launcher_status_and_report_name_the_same_first_cause(tmp_path: Path) -> None:
    stand_in = tmp_path / "python"
    stand_in.write_text(RACED_RANKS.format(python=sys.executable))
    stand_in.chmod(0o755)
    spec = write_spec(tmp_path / "spec.yaml", {"parallel": {"dp": 2}, "launcher": {"python": str(stand_in)}},
                      one_node=True)
    run = tmp_path / "run"
    first = "rank 0 on here: exception: data file tokens.bin was truncated (rank 0)"

    r = trainctl("launch", str(spec), "--run-dir", str(run))
    assert r.returncode == EXIT_RUN_FAILED, r.stdout + r.stderr
    assert f"run failed: {first}" in " ".join(r.stdout.split()), r.stdout  # was: rank 1, the first line of the file

    r = trainctl("status", str(run), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["reason"] == first

    r = trainctl("mfu-report", str(run))
    assert r.returncode == EXIT_RUN_FAILED and f"nothing to report: {first}" in " ".join(r.stderr.split()), r.stderr


# --- a stop asked at the launcher's first and last moments ---------------------------------------------------

def _signal_until(proc: subprocess.Popen[str], sig: int, *, every_s: float, for_s: float | None = None) -> None:
    """Send `sig` to `proc` every `every_s` until it exits (or for `for_s` seconds)."""
    deadline = time.monotonic() + (for_s if for_s is not None else 300)
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        time.sleep(every_s)


def _launch(tmp_path: Path, steps: int) -> tuple[subprocess.Popen[str], Path]:
    spec = write_spec(tmp_path / "spec.yaml", {"train": {"steps": steps}, "checkpoint": {"every_steps": 1}})
    run = tmp_path / "run"
    proc = subprocess.Popen([*TRAINCTL, "launch", str(spec), "--run-dir", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    return proc, run


def _wait_for(found: Callable[[], bool], proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not found():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.0005)


def test_sigterm_while_the_run_directory_is_made_stops_before_the_first_step(tmp_path: Path) -> None:
    proc, run = _launch(tmp_path, steps=50)
    try:
        _wait_for(run.exists, proc)  # the launcher is making it: spec, plan, launch.sh, job.json
        _signal_until(proc, signal.SIGTERM, every_s=0.002, for_s=1.0)  # was: killed, exit 143
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_STOPPED, out[-3000:]
    assert "stopped before the first step: nothing to save" in " ".join(out.split()), out[-3000:]
    assert json.loads((run / "job.json").read_text())["attempts"][0]["status"] == "stopped"
    # hundreds of repeated SIGTERMs are noted once (was: a line each, until a full pipe made the handler recurse)
    assert out.count("again: already stopping") <= 1, out[-3000:]


def test_sigterm_in_the_launchers_last_moments_keeps_the_runs_exit_status(tmp_path: Path) -> None:
    proc, run = _launch(tmp_path, steps=2)
    try:
        _wait_for(lambda: any(e.get("event") == "launcher_exit" for e in read_jsonl(run / "events.jsonl")), proc)
        # from its last record to its exit: the last line, Python's finalization (was: exit 143)
        _signal_until(proc, signal.SIGTERM, every_s=0.001)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]  # every step done: what a stop asked now cannot change
    assert "done" in out and "metrics.jsonl" in out, out[-3000:]

"""The hang watchdog in one process (fast): a blocked main thread gets its stacks dumped, a "hang" event, a
heartbeat marked hung and a non-zero exit; progress keeps it quiet. The multi-rank case is in
tests/dist/test_report_runs.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainctl.rundir import read_jsonl
from trainctl.runtime import faults, watchdog

from paths import REPO as ROOT

SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from trainctl.rundir import RunPaths
    from trainctl.runtime.watchdog import Watchdog, hang_forever, hang_step
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

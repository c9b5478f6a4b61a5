"""A stop signal to ONE rank checkpoints EVERY rank at the same step boundary, then exit 75 (requeue me);
the resumed run continues bit for bit."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from resume_utils import assert_same_weights, curve, events, ok, rank_log, spawn_ranks, wait_all, wait_for_step
from trainer_utils import make_run, run_trainer

from trainctl.checkpoint import list_checkpoints
from trainctl.errors import EXIT_STOPPED

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_to_one_rank_checkpoints_all_and_exits_75(sig: signal.Signals, tmp_path: Path) -> None:
    steps = 30
    straight, world = make_run(tmp_path, "straight", parallel={"dp": 2}, train={"steps": steps})
    ok(run_trainer(straight, world))
    run, _ = make_run(tmp_path, "signalled", parallel={"dp": 2}, train={"steps": steps})  # no periodic saves
    procs = spawn_ranks(run, 2)
    try:
        wait_for_step(run, 3)
        os.kill(procs[1].pid, sig)  # only rank 1 is told
    finally:
        codes = wait_all(procs, timeout=120)
    assert codes == [EXIT_STOPPED, EXIT_STOPPED], (codes, rank_log(run, 0)[-2000:], rank_log(run, 1)[-2000:])
    stopped = curve(run)[-1][0]
    assert 3 <= stopped < steps
    infos = list_checkpoints(run / "checkpoints")
    assert [(i.step, i.valid) for i in infos] == [(stopped, True)]  # committed before the exit
    ev = {e["event"]: e for e in events(run)}
    assert ev["checkpoint_on_signal"]["step"] == stopped and ev["checkpoint_on_signal"]["signal"] == sig.name
    assert ev["preempted"]["step"] == stopped and "finish" not in ev
    ok(run_trainer(run, 2))
    got = curve(run)
    assert [s for s, _, _ in got] == list(range(1, steps + 1))
    assert got == curve(straight)  # bitwise
    assert_same_weights(straight, run)

"""Why Slurm ended an attempt, from what Slurm 22.05 wrote to a job's --error file (lines recorded on the local
cluster: `scontrol update nodename=n2 state=down` under a running job, `scontrol requeue`, scancel), and what
`status` says of the requeued job. Downing a node of the shared test cluster requeues every job on it, so the
end-to-end tests do not; the batch script's use of it runs in tests/e2e (scancel, scontrol requeue)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainctl.launch.slurm.backend import requeued_because
from trainctl.launch.slurm.stop_cause import slurm_says

EARLIER = "slurmstepd-n1: error: *** JOB 17 ON n1 CANCELLED AT 2026-11-26T14:15:41 DUE TO JOB REQUEUE ***\n"
NODE_FAILURE = (
    "slurmstepd-n1: error: *** JOB 17 ON n1 CANCELLED AT 2026-11-26T14:16:26 DUE TO NODE FAILURE, SEE SLURMCTLD "
    "LOG FOR DETAILS ***\nsrun: error: Node failure on n2\n0: slurmstepd-n1: error: *** STEP 17.0 ON n1 CANCELLED "
    "AT 2026-11-26T14:16:26 DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***\nsrun: got SIGCONT\n")


@pytest.mark.parametrize(("text", "from_line", "said"), [
    (EARLIER + NODE_FAILURE, 1, "a node failure (n2)"),
    (EARLIER + NODE_FAILURE, 0, "scontrol requeue"),  # the first cause in the lines given: an earlier attempt's
    (EARLIER, 0, "scontrol requeue"),
    (EARLIER, 1, None),  # nothing of this attempt: the job's record decides (scancel writes no DUE TO)
    ("slurmstepd-n1: error: *** JOB 5 ON n1 CANCELLED AT 2026-11-26T14:05:13 ***\n", 0, None),
])
def test_slurmstepd_says_why(tmp_path: Path, text: str, from_line: int, said: str | None) -> None:
    messages = tmp_path / "slurm-17.err"
    messages.write_text(text)
    assert slurm_says(messages, from_line) == said


def test_a_requeued_job_says_why() -> None:
    events = [{"event": "slurm_stop", "job_id": "17", "attempt": 0, "reason": "a node failure (n2)"},
              {"event": "slurm_stop", "job_id": "17", "attempt": 1, "reason": "scontrol requeue"}]
    assert requeued_because(events, "17", 0, "BeginTime") == "requeued after a node failure (n2)"
    assert requeued_because(events, "17", 1, "BeginTime") == "requeued (scontrol requeue)"
    itself = [{"event": "signal", "job_id": "17", "attempt": 2, "signal": "USR1"},
              {"event": "requeue", "job_id": "17", "attempt": 2}]
    assert requeued_because(events + itself, "17", 2, "BeginTime") == "requeued (the job requeued itself)"
    assert requeued_because(events, "17", 3, "BeginTime") == "requeued (BeginTime)"
    assert requeued_because([], "17", 0, None) == "requeued"

"""What the local launcher, `status` and `mfu-report` say of how an attempt ended, through the real `trainctl`
command: one first cause, named the same by all three, whatever order the ranks' records reached events.jsonl.

Two ranks that fail microseconds apart (a token file truncated under both) append their `failure` events in
either order. The launcher here runs a stand-in for torchrun (launcher.python: a script that appends the two
records as that race can leave them, the later failure first, and exits 1 as torchrun does), so the order is
the same on every run; the launcher, `status` and `mfu-report` are the real ones."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cli_utils import trainctl
from spec_utils import write_spec

from trainctl.errors import EXIT_RUN_FAILED

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

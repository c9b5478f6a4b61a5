"""An 80-column terminal: the per-step line takes its compact form (the launcher hands the terminal's width
to the ranks), and the tables keep the columns that name and explain a row, folding the others. One real
launch, under a pseudo-terminal of 80 columns as a user's, serves every check."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import shutil
import struct
import subprocess
import termios
from pathlib import Path

import pytest
from cli_utils import TRAINCTL, trainctl
from spec_utils import write_spec
from trainer_utils import ROOT

from trainctl.hardware.catalog import ACCELERATORS

WIDTH = 80
# rich would read "[a]" as a style and drop it, and fail on "[/b]" (an unopened closing tag): a run's name, its
# path and a failure's message (gloo's "[/__w/pytorch/...]") are printed as written
NAME = "tiny[a]-cpu[/b]"


def in_terminal(*args: str, columns: int = WIDTH, timeout: float = 300) -> tuple[int, str]:
    """Run `trainctl ARGS` with a pseudo-terminal of `columns` as its stdout and stderr (COLUMNS unset, as in
    a user's shell); its exit status and output."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([*TRAINCTL, *args], stdin=subprocess.DEVNULL, stdout=follower,
                            stderr=follower, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"})
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    text = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    return proc.wait(timeout=timeout), re.sub(r"\x1b\[[0-9;]*m", "", text)  # without the terminal's colours


def at_width(*args: str) -> str:
    out = trainctl(*args, env={"COLUMNS": str(WIDTH)})
    assert out.returncode == 0, out.stderr
    return out.stdout


def fits(text: str, *unbroken: Path) -> None:
    """Every line within the width but those holding a path, which is never cut (copy-paste)."""
    long = [line for line in text.splitlines() if len(line) > WIDTH and not any(str(p) in line for p in unbroken)]
    assert not long, long


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two run directories whose names differ only in their last characters (a copy of one real run)."""
    base = tmp_path_factory.mktemp("narrow")
    spec = write_spec(base / "spec.yaml", {"name": NAME, "parallel": {"dp": 2}, "cluster": {"gpus_per_node": 2},
                                           "train": {"steps": 4}, "checkpoint": {"every_steps": 2, "keep_last": 2}})
    first = base / "runs" / "tiny-cpu-20261126-144500"
    rc, out = in_terminal("launch", str(spec), "--run-dir", str(first))
    assert rc == 0, out[-3000:]
    (base / "launch.out").write_text(out)
    shutil.copytree(first, first.with_name("tiny-cpu-20261126-144501"), symlinks=True)
    return base


def test_step_line_is_compact_in_a_narrow_terminal(runs: Path) -> None:
    out = (runs / "launch.out").read_text()
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 4, out[-3000:]
    for line in steps:
        assert len(line) < WIDTH and " tok/s | MFU " in line and " GiB" in line, line
    # what the compact line leaves out stays in the record
    record = (runs / "runs" / "tiny-cpu-20261126-144500" / "metrics.jsonl").read_text().splitlines()[0]
    assert '"lr"' in record and '"grad_norm"' in record and '"hfu"' in record


def test_checkpoints_keep_validity_and_reason(runs: Path) -> None:
    run = runs / "runs" / "tiny-cpu-20261126-144501"
    shard = run / "checkpoints" / "step-00000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # flipped bytes, the same size: only a checksum sees it
    shard.write_bytes(bytes(data))
    deep = at_width("checkpoints", str(run), "--deep")
    fits(deep, run)
    row = next(line for line in deep.splitlines() if line.startswith("│    2 "))
    assert "│ no " in row and "checksum mismatch" in row, deep
    assert "__0_0.distcp" in deep
    shallow = at_width("checkpoints", str(run))
    fits(shallow, run)
    row = next(line for line in shallow.splitlines() if line.startswith("│    2 "))
    assert "yes (not verified)" in row, shallow
    assert "Only `--deep` verifies checksums" in shallow


def test_runs_keep_whole_names(runs: Path) -> None:
    table = at_width("runs", str(runs / "runs"))
    fits(table)
    for name in ("tiny-cpu-20261126-144500", "tiny-cpu-20261126-144501"):
        (row,) = [line for line in table.splitlines() if name in line]
        assert "COMPLETED" in row, table


def test_hardware_keeps_every_accelerator_name() -> None:
    rc, out = in_terminal("hardware")
    assert rc == 0, out
    fits(out)
    words = out.split()
    for a in ACCELERATORS.values():
        assert all(w in words for w in a.name.split()), (a.name, out)


def test_names_and_paths_print_as_written(runs: Path) -> None:
    """A run's name and directory holding rich's markup characters: `status`, `runs`, `checkpoints` and
    `mfu-report` print them as written (status failed with a MarkupError; "[a]" vanished)."""
    run = runs / "runs" / "exp[a]-[b]"
    if not run.exists():
        shutil.copytree(runs / "runs" / "tiny-cpu-20261126-144500", run, symlinks=True)
    status = trainctl("status", str(run))
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith(f"{NAME} (local): COMPLETED") and str(run) in status.stdout, status.stdout
    listed = trainctl("runs", str(runs / "runs"), env={"COLUMNS": "200"}).stdout  # the name whole, not folded
    assert "exp[a]-[b]" in listed and NAME in listed, listed
    assert f"checkpoints in {run / 'checkpoints'}" in at_width("checkpoints", str(run))
    report = trainctl("mfu-report", str(run), env={"COLUMNS": "200"})
    assert report.returncode == 0, report.stderr
    assert NAME in report.stdout, report.stdout[:2000]

"""Atomic writes (trainctl/fileio.py) and `data prepare` give files the umask's mode, as open() would: others on the
run directories (0644 under umask 022), and a private umask (077) keeps them private."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainctl.fileio import os_error_line, umask, write_atomic


@pytest.fixture(params=[0o022, 0o077, 0o002])
def mask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def test_write_atomic_respects_the_umask(tmp_path: Path, mask: int) -> None:
    assert umask() == mask
    write_atomic(tmp_path / "job.json", "{}\n")
    write_atomic(tmp_path / "launch.sh", "#!/bin/sh\n", executable=True)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"job.json": 0o666 & ~mask, "launch.sh": 0o777 & ~mask}
    # what open() gives a new file under the same umask
    (tmp_path / "plain").write_text("x")
    assert modes["job.json"] == stat.S_IMODE((tmp_path / "plain").stat().st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_data_prepare_output_gets_the_umask_mode(tmp_path: Path, mask: int) -> None:
    import subprocess
    import sys

    from trainctl.data.prep import sample_text_path

    out = tmp_path / "sample.bin"
    r = subprocess.run([sys.executable, "-m", "trainctl", "data", "prepare", str(sample_text_path()), str(out)],
                       capture_output=True, text=True, timeout=120, preexec_fn=lambda: os.umask(mask))
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~mask


def test_run_directory_writes_never_go_through_a_symbolic_link(tmp_path: Path) -> None:
    """A JSONL append (metrics, events) and a replaced file (heartbeats, placement) refuse a link at their path with
    one line naming it (O_NOFOLLOW), and the link's target keeps its bytes."""
    import errno

    from trainctl.fileio import replace_file
    from trainctl.rundir.paths import append_jsonl

    target = tmp_path / "elsewhere"
    target.write_text("theirs\n")
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(target)
    with pytest.raises(OSError) as e:
        append_jsonl(link, {"step": 1})
    assert e.value.errno == errno.ELOOP and os_error_line(e.value).startswith(f"{link}: is a symbolic link")
    tmp_link = tmp_path / ".heartbeat-rank0.tmp"  # a link at the temporary name is removed, not written through
    tmp_link.symlink_to(target)
    replace_file(tmp_path / "heartbeat-rank0", b"{}")
    assert target.read_text() == "theirs\n" and (tmp_path / "heartbeat-rank0").read_bytes() == b"{}"
    assert not tmp_link.exists() and not tmp_link.is_symlink()

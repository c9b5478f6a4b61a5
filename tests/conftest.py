"""Shared pytest fixtures. `tests/` is on sys.path (no __init__.py; pyproject `pythonpath`), so the helpers here
(paths, trainer_utils, resume_utils) import by name. Tests are laid out by kind: unit/ (one process), dist/ (real
multi-process runs under torchrun, gloo, CPU; each worker next to its test), e2e/ (the real local Slurm cluster)."""

import subprocess
import uuid
from pathlib import Path

import pytest


@pytest.fixture
def tmpfs(tmp_path: Path):
    """mount(size, ro=False) -> a small tmpfs directory (root only). Tests run as root, where chmod cannot
    stop writes, so a read-only or full file system is made for real; unmounted afterwards."""
    mounts: list[Path] = []

    def mount(size: str, ro: bool = False) -> Path:
        d = tmp_path / f"mnt-{uuid.uuid4().hex[:6]}"
        d.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); needs root")
        mounts.append(d)
        return d

    yield mount
    for d in mounts:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


@pytest.fixture
def one_torch_thread():
    """In-process model tests on one intra-op thread: deterministic reductions, no oversubscription of the
    2-core CI machine by pytest's own process."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def readme_walkthrough(tmp_path_factory: pytest.TempPathFactory):
    """The README followed top to bottom once per session (tests/readme_walkthrough.py): its examples' results,
    and the runs and profile they left in its working directory, for every test that checks them."""
    from readme_walkthrough import follow

    return follow(tmp_path_factory.mktemp("readme"))

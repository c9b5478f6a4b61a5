"""Shared pytest fixtures. `tests/` is on sys.path (no __init__.py; pyproject `pythonpath`), so the helpers here
(paths, trainer_utils, resume_utils) import by name. Tests are laid out by kind: unit/ (one process), dist/ (real
multi-process runs under torchrun, gloo, CPU; each worker next to its test), e2e/ (the real local Slurm cluster)."""

import os
import subprocess
import uuid
from pathlib import Path

import pytest

# pytest-xdist hands its workers COLUMNS (the controller's width, 80 in a pipe): a launch from a worker would
# take it for the user's terminal and print the compact step line (trainctl/terminal.py). Tests that
# mean a width set COLUMNS themselves; the rest run as `pytest -n 0` does, with none.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)


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
    """The README, then the docs/ pages, followed once per session (tests/readme_walkthrough.py): their
    examples' results, and the runs and profile they left in its working directory, for every test that
    checks them."""
    from readme_walkthrough import follow

    return follow(tmp_path_factory.mktemp("readme"))



# The suite runs on two pytest-xdist workers (pyproject addopts: `-n 2`): most of its time is
# spent waiting (on gloo's latency, on Slurm's scheduler, on a rank's timeout), so a second worker uses the
# core the first leaves idle. Work goes out in groups that each stay on one worker (`group_of`). xdist's own
# `xdist_group` mark renames the test's node id, which pytest 9 no longer allows (the mark is silently
# ignored), so the scheduler below groups by path instead.
SLURM_GROUP = "slurm-cluster"  # every e2e test: one client of the one local cluster at a time
README_GROUP = "readme-walkthrough"  # the files that read the session's README walkthrough: it runs once
README_FILES = ("tests/dist/test_calibrate.py", "tests/dist/test_readme_examples.py")


def group_of(nodeid: str) -> str:
    """The group of a test: its file (its module fixtures, one launch checked several ways, run once), all of
    tests/e2e together, or the README walkthrough's files together."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/e2e/"):
        return SLURM_GROUP
    if path in README_FILES:
        return README_GROUP
    return path


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Send out the long, mostly waiting groups first (the Slurm cluster, then the README walkthrough), so that
    neither is left for last on one worker while the other is idle; and keep README_FILES true."""
    for i in items:
        if "readme_walkthrough" in getattr(i, "fixturenames", ()) and group_of(i.nodeid) != README_GROUP:
            raise pytest.UsageError(f"{i.nodeid} reads the README walkthrough: add its file to README_FILES in "
                                    "tests/conftest.py, or the walkthrough runs once more on the other worker")
    first = {SLURM_GROUP: 0, README_GROUP: 1}
    items.sort(key=lambda i: first.get(group_of(i.nodeid), 2))  # stable: files keep their order otherwise

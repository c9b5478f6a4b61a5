"""`trainctl launch` with the local backend: run directory, rendered torchrun command, real launches."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from cli_utils import clone_parent, trainctl
from paths import REPO
from spec_utils import spec_with

from trainctl.errors import UsageError
from trainctl.launch import local
from trainctl.launch.create import check_run_dir, default_run_dir, freeze_spec, git_info
from trainctl.rundir.paths import RunPaths, read_jsonl
from trainctl.spec import RunSpec, load_spec, resolved_dict

TINY = REPO / "recipes" / "tiny-cpu.yaml"


def small_spec(**over: str) -> RunSpec:
    return spec_with(TINY, over)


# --- no torch in the CLI / launch layer ------------------------------------------------------------

def test_cli_and_launch_layer_do_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from trainctl.cli.app import main\n"
        "for argv in (['--help'], ['launch', '--help'], ['data', '--help'],\n"
        f"             ['launch', {str(TINY)!r}, '--dry-run', '--run-dir', {str(tmp_path / 'r')!r}]):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (argv, e.code)\n"
        "from pathlib import Path\n"
        "from trainctl.launch import local\n"
        "from trainctl.spec import load_spec\n"
        f"local.create(local.plan_local(load_spec({str(TINY)!r}), Path({str(tmp_path / 'r2')!r})))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\n"
        "print('IMPORTED', bad)\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# --- rendering -------------------------------------------------------------------------------------

def test_torchrun_command_uses_this_interpreter_and_logs_every_rank(tmp_path: Path) -> None:
    cmd = local.torchrun_command(tmp_path, 4, max_restarts=2)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    for flag in ("--standalone", "--nproc-per-node=4", "--max-restarts=2", f"--log-dir={tmp_path / 'logs'}",
                 "--redirects=3", "--tee=3"):
        assert flag in cmd
    assert not any(x.startswith("--local-ranks-filter") for x in cmd)  # every rank's lines: --verbose shows them
    assert cmd[-3:] == ["-m", "trainctl.runtime", str(tmp_path)]


def test_torchrun_accepts_the_flags_we_render() -> None:
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True,
                       text=True, timeout=120)
    for flag in ("--standalone", "--nproc-per-node", "--max-restarts", "--log-dir", "--redirects", "--tee"):
        assert flag in r.stdout, flag


def test_plan_local_threads_env_and_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "available_cpus", lambda: 16)
    plan = local.plan_local(small_spec(), tmp_path / "run")
    assert plan.nproc == 8 and plan.env["OMP_NUM_THREADS"] == "2"
    assert plan.run_dir == (tmp_path / "run").absolute()
    one = local.plan_local(small_spec(**{"cluster.gpus_per_node": "1", "parallel.tp": "1", "parallel.pp": "1",
                                         "parallel.dp": "1"}), tmp_path / "r1")
    assert one.env["OMP_NUM_THREADS"] == "16"
    monkeypatch.setattr(local, "available_cpus", lambda: 2)
    assert local.plan_local(small_spec(), tmp_path / "r2").env["OMP_NUM_THREADS"] == "1"  # never 0
    custom = local.plan_local(small_spec(**{"launcher.env": "{OMP_NUM_THREADS: '3', FOO: bar}"}), tmp_path / "r3")
    assert custom.env["OMP_NUM_THREADS"] == "3" and custom.env["FOO"] == "bar"  # the spec wins

    with pytest.raises(UsageError, match="cluster.nodes = 2"):
        local.plan_local(small_spec(**{"cluster.nodes": "2", "cluster.gpus_per_node": "4"}), tmp_path / "r4")
    with pytest.raises(UsageError, match="resolves to 'slurm', not local"):
        local.plan_local(small_spec(**{"launcher.backend": "slurm"}), tmp_path / "r5")
    # backend auto on one node is a local launch
    assert local.plan_local(small_spec(**{"launcher.backend": "auto"}), tmp_path / "r6").nproc >= 1
    with pytest.raises(UsageError, match="no such file"):
        local.plan_local(small_spec(**{"data.synthetic": "false", "data.path": str(tmp_path / "x.bin")}),
                         tmp_path / "r6")


def test_default_run_dir_is_name_and_time_and_never_collides(tmp_path: Path) -> None:
    spec = small_spec(**{"name": "'my run; $(x)'"})
    now = datetime(2026, 1, 2, 3, 4, 5)
    first = default_run_dir(spec, now, base=tmp_path)
    assert first == tmp_path / "my_run_x-20260102-030405"
    first.mkdir()
    assert default_run_dir(spec, now, base=tmp_path) == first  # empty: usable
    (first / "spec.yaml").write_text("x")
    assert default_run_dir(spec, now, base=tmp_path) == tmp_path / "my_run_x-20260102-030405-2"
    # a launch makes its own at once (mkdir of a name nobody holds): never one that exists, even empty
    made = [default_run_dir(spec, now, base=tmp_path, create=True) for _ in range(2)]
    assert made == [tmp_path / "my_run_x-20260102-030405-2", tmp_path / "my_run_x-20260102-030405-3"]
    assert all(d.is_dir() and not any(d.iterdir()) for d in made)


def test_freeze_spec_makes_data_path_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec = freeze_spec(small_spec(**{"data.synthetic": "false", "data.path": "data/t.bin"}))
    assert spec.data.path == str(tmp_path / "data" / "t.bin")


def test_create_run_dir(tmp_path: Path) -> None:
    plan = local.plan_local(small_spec(**{"name": "quo'te"}), tmp_path / "run")
    paths = local.create(plan)
    assert paths == RunPaths(plan.run_dir)
    assert paths.logs.is_dir()
    # the frozen spec is the resolved spec, and loads back to the same run
    frozen = yaml.safe_load(paths.spec.read_text())
    assert frozen == resolved_dict(plan.spec)
    assert resolved_dict(load_spec(paths.spec)) == resolved_dict(plan.spec)
    # launch.sh runs exactly the command (shell-quoted)
    script = paths.launch_script.read_text()
    assert script.startswith("#!/usr/bin/env bash\n") and os.access(paths.launch_script, os.X_OK)
    assert "exec " + shlex.join(plan.command) in script
    assert "export OMP_NUM_THREADS=" in script
    predicted = json.loads(paths.plan.read_text())
    assert predicted["world_size"] == 8 and predicted["layout"]["tp"] == 2
    job = json.loads(paths.job.read_text())
    assert job["backend"] == "local" and job["command"] == plan.command and job["attempts"] == []
    assert set(job["git"]) == {"commit", "dirty"} and job["created"]
    # a run directory records one run: refuse to reuse it
    with pytest.raises(UsageError, match="already exists and is not empty"):
        check_run_dir(paths.root)
    with pytest.raises(UsageError, match="already exists"):
        local.plan_local(small_spec(), paths.root)


def test_git_info_outside_a_repository(tmp_path: Path) -> None:
    assert git_info(tmp_path) == {"commit": None, "dirty": None}
    info = git_info()
    if info["commit"] is not None:  # running from a checkout
        assert len(info["commit"]) == 40 and isinstance(info["dirty"], bool)


CONSOLE = ["[default0]:step 1\n",
           "W1124 14:00:00.000 torch/distributed/elastic/agent/server/api.py:1 some warning\n",
           "[default0]:Traceback (most recent call last):\n", '[default0]:  File "x.py", line 1, in f\n',
           "[default0]:RuntimeError: \n", "[default0]:        Failed to run stage backward:\n", "[default0]:\n",
           "[default0]:The above exception was the direct cause of the following exception:\n",
           "[default0]:Traceback (most recent call last):\n", "[default0]:ValueError: bad\n",
           "[default0]:trainctl: rank 0 failed: ValueError: bad\n",
           "Traceback (most recent call last):\n",
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n",
           "  rank      : 1 (local_rank: 1)\n", "[default0]:trainctl: warning: something\n", "[default0]:step 2\n",
           "[default1]:Traceback (most recent call last):\n", "[default1]:RuntimeError: rank 1's own\n",
           "[default1]:trainctl: warning: rank 1's warning\n",
           "[default0]:trainctl: rank 0: watchdog: no step progress for 4 s (limit 4 s; ...)\n",
           "[default0]:Thread 0x00007f3 (most recent call first):\n", '[default0]:  File "t.py", line 9 in wait\n',
           "[default0]:\n", "[default0]:Current thread 0x00007f4 (most recent call first):\n",
           '[default0]:  File "d.py", line 3 in finish\n', "[default0]:step 3\n"]


def test_console_filter_shows_rank0s_own_lines_only() -> None:
    """Rank 0's step and warning lines; not its tracebacks (chained, with indented multi-line messages) or the
    watchdog's stack dump, not its "failed" or "watchdog" summary (the launcher names the first cause), not
    torchrun's log lines or failure block, not the other ranks' lines."""
    f = local.ConsoleFilter()
    assert [x for x in (f.filter(line) for line in CONSOLE) if x is not None] == [
        "step 1\n", "trainctl: warning: something\n", "step 2\n", "step 3\n"]


def test_console_filter_verbose_shows_everything() -> None:
    f = local.ConsoleFilter(verbose=True)
    assert [f.filter(line) for line in CONSOLE] == CONSOLE


# --- the CLI ---------------------------------------------------------------------------------------

def test_cli_dry_run_creates_nothing(tmp_path: Path) -> None:
    r = trainctl("launch", str(TINY), "--dry-run", "--set", "train.steps=3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "run dir (not created): " + str(tmp_path / "runs" / "tiny-cpu-") in r.stdout
    assert "-m torch.distributed.run --standalone --nproc-per-node=8" in r.stdout
    assert "OMP_NUM_THREADS=" in r.stdout
    assert not (tmp_path / "runs").exists()


def test_cli_launch_refused_without_run_dir_leaves_no_directory(tmp_path: Path) -> None:
    """The default run directory is made before the checks (atomically: concurrent launches never share one) and
    taken back when a check refuses the launch."""
    r = trainctl("launch", str(TINY), "--set", "data.synthetic=false", "--set", f"data.path={tmp_path / 'nope.bin'}",
                 cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert not list((tmp_path / "runs").glob("*"))  # nothing left behind (runs/ itself may stay)


@pytest.mark.parametrize("case", ["missing-data", "bad-spec", "existing-run-dir", "two-nodes"])
def test_cli_launch_errors_exit_2_with_one_line(tmp_path: Path, case: str) -> None:
    run_dir = tmp_path / "run"
    args = ["launch", str(TINY), "--run-dir", str(run_dir)]
    if case == "missing-data":
        args += ["--set", "data.synthetic=false", "--set", f"data.path={tmp_path / 'nope.bin'}"]
    elif case == "bad-spec":
        args += ["--set", "parallel.tp=3"]
    elif case == "existing-run-dir":
        run_dir.mkdir()
        (run_dir / "spec.yaml").write_text("name: other\n")
    else:
        args += ["--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=4"]
    r = trainctl(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) >= 1 and "Traceback" not in r.stderr
    if case != "bad-spec":  # a spec may have several problems, one line each
        assert len(errors) == 1
    if case == "existing-run-dir":
        assert [p.name for p in run_dir.iterdir()] == ["spec.yaml"]  # untouched
    else:
        assert not run_dir.exists()  # nothing created before the checks pass


# --- real launches of the bundled trainer ----------------------------------------------------------

# The default recipe's real launch (8 ranks, TP2 x PP2 x DP2) is the README's walkthrough, run and checked in
# tests/dist/test_readme_examples.py (test_quick_run_directory).


@pytest.mark.slow
def test_launch_on_prepared_sample_text(tmp_path: Path) -> None:
    """The quickstart path end to end: prepare the shipped text, train on the token file. Launched by the console
    script (not `python -m`) from the clone's parent directory, so the same run shows that the ranks import the
    installed package, not the folder `./trainctl/` (the test below checks the start-up check that guards it)."""
    tokens = tmp_path / "sample.bin"
    r = trainctl("data", "prepare", str(REPO / "trainctl" / "data" / "sample.txt"), str(tokens))
    assert r.returncode == 0, r.stderr
    parent = clone_parent(tmp_path)
    r = trainctl("launch", str(TINY), "--run-dir", "run", "--set", "train.steps=2",
                 "--set", "data.synthetic=false", "--set", f"data.path={tokens}",
                 "--set", "cluster.gpus_per_node=2", "--set", "parallel.tp=1", "--set", "parallel.pp=1",
                 "--set", "parallel.dp=2", "--set", "parallel.sequence_parallel=false", cwd=parent, installed=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = parent / "run"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert load_spec(run_dir / "spec.yaml").data.path == str(tokens)


DP2 = ["--set", "cluster.gpus_per_node=2", "--set", "parallel.tp=1", "--set", "parallel.pp=1",
       "--set", "parallel.dp=2", "--set", "checkpoint.every_steps=null"]


@pytest.mark.slow
def test_verbose_shows_the_failing_ranks_traceback(tmp_path: Path) -> None:
    """Rank 1 raises at step 3: with --verbose its traceback reaches the terminal, prefixed by its rank; without,
    the terminal has rank 0's lines and the one line naming the cause, the traceback only the logs. Step 3, not 2:
    rank 1 reaches it only after step 2's gradient all-reduce, which rank 0 joins after printing its step-1 line;
    failing at step 2 could kill rank 0 between step 1's last collective and that line."""
    from trainctl.runtime.train import faults

    out = {}
    for mode in ("--verbose", None):
        run_dir = tmp_path / f"run{mode or ''}"
        r = trainctl("launch", str(TINY), "--run-dir", str(run_dir), "--set", "train.steps=4", *DP2,
                     *([mode] if mode else []), env=faults.encode(fail_at_step=3, fail_rank=1))
        assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
        assert "run failed: rank 1 on " in r.stdout and "InjectedFailure" in r.stdout, r.stdout[-3000:]
        out[mode] = r.stdout
        log = (run_dir / "logs" / "launcher.log").read_text()
        assert "[default1]:Traceback (most recent call last):" in log  # the console copy has every rank's
    verbose, quiet = out["--verbose"], out[None]
    assert "[default1]:Traceback (most recent call last):" in verbose
    assert "[default1]:trainctl.runtime.train.trainer.InjectedFailure: fault fail_at_step=3" in verbose, verbose[-3000:]
    assert "Traceback" not in quiet and "[default" not in quiet, quiet[-3000:]
    assert "step 1" in quiet  # rank 0's own lines, as before


@pytest.mark.slow
def test_ranks_import_the_installed_package_whatever_the_working_directory_holds(tmp_path: Path) -> None:
    """Launched from the clone's parent directory, where `./trainctl/` is the git clone (a folder without the
    package's __init__.py): the ranks must not import it (test_launch_on_prepared_sample_text trains from there).
    Without PYTHONSAFEPATH (Python 3.10 has none) their start-up check stops the run before the first step,
    naming the folder."""
    from spec_utils import write_spec

    parent = clone_parent(tmp_path)
    r = trainctl("launch", str(write_spec(tmp_path / "spec.yaml")), "--run-dir", "bare",
                 "--set", "launcher.env.PYTHONSAFEPATH=", cwd=parent, installed=True)
    assert r.returncode == 1
    assert (f"run failed: rank 0 on {os.uname().nodename}: exception: trainctl was imported from "
            f"{parent / 'trainctl'}, a folder without the package's __init__.py") in r.stdout
    assert read_jsonl(parent / "bare" / "metrics.jsonl") == []  # stopped before the first step

"""launcher.setup, launcher.python, launcher.container and launcher.nccl: the spec rules (exit 2 lines), the
rendered sbatch script in both modes (rendered, then run by bash against a fake srun), the local command,
and how a failed setup line is reported (docs/design/launch.md, "Containers and environment")."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cli_utils import trainctl
from paths import REPO
from spec_utils import spec_with

from trainctl.errors import SpecError, UsageError
from trainctl.launch import local
from trainctl.launch.slurm import render
from trainctl.rundir.runstate import first_cause
from trainctl.spec import RunSpec, load_spec

TINY = REPO / "trainctl" / "spec" / "tiny-cpu.yaml"
SLURM = {"cluster.nodes": "2", "cluster.gpus_per_node": "2", "parallel.dp": "1", "launcher.backend": "slurm"}
EVIL = "x'; touch MARK $(touch MARK) `touch MARK` \" |"
SETUP = ["module load cuda/12.4", 'export PROBE="a b $((6 * 7))"  # a comment',
         "if [ -n \"${PROBE:-}\" ]; then\n  echo ready\nfi"]


def slurm_spec(**over: object) -> RunSpec:
    return spec_with(TINY, SLURM, over)


def slurm(tmp_path: Path, mode: str, **over: object) -> render.SlurmLaunch:
    return render.plan_slurm(slurm_spec(**{"launcher.mode": mode, **over}), tmp_path / mode, python="/venv/bin/python")


def words(step: list[str], tmp_path: Path) -> list[str]:
    """The srun line's words as bash passes them to srun (srun replaced by printf)."""
    env = {"PATH": "/usr/bin:/bin", "STEP_PYTHON": "/py", "RUN_DIR": "/run", "SLURM_JOB_ID": "1",
           "SLURM_NNODES": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "2"}
    line = " ".join(["printf '%s\\0'", *step[1:]])
    out = subprocess.run(["bash", "-c", line], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    return out.stdout.split("\0")[:-1]


# --- spec rules: one line naming the field, exit 2 ---------------------------------------------------------

@pytest.mark.parametrize(("sets", "needle"), [
    ({"launcher.nccl.debug": "INFO", "launcher.env.NCCL_DEBUG": "WARN"},
     "launcher.env.NCCL_DEBUG = 'WARN': also set by launcher.nccl.debug = 'INFO'. Fix: keep one"),
    ({"launcher.nccl.ib_hca": "mlx5_0", "launcher.env_passthrough": ["NCCL_IB_HCA"]},
     "launcher.env_passthrough = 'NCCL_IB_HCA': also set by launcher.nccl.ib_hca = 'mlx5_0'"),
    ({"launcher.nccl.debug": "LOUD"}, "launcher.nccl.debug"),
    ({"launcher.python": "' '"}, "launcher.python = ' ': an empty interpreter"),
    ({"launcher.python": "''"}, "launcher.python"),
    ({"launcher.container.image": "img", "launcher.backend": "local", "cluster.nodes": 1},
     "launcher.container = 'img': containers run through Slurm's pyxis plugin"),
    ({"launcher.container.image": "img", "launcher.container.mounts": ["/a:/b,/c:/c"]},
     "launcher.container.mounts[0] = '/a:/b,/c:/c': not one SRC[:DST[:FLAGS]] mount"),
    ({"launcher.container.image": "img", "launcher.container.mounts": ["/a:/a", "data:/data"]},
     "launcher.container.mounts[1] = 'data:/data': a relative path"),
    ({"launcher.container.image": "img", "launcher.container.workdir": "work"},
     "launcher.container.workdir = 'work': a relative path inside the container"),
    ({"launcher.container.mounts": ["/a:/a"]}, "launcher.container.image"),
])
def test_spec_rules_name_the_field(sets: dict, needle: str) -> None:
    with pytest.raises(SpecError) as e:
        slurm_spec(**sets)
    assert needle in str(e.value)


def test_cli_refuses_a_container_on_the_local_backend_with_one_line(tmp_path: Path) -> None:
    r = trainctl("launch", str(TINY), "--set", "launcher.container.image=img", "--dry-run",
                 "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    [line] = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "launcher.container = 'img'" in line and "Traceback" not in r.stderr


def test_a_setup_line_that_is_not_a_whole_command_is_refused(tmp_path: Path) -> None:
    for bad in ('echo "unclosed', "if true; then echo", "}"):
        with pytest.raises(UsageError, match=r"launcher.setup\[1\] = .* is not a complete shell command"):
            slurm(tmp_path, "srun", **{"launcher.setup": ["true", bad]})
    with pytest.raises(UsageError, match=r"launcher.setup\[0\]"):
        local.plan_local(load_spec(TINY, ['launcher.setup=["(echo"]']), tmp_path / "l")


# --- the rendered script ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["srun", "torchrun"])
def test_setup_python_and_nccl_without_a_container(tmp_path: Path, mode: str) -> None:
    launch = slurm(tmp_path, mode, **{"launcher.setup": SETUP, "launcher.python": "/opt/env/bin/python",
                                      "launcher.nccl.socket_ifname": "^docker,lo", "launcher.nccl.debug": "INFO",
                                      "launcher.nccl.ib_hca": "=mlx5_0:1", "launcher.nccl.debug_subsys": "INIT,NET"})
    script, step = launch.script, launch.rendered.step
    assert "PYTHON=/opt/env/bin/python  #" in script  # launcher.python wins over the caller's python=
    for line in ("export NCCL_SOCKET_IFNAME='^docker,lo'", "export NCCL_IB_HCA==mlx5_0:1", "export NCCL_DEBUG=INFO",
                 "export NCCL_DEBUG_SUBSYS=INIT,NET"):
        assert line in script.splitlines()
    assert "NCCL_DEBUG=WARN" not in script
    # the batch script runs every line verbatim, each checked, after the environment and before the step
    batch = "{ module load cuda/12.4\n} || setup_failed 0 \"$?\"\n"
    assert batch in script and script.index(batch) < script.index("srun --nodes")
    assert "{ if [ -n \"${PROBE:-}\" ]; then\n  echo ready\nfi\n} || setup_failed 2" in script
    assert script.index("export NCCL_DEBUG=INFO") < script.index(batch)
    argv = words(step, tmp_path)
    assert not any(a.startswith("--container") for a in argv)
    if mode == "srun":  # every rank is a task of srun started from the batch shell: it inherits the setup
        assert argv[argv.index("--label") + 1:] == ["/py", "-u", "-m", "trainctl.runtime", "/run"]
    else:  # each node's task runs the lines again before torchrun (node-local effects; the container case)
        task = argv[argv.index("-c") + 1]
        assert '{ module load cuda/12.4\n} || trainctl_setup_failed 0 "$?"' in task
        # the stop signals are ignored from the task's first line: a stop during the setup must not kill the task
        assert task.index('trap "" USR1 TERM') < task.index("trainctl_setup_failed 0") < task.index("exec")
        assert argv[argv.index("-c") + 3:argv.index("-c") + 6] == ["/py", "-m", "torch.distributed.run"]
    assert launch.warnings == ()


@pytest.mark.parametrize("mode", ["srun", "torchrun"])
def test_container_options_on_the_step_and_setup_inside_it(tmp_path: Path, mode: str) -> None:
    evil_mount = f"/data/{EVIL}:/data"
    launch = slurm(tmp_path, mode, **{
        "launcher.container.image": "nvcr.io#nvidia/pytorch:24.05-py3", "launcher.setup": SETUP,
        "launcher.container.mounts": [f"{tmp_path}:{tmp_path}", evil_mount, "/scratch:/scratch:ro+rprivate"],
        "launcher.container.workdir": "/work dir", "launcher.python": "python3",
        "launcher.srun_args": ["--container-name=keep"]})
    argv = words(launch.rendered.step, tmp_path)
    assert argv[argv.index("--label") + 1 + (mode == "torchrun"):][:4] == [
        "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
        f"--container-mounts={tmp_path}:{tmp_path},{evil_mount},/scratch:/scratch:ro+rprivate",
        "--container-workdir=/work dir", "--container-name=keep"]  # the user's srun_args after ours
    assert not (tmp_path / "MARK").exists()
    # the lines run inside the image, in each task; the host's batch script does not run them
    assert "module load" not in launch.script.split("srun --nodes")[0]
    task = argv[argv.index("-c") + 1]
    assert '{ module load cuda/12.4\n} || trainctl_setup_failed 0 "$?"' in task
    tail = argv[argv.index("-c") + 2:]
    if mode == "srun":  # one task per rank, so each rank's shell runs them, then becomes the trainer
        assert task.endswith('exec "$@"') and tail == ["trainctl-setup", "/py", "-u", "-m", "trainctl.runtime", "/run"]
    else:
        assert tail[1:4] == ["/py", "-m", "torch.distributed.run"]
    assert 'PYTHON=python3  #' in launch.script
    assert launch.warnings == ()  # run dir and checkpoints under the first mount; python is the image's


def test_container_warns_of_paths_it_may_not_see(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data" / "tokens.bin"
    data.parent.mkdir()
    data.write_bytes(b"\0" * 4096)
    launch = slurm(tmp_path, "torchrun", **{"launcher.container.image": "img", "data.path": str(data),
                                             "data.synthetic": False, "model.vocab": 256,
                                             "launcher.container.mounts": [f"{data.parent}:/elsewhere",
                                                                           f"{tmp_path / 'torchrun'}"]})
    # the short form SRC mounts it at the same path (pyxis); a mount at another path does not count
    assert [w.split(" is not under")[0] for w in launch.warnings] == [f"data {data}",
                                                                       "launcher.python /venv/bin/python"]
    assert "add " + f"{data}:{data}" in launch.warnings[0]
    from trainctl.launch.slurm import backend

    monkeypatch.setattr(backend.shutil, "which", lambda _: None)  # no cluster check (sinfo) in a unit test
    text = "\n".join(line.text for line in backend.SlurmBackend().dry_run(launch))
    assert f"warning: data {data} is not under" in text and "--container-image=img" in text


def test_resume_keeps_launcher_python_and_the_recorded_default_apart(tmp_path: Path) -> None:
    from trainctl.launch.slurm import submit

    launch = slurm(tmp_path, "srun", **{"launcher.python": "/opt/env/bin/python"})
    paths = submit.create(launch)
    job = json.loads(paths.job.read_text())
    assert job["slurm"]["render"]["python"] == "/venv/bin/python"  # what a resume without launcher.python uses
    assert "PYTHON=/opt/env/bin/python" in paths.launch_script.read_text()


# --- the batch script run by bash, srun faked: where a failing setup line stops the run ---------------------

FAKE_SRUN = """#!/bin/bash
# runs the step's program as a task would: srun's options dropped, TRAINCTL_IN_TASK=1
while [[ "$1" == --* ]]; do shift; done
export TRAINCTL_IN_TASK=1 SLURMD_NODENAME=n1
exec "$@"
"""


def _run(tmp_path: Path, mode: str, setup: list[str]) -> tuple[int, str, list[dict]]:
    run = tmp_path / "run"
    launch = render.plan_slurm(slurm_spec(**{"launcher.mode": mode, "launcher.setup": setup}), run,
                               python=str(tmp_path / "bin" / "fake-python"))
    run.mkdir()
    (run / "events.jsonl").write_text("")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fakes = {"srun": FAKE_SRUN, "scontrol": "#!/bin/bash\n[ \"$1\" = show ] && echo n1\n",
             # the batch script's own uses of python: the fault probe, the run's excluded nodes
             "fake-python": '#!/bin/bash\ncase "$2" in trainctl.runtime.train.faults|trainctl.launch.exclusions) '
                            'exit 0;; esac\n'
                            f'echo "trainer ran with PROBE=$PROBE" >>{shlex.quote(str(run))}/ran\n'}
    for name, text in fakes.items():
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1"}
    proc = subprocess.run(["bash", "-c", launch.script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    return proc.returncode, proc.stdout + proc.stderr, events


@pytest.mark.parametrize("mode", ["srun", "torchrun"])
def test_setup_lines_reach_the_step(tmp_path: Path, mode: str) -> None:
    code, out, events = _run(tmp_path, mode, ['export PROBE="from setup $((6 * 7))"'])
    assert (tmp_path / "run" / "ran").read_text() == "trainer ran with PROBE=from setup 42\n", out
    assert code == 0 and "setup_failed" not in [e["event"] for e in events]


def test_a_failing_line_in_the_batch_script_stops_before_the_step(tmp_path: Path) -> None:
    code, out, events = _run(tmp_path, "torchrun", ["true", "false", "touch never"])
    assert code == 1 and not (tmp_path / "run" / "ran").exists() and not (tmp_path / "never").exists()
    assert "launcher.setup[1] failed (status 1); the training step was not started" in out
    assert [e["event"] for e in events] == ["slurm_start", "setup_failed"] and events[1]["item"] == 1
    assert first_cause(events).line().startswith("setup failed: launcher.setup[1] exited with status 1 in the batch")


def test_a_line_failing_in_a_node_task_is_not_retried_as_a_start_failure(tmp_path: Path) -> None:
    code, out, events = _run(tmp_path, "torchrun", ['[ -z "${TRAINCTL_IN_TASK:-}" ] || (exit 7)'])
    assert code == 7 and not (tmp_path / "run" / "ran").exists(), out
    kinds = [e["event"] for e in events]
    assert kinds == ["slurm_start", "setup_failed", "step_exit"], out  # no start_failed, no requeue
    assert (events[1]["item"], events[1]["exit_code"], events[1]["host"]) == (0, 7, "n1")
    assert "launcher.setup[0] failed (status 7) on n1" in out and "the trainer did not start" in out
    assert first_cause(events).line() == ("setup failed: launcher.setup[0] exited with status 7 on n1; the trainer "
                                          "did not start")


# --- the local backend --------------------------------------------------------------------------------------

def test_local_command_runs_the_setup_then_becomes_torchrun(tmp_path: Path) -> None:
    s = load_spec(TINY, [f"launcher.setup={json.dumps(SETUP)}", f"launcher.python={sys.executable}",
                         "launcher.nccl.debug=INFO"])
    launch = local.plan_local(s, tmp_path / "run")
    cmd = launch.command
    assert cmd[:2] == ["bash", "-c"] and cmd[2].endswith('exec "$@"') and cmd[3] == "trainctl-setup"
    assert cmd[4:7] == [sys.executable, "-m", "torch.distributed.run"] and launch.env["NCCL_DEBUG"] == "INFO"
    assert '{ module load cuda/12.4\n} || trainctl_setup_failed 0 "$?"' in cmd[2]
    assert shlex.quote(str(tmp_path / "run" / "events.jsonl")) in cmd[2]


def test_local_python_must_exist_and_run(tmp_path: Path) -> None:
    script = tmp_path / "py"
    script.write_text("#!/bin/sh\n")
    for value, why in ((str(tmp_path / "nope"), "does not exist"), (str(script), "is not executable"),
                       ("no-such-python-xyz", "is not on PATH")):
        with pytest.raises(UsageError, match=f"launcher.python = '{value}' {why}"):
            local.plan_local(load_spec(TINY, [f"launcher.python={value}"]), tmp_path / "r")
    os.chmod(script, 0o755)
    assert local.plan_local(load_spec(TINY, [f"launcher.python={script}"]), tmp_path / "r").command[0] == str(script)
    # a bare name the setup may put on PATH is left to the setup's shell
    s = load_spec(TINY, ["launcher.python=no-such-python-xyz", 'launcher.setup=["true"]'])
    assert local.plan_local(s, tmp_path / "r").command[4] == "no-such-python-xyz"

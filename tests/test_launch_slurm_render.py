"""Unit tests of the rendered sbatch script (both modes), option vetting, sinfo parsing and checks."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from trainctl.errors import UsageError
from trainctl.launch import slurm
from trainctl.launch.sbatch_template import SAFE_SBATCH_VALUE
from trainctl.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "trainctl" / "recipes" / "tiny-cpu.yaml"
BASE = {"cluster.nodes": "2", "cluster.gpus_per_node": "4", "launcher.backend": "slurm", "train.steps": "6"}


def spec(**over: str):
    return load_spec(TINY, [f"{k}={v}" for k, v in {**BASE, **over}.items()])


def sbatch_lines(script: str) -> list[str]:
    return [ln[len("#SBATCH "):] for ln in script.splitlines() if ln.startswith("#SBATCH ")]


def test_srun_mode_script(tmp_path: Path) -> None:
    s = spec(**{"launcher.mode": "srun", "cluster.gpu": "h100-sxm", "cluster.partition": "debug",
                "cluster.time": "'00:10:00'", "cluster.account": "acct", "cluster.qos": "normal",
                "cluster.constraint": "h100", "cluster.exclude": "n3", "cluster.mem": "'0'",
                "cluster.cpus_per_task": "2", "launcher.sbatch_args": "['--reservation=r1']"})
    launch = slurm.plan_slurm(s, tmp_path / "run", grace_s=120, python="/venv/bin/python")
    lines = sbatch_lines(launch.script)
    run = str((tmp_path / "run").absolute())
    assert lines == [
        "--job-name=tiny-cpu", "--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=2",
        "--mem=0", "--time=00:10:00", "--partition=debug", "--account=acct", "--qos=normal",
        "--constraint=h100", "--exclude=n3", f"--output={run}/logs/slurm-%j.out",
        f"--error={run}/logs/slurm-%j.out", "--open-mode=append", "--requeue", "--signal=B:USR1@120",
        "--reservation=r1",
    ]
    assert launch.rendered.cli_options == []
    assert launch.submit_argv() == ["sbatch", "--parsable", f"{run}/launch.sh"]
    script = launch.script
    assert script.startswith("#!/bin/bash\n")
    assert f"RUN_DIR={run}\n" in script and "PYTHON=/venv/bin/python" in script
    assert 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in script
    assert "MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))" in script
    step = " ".join(launch.rendered.step)
    assert step.startswith("srun --nodes=2 --ntasks=8 --ntasks-per-node=4 --kill-on-bad-exit=1 --label "
                           "--cpus-per-task=2")
    assert step.endswith('"$PYTHON" -u -m trainctl.runtime "$RUN_DIR"')
    for env in ("OMP_NUM_THREADS=\"${SLURM_CPUS_PER_TASK:-1}\"", "TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                "NCCL_DEBUG=WARN", "TORCH_NCCL_BLOCKING_WAIT=0", "PYTHONUNBUFFERED=1"):
        assert f"export {env}" in script
    for piece in ("trap on_usr1 USR1", 'kill -USR1 "$step_pid"', 'scontrol requeue "$SLURM_JOB_ID"',
                  "PreemptTime=[0-9]"):
        assert piece in script


def test_torchrun_mode_script(tmp_path: Path) -> None:
    launch = slurm.plan_slurm(spec(**{"launcher.max_restarts": "3"}), tmp_path / "r", python="/p/python")
    lines = sbatch_lines(launch.script)
    assert "--ntasks-per-node=1" in lines and "--cpus-per-task=4" in lines  # one rank's CPU at least
    assert not any(x.startswith("--gpus-per-node") for x in lines)  # cluster.gpu: cpu asks for no gres
    step = launch.rendered.step
    assert step[:4] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1"]
    joined = " ".join(step)
    for flag in ("-m torch.distributed.run", "--nnodes=$SLURM_NNODES", "--nproc-per-node=4",
                 "--rdzv-backend=c10d", '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
                 '--rdzv-id="$SLURM_JOB_ID"', "--max-restarts=3", "-m trainctl.runtime \"$RUN_DIR\""):
        assert flag in joined
    assert "trap \"\" USR1" in joined  # torchrun survives the USR1 meant for its workers
    assert 'export OMP_NUM_THREADS="$(( ${SLURM_CPUS_PER_TASK:-4} / 4 ))"' in launch.script


def test_torchrun_accepts_rendered_flags() -> None:
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    for flag in ("--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
                 "--max-restarts", "--redirects", "--tee", "--log-dir"):
        assert flag in out


def test_script_is_valid_bash(tmp_path: Path) -> None:
    for mode in ("srun", "torchrun"):
        launch = slurm.plan_slurm(spec(**{"launcher.mode": mode}), tmp_path / mode)
        f = tmp_path / f"{mode}.sh"
        f.write_text(launch.script)
        r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


EVIL = "x; touch /tmp/PWNED $(touch /tmp/PWNED) `touch /tmp/PWNED` \" ' & | < > * ?"


def test_metacharacters_are_quoted_or_moved_to_the_command_line(tmp_path: Path) -> None:
    run = tmp_path / EVIL.replace("/", "_")
    s = spec(**{"launcher.mode": "srun"}).model_copy(update={"name": EVIL})
    s = s.model_copy(update={"launcher": s.launcher.model_copy(update={
        "srun_args": [f"--comment={EVIL}"], "env": {"TRAINCTL_X": EVIL}, "sbatch_args": ["--comment=ok"]})})
    launch = slurm.plan_slurm(s, run)
    lines = sbatch_lines(launch.script)
    assert all(SAFE_SBATCH_VALUE.match(x) for x in lines)
    cli = launch.rendered.cli_options
    assert f"--job-name={EVIL}" in cli
    assert any(o.startswith("--output=") for o in cli)
    assert cli[-1] == "--comment=ok"  # the user's extra options keep coming last (they win)
    script = launch.script
    assert f"RUN_DIR={shlex.quote(str(run.absolute()))}\n" in script
    assert f"export TRAINCTL_X={shlex.quote(EVIL)}\n" in script
    assert shlex.quote(f"--comment={EVIL}") in script
    # the body, run by bash up to the step, sets exactly the strings asked for (and runs nothing else)
    body = script.split("attempt=")[0].replace("MASTER_ADDR=", "true ").replace("MASTER_PORT=", "true ")
    probe = subprocess.run(["bash", "-c", body + '\nprintf "%s\\n" "$RUN_DIR" "$TRAINCTL_X"'],
                           capture_output=True, text=True, cwd=tmp_path,
                           env={"SLURM_JOB_ID": "1", "PATH": "/bin:/usr/bin"})
    assert probe.stdout.splitlines()[-2:] == [str(run.absolute()), EVIL], probe.stdout + probe.stderr
    assert not (tmp_path / "PWNED").exists() and not Path("/tmp/PWNED").exists()


@pytest.mark.parametrize(("field", "value", "match"), [
    ("name", "a\nb", "newline"),
    ("cluster.partition", "debug\n#SBATCH --x", "newline"),
    ("launcher.sbatch_args", ["reservation=r1"], "not an option"),
    ("launcher.srun_args", ["hostname"], "not an option"),
    ("cluster.time", "ten minutes", "not a Slurm time"),
])
def test_bad_values_are_rejected(tmp_path: Path, field: str, value, match: str) -> None:
    s = spec()
    section, _, key = field.rpartition(".")
    if section:
        sub = getattr(s, section).model_copy(update={key: value})
        s = s.model_copy(update={section: sub})
    else:
        s = s.model_copy(update={key: value})
    with pytest.raises(UsageError, match=match):
        slurm.plan_slurm(s, tmp_path / "r")


def test_percent_in_run_dir_is_escaped_and_backslash_rejected(tmp_path: Path) -> None:
    launch = slurm.plan_slurm(spec(), tmp_path / "a%b")
    assert any("a%%b/logs/slurm-%j.out" in o for o in launch.rendered.options)
    with pytest.raises(UsageError, match="backslash"):
        slurm.plan_slurm(spec(), tmp_path / "a\\b")


def test_parse_time() -> None:
    assert slurm.parse_time("10") == 10
    assert slurm.parse_time("05:30") == 6
    assert slurm.parse_time("1:00:00") == 60
    assert slurm.parse_time("2-03") == 2 * 1440 + 180
    assert slurm.parse_time("1-00:00:01") == 1441
    assert slurm.parse_time("UNLIMITED") == 10**9
    assert slurm.parse_time("1h") is None


SINFO = """debug*|up|1:00:00|n1|idle|gpu:4|8
debug*|up|1:00:00|n2|mix|gpu:4(S:0)|8
short|up|5:00|n1|idle|gpu:4|8
cpu|up|infinite|c1|idle|(null)|64
"""


def test_sinfo_checks() -> None:
    nodes = slurm.parse_sinfo(SINFO)
    assert nodes[1].gpus == 4 and nodes[0].default and nodes[3].max_time_min == 10**9
    assert slurm.check_cluster(spec(**{"cluster.gpu": "h100-sxm"}), nodes) == []
    assert slurm.check_cluster(spec(**{"cluster.gpu": "h100-sxm", "cluster.partition": "debug",
                                       "cluster.time": "'1:00:00'"}), nodes) == []
    [p] = slurm.check_cluster(spec(**{"cluster.partition": "gpu"}), nodes)
    assert "cluster.partition = 'gpu'" in p and "debug, short" in p
    [p] = slurm.check_cluster(spec(**{"cluster.partition": "debug", "cluster.time": "'2:00:00'"}), nodes)
    assert "cluster.time = '2:00:00'" in p and "01:00:00" in p
    problems = slurm.check_cluster(spec(**{"cluster.partition": "short", "cluster.gpu": "h100-sxm"}), nodes)
    assert any("cluster.nodes = 2" in x and "1 node(s)" in x for x in problems)
    problems = slurm.check_cluster(spec(**{"cluster.partition": "cpu", "cluster.gpu": "h100-sxm",
                                           "cluster.nodes": "1", "cluster.gpus_per_node": "8"}), nodes)
    assert len(problems) == 1 and "cluster.gpus_per_node = 8" in problems[0] and "at most 0" in problems[0]
    one = spec(**{"cluster.partition": "cpu", "cluster.nodes": "1", "cluster.gpus_per_node": "8"})
    assert slurm.check_cluster(one, nodes) == []  # gpu: cpu needs no gres


def test_parse_kv_and_jobcomp(tmp_path: Path) -> None:
    log = tmp_path / "jobcomp.log"
    log.write_text("JobId=7 UserId=root(0) Name=a JobState=REQUEUED NodeList=n[1-2] ExitCode=0:0\n"
                   "JobId=17 UserId=root(0) Name=b JobState=FAILED NodeList=n1 ExitCode=1:0\n"
                   "JobId=7 UserId=root(0) Name=a JobState=COMPLETED NodeList=n[1-2] ExitCode=0:0\n")
    rec = slurm.jobcomp_record("7", log)
    assert rec is not None and rec["JobState"] == "COMPLETED" and rec["NodeList"] == "n[1-2]"
    assert slurm.jobcomp_record("1", log) is None


def test_create_writes_script_commands_and_job(tmp_path: Path) -> None:
    launch = slurm.plan_slurm(spec(), tmp_path / "run")
    paths = slurm.create(launch)
    assert paths.launch_script.read_text() == launch.script
    assert (paths.launch_script.stat().st_mode & 0o111) != 0
    cmds = (paths.root / "commands.txt").read_text()
    assert shlex.join(launch.submit_argv()) in cmds and "torch.distributed.run" in cmds
    import json

    job = json.loads(paths.job.read_text())
    assert job["backend"] == "slurm" and job["slurm"]["mode"] == "torchrun"
    assert job["command"] == launch.submit_argv() and "commit" in job["git"]
    assert (paths.root / "spec.yaml").exists()


def test_slurm_dry_run_and_run_commands_do_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from trainctl.cli.app import main\n"
        f"for argv in (['launch', {str(TINY)!r}, '--dry-run', '--run-dir', {str(tmp_path / 'r')!r},\n"
        "              '--set', 'launcher.backend=slurm', '--set', 'cluster.nodes=2',\n"
        "              '--set', 'cluster.gpus_per_node=4'],\n"
        "             ['status', '--help'], ['logs', '--help'], ['runs', " + repr(str(tmp_path)) + "]):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (argv, e.code)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _reports(nodes: list[str]) -> list[dict]:
    return [{"host": "h", "node": n, "local_rank": i % 4, "gpu": str(i % 4)} for i, n in enumerate(nodes)]


def test_placement_map_follows_what_ranks_report() -> None:
    from trainctl.plan.placement import Layout
    from trainctl.runtime.placement_proof import PlacementError, build_map, check

    layout = Layout(tp=2, pp=2, dp=2, gpus_per_node=4, nvlink_domain=4)
    joined = build_map(_reports(["n2"] * 4 + ["n1"] * 4), layout)  # c10d join order: ranks 0-3 on n2
    assert joined["nodes"] == ["n2", "n1"] and joined["ranks"][0]["node"] == "n2"
    r5 = joined["ranks"][5]
    assert (r5["tp"], r5["dp"], r5["pp"], r5["node"], r5["node_index"]) == (1, 0, 1, "n1", 1)
    check(joined)
    interleaved = build_map(_reports(["n1", "n2"] * 4), layout)  # round-robin placement
    assert len(interleaved["tp_groups_across_nodes"]) == 4
    with pytest.raises(PlacementError, match="span two nodes"):
        check(interleaved)

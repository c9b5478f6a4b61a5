"""Unit tests of the rendered sbatch script (both modes), option vetting, sinfo parsing and checks."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO
from spec_utils import spec_with
from trainer_utils import files_containing

from trainctl.errors import UsageError
from trainctl.launch.slurm import cluster, job_state, render, submit
from trainctl.launch.slurm.sbatch_template import SAFE_SBATCH_VALUE
from trainctl.spec import RunSpec, load_spec

TINY = REPO / "trainctl" / "spec" / "tiny-cpu.yaml"
BASE = {"cluster.nodes": "2", "cluster.gpus_per_node": "4", "launcher.backend": "slurm", "train.steps": "6"}


def slurm_spec(**over: str) -> RunSpec:
    return spec_with(TINY, BASE, over)


def sbatch_lines(script: str) -> list[str]:
    return [ln[len("#SBATCH "):] for ln in script.splitlines() if ln.startswith("#SBATCH ")]


def test_srun_mode_script(tmp_path: Path) -> None:
    s = slurm_spec(**{"launcher.mode": "srun", "cluster.gpu": "h100-sxm", "cluster.partition": "debug",
                "cluster.time": "'00:10:00'", "cluster.account": "acct", "cluster.qos": "normal",
                "cluster.constraint": "h100", "cluster.exclude": "n3", "cluster.mem": "'0'",
                "cluster.cpus_per_task": "2", "launcher.sbatch_args": "['--reservation=r1']"})
    launch = render.plan_slurm(s, tmp_path / "run", grace_s=120, python="/venv/bin/python")
    lines = sbatch_lines(launch.script)
    run = str((tmp_path / "run").absolute())
    assert lines == [
        "--job-name=tiny-cpu", "--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=2",
        "--mem=0", "--time=00:10:00", "--partition=debug", "--account=acct", "--qos=normal",
        "--constraint=h100", "--exclude=n3", f"--output={run}/logs/slurm-%j.out",
        f"--error={run}/logs/slurm-%j.err", "--open-mode=append", "--requeue", "--signal=B:USR1@120",
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
    assert step.endswith('"$STEP_PYTHON" -u -m trainctl.runtime "$RUN_DIR"')
    for env in ("OMP_NUM_THREADS=\"${SLURM_CPUS_PER_TASK:-1}\"", "TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                "NCCL_DEBUG=WARN", "TORCH_NCCL_BLOCKING_WAIT=0", "PYTHONUNBUFFERED=1"):
        assert f"export {env}" in script
    for piece in ("trap on_usr1 USR1", 'kill -USR1 "$step_pid"', 'scontrol requeue "$SLURM_JOB_ID"',
                  "PreemptTime=[0-9]"):
        assert piece in script


def test_torchrun_mode_script(tmp_path: Path) -> None:
    launch = render.plan_slurm(slurm_spec(**{"launcher.max_restarts": "3"}), tmp_path / "r", python="/p/python")
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


def test_torchrun_first_node_hosts_the_rendezvous(tmp_path: Path) -> None:
    """Each node's wrapper tells torchrun whether it hosts the c10d store (the first node of the allocation),
    keeping a launcher.env PET_RDZV_CONF in front: on the one-host test cluster every node matched the
    endpoint's name and n2's agent could host it (docs/design/launch.md, "Elastic node ranges")."""
    launch = render.plan_slurm(slurm_spec(**{"cluster.min_nodes": "1", "launcher.max_restarts": "1"}), tmp_path / "r")
    step = launch.rendered.step
    wrapper = shlex.split(step[step.index("bash") + 2])[0]
    for node, user, want in (("n1", "", "is_host=1"), ("n2", "", "is_host=0"),
                             ("n2", "last_call_timeout=2", "last_call_timeout=2,is_host=0")):
        env = {"PATH": "/usr/bin:/bin", "SLURMD_NODENAME": node, "MASTER_ADDR": "n1",
               **({"PET_RDZV_CONF": user} if user else {})}
        out = subprocess.run(["bash", "-c", wrapper, str(tmp_path), "printenv", "PET_RDZV_CONF"], env=env,
                             capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == want, (node, out.stdout, out.stderr)


def test_torchrun_accepts_rendered_flags() -> None:
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    for flag in ("--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
                 "--max-restarts", "--redirects", "--tee", "--log-dir"):
        assert flag in out


def test_script_is_valid_bash(tmp_path: Path) -> None:
    for mode in ("srun", "torchrun"):
        launch = render.plan_slurm(slurm_spec(**{"launcher.mode": mode}), tmp_path / mode)
        f = tmp_path / f"{mode}.sh"
        f.write_text(launch.script)
        r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


EVIL = "x; touch /tmp/PWNED $(touch /tmp/PWNED) `touch /tmp/PWNED` \" ' & | < > * ?"


def test_metacharacters_are_quoted_or_moved_to_the_command_line(tmp_path: Path) -> None:
    run = tmp_path / EVIL.replace("/", "_")
    s = slurm_spec(**{"launcher.mode": "srun"}).model_copy(update={"name": EVIL})
    s = s.model_copy(update={"launcher": s.launcher.model_copy(update={
        "srun_args": [f"--comment={EVIL}"], "env": {"TRAINCTL_X": EVIL}, "sbatch_args": ["--comment=ok"]})})
    launch = render.plan_slurm(s, run)
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
    s = slurm_spec()
    section, _, key = field.rpartition(".")
    if section:
        sub = getattr(s, section).model_copy(update={key: value})
        s = s.model_copy(update={section: sub})
    else:
        s = s.model_copy(update={key: value})
    with pytest.raises(UsageError, match=match):
        render.plan_slurm(s, tmp_path / "r")


def test_percent_in_run_dir_is_escaped_and_backslash_rejected(tmp_path: Path) -> None:
    launch = render.plan_slurm(slurm_spec(), tmp_path / "a%b")
    assert any("a%%b/logs/slurm-%j.out" in o for o in launch.rendered.options)
    with pytest.raises(UsageError, match="backslash"):
        render.plan_slurm(slurm_spec(), tmp_path / "a\\b")


def test_parse_time() -> None:
    assert cluster.parse_time("10") == 10
    assert cluster.parse_time("05:30") == 6
    assert cluster.parse_time("1:00:00") == 60
    assert cluster.parse_time("2-03") == 2 * 1440 + 180
    assert cluster.parse_time("1-00:00:01") == 1441
    assert cluster.parse_time("UNLIMITED") == 10**9
    assert cluster.parse_time("1h") is None


SINFO = """debug*|up|1:00:00|n1|idle|gpu:4|8
debug*|up|1:00:00|n2|mix|gpu:4(S:0)|8
short|up|5:00|n1|idle|gpu:4|8
cpu|up|infinite|c1|idle|(null)|64
"""


def test_sinfo_checks() -> None:
    nodes = cluster.parse_sinfo(SINFO)
    assert nodes[1].gpus == 4 and nodes[0].default and nodes[3].max_time_min == 10**9
    assert cluster.check_cluster(slurm_spec(**{"cluster.gpu": "h100-sxm"}), nodes) == []
    assert cluster.check_cluster(slurm_spec(**{"cluster.gpu": "h100-sxm", "cluster.partition": "debug",
                                       "cluster.time": "'1:00:00'"}), nodes) == []
    [p] = cluster.check_cluster(slurm_spec(**{"cluster.partition": "gpu"}), nodes)
    assert "cluster.partition = 'gpu'" in p and "debug, short" in p
    [p] = cluster.check_cluster(slurm_spec(**{"cluster.partition": "debug", "cluster.time": "'2:00:00'"}), nodes)
    assert "cluster.time = '2:00:00'" in p and "01:00:00" in p
    problems = cluster.check_cluster(slurm_spec(**{"cluster.partition": "short", "cluster.gpu": "h100-sxm"}), nodes)
    assert any("cluster.nodes = 2" in x and "1 node(s)" in x for x in problems)
    problems = cluster.check_cluster(slurm_spec(**{"cluster.partition": "cpu", "cluster.gpu": "h100-sxm",
                                           "cluster.nodes": "1", "cluster.gpus_per_node": "8"}), nodes)
    assert len(problems) == 1 and "cluster.gpus_per_node = 8" in problems[0] and "at most 0" in problems[0]
    one = slurm_spec(**{"cluster.partition": "cpu", "cluster.nodes": "1", "cluster.gpus_per_node": "8"})
    assert cluster.check_cluster(one, nodes) == []  # gpu: cpu needs no gres


def test_parse_kv_and_jobcomp(tmp_path: Path) -> None:
    log = tmp_path / "jobcomp.log"
    log.write_text("JobId=7 UserId=root(0) Name=a JobState=REQUEUED NodeList=n[1-2] ExitCode=0:0\n"
                   "JobId=17 UserId=root(0) Name=b JobState=FAILED NodeList=n1 ExitCode=1:0\n"
                   "JobId=7 UserId=root(0) Name=a JobState=COMPLETED NodeList=n[1-2] ExitCode=0:0\n")
    rec = job_state.jobcomp_record("7", log)
    assert rec is not None and rec["JobState"] == "COMPLETED" and rec["NodeList"] == "n[1-2]"
    assert job_state.jobcomp_record("1", log) is None


def test_create_writes_script_commands_and_job(tmp_path: Path) -> None:
    launch = render.plan_slurm(slurm_spec(), tmp_path / "run")
    paths = submit.create(launch)
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
        "        assert e.code in ((2,) if argv[0] == 'runs' else (0, None)), (argv, e.code)  # no runs: 2\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _reports(nodes: list[str]) -> list[dict]:
    return [{"host": "h", "node": n, "local_rank": i % 4, "gpu": str(i % 4)} for i, n in enumerate(nodes)]


def test_placement_map_follows_what_ranks_report() -> None:
    from trainctl.plan.placement import Layout
    from trainctl.runtime.parallel.placement_proof import PlacementError, build_map, check

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
    # the model stages each rank holds: one per pipeline rank here; ZBV's V with 4 pipeline ranks
    assert [x["stages"] for x in joined["ranks"]] == [[0]] * 4 + [[1]] * 4
    v = build_map(_reports(["n1"] * 4), Layout(tp=1, pp=4, dp=1, gpus_per_node=4, nvlink_domain=4, schedule="zbv"), 2)
    assert [x["stages"] for x in v["ranks"]] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert v["layout"]["schedule"] == "zbv" and v["layout"]["virtual_stages"] == 2


# --- the batch script's signal chain, run by bash against a fake srun/scontrol ------------------------

FAKE_SRUN = r"""#!/bin/bash
# Stands in for the training step: like the trainer it records "start" (unless FAKE_NO_START=1: the step
# never started), then FAKE_EVENTS; with FAKE_WAIT=1 it runs until USR1/TERM, then appends FAKE_ON_SIGNAL;
# it exits FAKE_RC.
run_dir="${@: -1}"
ev() { [ -n "$1" ] && printf '{"time":1,"event":"%s","pid":%d}\n' "$1" "$$" >>"$run_dir/events.jsonl"; }
[ "${FAKE_NO_START:-0}" = 1 ] && exit "$FAKE_RC"
ev start
for e in ${FAKE_EVENTS:-}; do ev "$e"; done
stop() { echo "srun got $1" >>"$run_dir/fake.log"; for e in ${FAKE_ON_SIGNAL:-}; do ev "$e"; done; exit "$FAKE_RC"; }
trap 'stop USR1' USR1
trap 'stop TERM' TERM
touch "$run_dir/step-up"
if [ "${FAKE_WAIT:-0}" = 1 ]; then while :; do sleep 0.05; done; fi
exit "$FAKE_RC"
"""

FAKE_SCONTROL = r"""#!/bin/bash
case "$1 $2" in
  "show hostnames") echo n1; echo n2 ;;
  "show job") echo "JobId=$SLURM_JOB_ID JobState=RUNNING ${FAKE_SHOW_JOB:-PreemptTime=None}" ;;
  requeue*) echo "requeue $2" >>"$FAKE_CALLS" ;;
esac
"""


def fake_slurm_bin(tmp_path: Path) -> Path:
    """A bin/ of fake srun and scontrol (FAKE_SRUN, FAKE_SCONTROL) for running a rendered batch script."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return bindir


def _run_batch_script(tmp_path: Path, mode: str, *, signal: str | None = None, rc: int = 0, wait: bool = False,
                      events: str = "", on_signal: str = "", show_job: str = "", before: str = "",
                      no_start: bool = False) -> tuple[int, list[str], list[str]]:
    """Run the rendered script under bash with fake srun/scontrol; (exit code, scontrol calls, events)."""
    import json
    import signal as sig
    import time

    run = tmp_path / "run"
    launch = render.plan_slurm(slurm_spec(**{"launcher.mode": mode}), run, python="/bin/false")
    run.mkdir(parents=True)
    (run / "events.jsonl").write_text(before)
    script = tmp_path / "launch.sh"
    script.write_text(launch.script)
    bindir = fake_slurm_bin(tmp_path)
    calls = tmp_path / "calls"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_NNODES": "2", "FAKE_RC": str(rc), "FAKE_WAIT": "1" if wait else "0", "FAKE_EVENTS": events,
           "FAKE_ON_SIGNAL": on_signal, "FAKE_SHOW_JOB": show_job, "FAKE_CALLS": str(calls),
           "FAKE_NO_START": "1" if no_start else "0"}
    proc = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        if signal is not None:
            deadline = time.monotonic() + 30
            while not (run / "step-up").exists():
                assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
                time.sleep(0.02)
            time.sleep(0.1)  # the script is in `wait` now
            proc.send_signal(getattr(sig, f"SIG{signal}"))
        out = proc.communicate(timeout=30)[0]
    finally:
        proc.kill()
    kinds = [json.loads(ln)["event"] for ln in (run / "events.jsonl").read_text().splitlines()]
    assert "step_exit" in kinds, out
    return proc.returncode, calls.read_text().split("\n")[:-1] if calls.exists() else [], kinds


@pytest.mark.parametrize("mode", ["srun", "torchrun"])
def test_usr1_to_the_batch_script_forwards_it_and_requeues(tmp_path: Path, mode: str) -> None:
    # the real trainer: checkpoint, then exit 75 under srun, 0 under torchrun
    code, calls, kinds = _run_batch_script(tmp_path, mode, signal="USR1", wait=True, rc=75 if mode == "srun" else 0,
                                           on_signal="checkpoint_on_signal preempted")
    assert (code, calls) == (0, ["requeue 123"])
    assert "srun got USR1" in (tmp_path / "run" / "fake.log").read_text()
    assert kinds == ["slurm_start", "start", "signal", "checkpoint_on_signal", "preempted", "step_exit", "requeue"]


def test_a_run_that_finished_is_not_requeued_by_a_late_usr1(tmp_path: Path) -> None:
    code, calls, kinds = _run_batch_script(tmp_path, "torchrun", signal="USR1", wait=True, on_signal="finish")
    assert (code, calls) == (0, []) and "requeue" not in kinds


def test_finish_of_an_earlier_job_does_not_count(tmp_path: Path) -> None:
    """`trainctl resume --from-step` of a finished run: the old `finish` must not stop a requeue."""
    old = '{"time":1,"event":"finish","pid":1}\n{"time":1,"event":"checkpoint_on_signal","pid":1}\n'
    code, calls, _ = _run_batch_script(tmp_path, "srun", signal="USR1", wait=True, rc=75, before=old)
    assert (code, calls) == (0, ["requeue 123"])
    code, calls, _ = _run_batch_script(tmp_path / "b", "torchrun", rc=0, before=old)  # no signal now
    assert (code, calls) == (0, [])


@pytest.mark.parametrize(("mode", "rc", "events"), [("srun", 75, ""), ("torchrun", 0, "checkpoint_on_signal")])
def test_ranks_stopped_by_a_signal_of_their_own_requeue_the_job(tmp_path: Path, mode: str, rc: int,
                                                                events: str) -> None:
    """`scancel --signal=USR1 J` (no --batch) reaches only the steps: the ranks checkpoint and ask for it."""
    code, calls, kinds = _run_batch_script(tmp_path, mode, rc=rc, events=events)
    assert (code, calls) == (0, ["requeue 123"]) and kinds[-1] == "requeue"


def test_sigterm_leaves_the_decision_to_slurm(tmp_path: Path) -> None:
    """scancel / scontrol requeue: the ranks checkpoint and exit 75, the script must not requeue a job being
    cancelled (Slurm requeues it itself after `scontrol requeue`)."""
    code, calls, kinds = _run_batch_script(tmp_path, "srun", signal="TERM", wait=True, rc=75,
                                           on_signal="checkpoint_on_signal")
    assert (code, calls) == (75, []) and "requeue" not in kinds
    assert "srun got TERM" in (tmp_path / "run" / "fake.log").read_text()


def test_preempted_job_requeues_itself(tmp_path: Path) -> None:
    code, calls, _ = _run_batch_script(tmp_path, "torchrun", rc=0, events="checkpoint_on_signal",
                                       show_job="PreemptTime=2026-01-01T00:00:00")
    assert (code, calls) == (0, ["requeue 123"])
    code, calls, _ = _run_batch_script(tmp_path / "b", "srun", rc=1)  # a plain failure: no requeue
    assert (code, calls) == (1, [])


def test_a_step_that_never_started_is_requeued_up_to_the_bound(tmp_path: Path) -> None:
    """srun could not start the step (the trainer recorded nothing): requeue, start_retries (3) times per job."""
    code, calls, kinds = _run_batch_script(tmp_path, "srun", rc=1, no_start=True)
    assert (code, calls) == (0, ["requeue 123"]) and kinds[-2:] == ["start_failed", "requeue"]
    earlier = '{"time":1,"event":"start_failed","job_id":"123","pid":1}\n' * 3
    code, calls, kinds = _run_batch_script(tmp_path / "b", "srun", rc=1, no_start=True, before=earlier)
    assert (code, calls) == (1, []) and kinds[-1] == "start_failed"


# --- resubmitting a run directory (`trainctl resume RUN` on Slurm), against fake sbatch/sinfo/scontrol --

FAKE_SBATCH = r"""#!/bin/bash
n=$(( $(cat "$FAKE_DIR/next" 2>/dev/null || echo 100) + 1 )); echo "$n" >"$FAKE_DIR/next"
printf '%s\n' "$@" >"$FAKE_DIR/sbatch-$n.argv"
env >"$FAKE_DIR/sbatch-$n.env"  # what the job gets: sbatch exports its environment (--export=ALL)
echo "$n"
"""
FAKE_SINFO = "#!/bin/bash\nprintf '%s' \"$FAKE_SINFO\"\n"
FAKE_SCONTROL_JOB = r"""#!/bin/bash
[ "$1 $2" = "show job" ] && echo "JobId=$4 JobName=x JobState=$(cat "$FAKE_DIR/state" 2>/dev/null || echo CANCELLED)"
exit 0
"""


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "fake"
    d.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("sinfo", FAKE_SINFO), ("scontrol", FAKE_SCONTROL_JOB)):
        (d / name).write_text(text)
        (d / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{d}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_DIR", str(d))
    monkeypatch.setenv("FAKE_SINFO", SINFO)
    return d


def _submitted_run(tmp_path: Path, **over: str):
    from trainctl.rundir.paths import RunPaths

    launch = render.plan_slurm(slurm_spec(**over), tmp_path / "run", python="/venv/bin/python")
    paths = submit.create(launch)
    assert submit.submit(launch, paths) == "101"
    return launch, RunPaths(paths.root)


def test_resubmit_submits_the_same_script_again_and_records_it(tmp_path: Path, fake_slurm: Path) -> None:
    import json

    from trainctl.rundir.paths import read_jsonl

    launch, paths = _submitted_run(tmp_path)
    script = paths.launch_script.read_text()
    assert submit.resubmit(paths) == "102"
    assert paths.launch_script.read_text() == script and not list(paths.root.glob("launch.prev-*"))
    argv = (fake_slurm / "sbatch-102.argv").read_text().splitlines()
    assert ["sbatch", *argv] == launch.submit_argv() == ["sbatch", "--parsable", str(paths.launch_script)]
    job = json.loads(paths.job.read_text())
    assert job["job_id"] == job["slurm"]["job_id"] == "102"
    assert [j["job_id"] for j in job["slurm"]["jobs"]] == ["101", "102"]
    assert job["slurm"]["jobs"][1]["resubmit_of"] == "101"
    submits = [e for e in read_jsonl(paths.events) if e["event"] == "submit"]
    assert [(e["job_id"], e.get("resubmit"), e.get("previous_job_id")) for e in submits] == [
        ("101", None, None), ("102", True, "101")]


def test_resubmit_refuses_while_the_job_is_queued_or_running(tmp_path: Path, fake_slurm: Path) -> None:
    from trainctl.cli.app import main
    from trainctl.rundir.paths import read_jsonl, record_event

    _, paths = _submitted_run(tmp_path)
    (fake_slurm / "state").write_text("RUNNING\n")
    with pytest.raises(UsageError, match="Slurm job 101 .* is RUNNING"):
        submit.resubmit(paths)
    with pytest.raises(SystemExit) as e:  # `trainctl resume` refuses before changing anything
        main(["resume", str(paths.root), "--set", "train.steps=9"])
    assert e.value.code == 2
    assert not (fake_slurm / "sbatch-102.argv").exists() and not (paths.root / "spec.prev-1.yaml").exists()
    assert "resume_requested" not in [x["event"] for x in read_jsonl(paths.events)]
    # cancelled, still ending (Slurm says RUNNING or COMPLETING until the batch script exits): wait, not cancel
    record_event(paths, "cancel_requested", state="RUNNING", force=False)  # what `trainctl cancel` records first
    with pytest.raises(UsageError, match=r"Slurm job 101 .* is RUNNING, still stopping: `trainctl cancel` asked "
                                         r"it to stop at \d\d:\d\d:\d\d") as refused:
        submit.resubmit(paths)
    assert refused.value.hint is not None and refused.value.hint.startswith("wait for it to end")
    assert "trainctl cancel" not in refused.value.hint


def test_trainctl_resume_on_slurm_rerenders_a_changed_spec(tmp_path: Path, fake_slurm: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from trainctl.cli.app import main
    from trainctl.rundir.paths import read_jsonl

    _, paths = _submitted_run(tmp_path, **{"launcher.mode": "srun"})
    old = paths.launch_script.read_text()
    with pytest.raises(SystemExit) as e:
        main(["resume", str(paths.root), "--set", "cluster.time='00:20:00'"])
    assert e.value.code == 0
    assert "submitted job 102" in capsys.readouterr().out
    assert (paths.root / "launch.prev-1.sh").read_text() == old
    new = paths.launch_script.read_text()
    assert "#SBATCH --time=00:20:00" in new and "PYTHON=/venv/bin/python" in new
    assert "--time=00:20:00" not in old
    kinds = [x["event"] for x in read_jsonl(paths.events)]
    assert kinds == ["submit", "spec_changed", "resume_requested", "launch_script_changed", "submit"]


def test_rank_logs_follow_each_attempts_placement(tmp_path: Path) -> None:
    """Rendezvous put n2 first in attempt 0 and n1 first in attempt 1: rank 0 ran as local rank 0 of n2, then
    of n1. `trainctl logs --rank 0` must read those two files, in order, and never rank 4's (issue found on
    the local cluster: the latest placement.json was applied to every attempt)."""
    import json as _json

    from trainctl.launch.slurm.backend import torchrun_rank_logs
    from trainctl.rundir.paths import RunPaths, append_jsonl

    paths = RunPaths(tmp_path)
    orders = {"0": ["n2", "n1"], "1": ["n1", "n2"]}  # attempt -> node of ranks 0-3, then 4-7
    expected = []
    for restart, (first, second) in orders.items():
        ranks = [[first, r] for r in range(4)] + [[second, r] for r in range(4)]
        append_jsonl(paths.events, {"time": float(restart), "event": "placement", "ranks": ranks, "job_id": "7",
                                    "slurm_restart": restart, "torchrun_restart": "0"})
        for node in ("n1", "n2"):
            for local in range(4):
                d = paths.torchrun_attempt_logs("7", restart) / node / "uuid" / "attempt_0" / str(local)
                d.mkdir(parents=True)
                (d / "stdout.log").write_text(f"{node} local {local} attempt {restart}\n")
                (d / "stderr.log").write_text("")
        expected += [paths.torchrun_attempt_logs("7", restart) / first / "uuid" / "attempt_0" / "0" / f
                     for f in ("stderr.log", "stdout.log")]
    paths.placement.write_text(_json.dumps({"ranks": [{"rank": 0, "node": "n1", "local_rank": 0}]}))
    assert torchrun_rank_logs(paths, 0) == expected


# --- credentials: to the job through sbatch's environment, never into the run directory -----------------

SECRETS = {"HF_TOKEN": "hf-value-6f1c", "WANDB_API_KEY": "wandb-value-93ab"}


def test_credentials_reach_the_job_but_no_file_of_the_run(tmp_path: Path, fake_slurm: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_TOKEN written in launcher.env and WANDB_API_KEY passed through by name: sbatch's environment (which
    Slurm exports to the job and keeps for requeues) holds both values, the run directory neither; the batch
    script stops with a clear message where one is missing, and hands both to srun where they are set."""
    monkeypatch.delenv("HF_TOKEN", raising=False)  # launch puts it into this process's environment: undone
    monkeypatch.setenv("WANDB_API_KEY", SECRETS["WANDB_API_KEY"])
    launch, paths = _submitted_run(tmp_path, **{
        "launcher.env": f"{{HF_TOKEN: {SECRETS['HF_TOKEN']}, MY_SETTING: visible}}",
        "launcher.env_passthrough": "[WANDB_API_KEY]", "launcher.mode": "srun"})
    job_env = dict(ln.split("=", 1) for ln in (fake_slurm / "sbatch-101.env").read_text().splitlines() if "=" in ln)
    assert {k: job_env.get(k) for k in SECRETS} == SECRETS
    assert files_containing(paths.root, *SECRETS.values()) == []
    script = paths.launch_script.read_text()
    assert "export MY_SETTING=visible" in script and ': "${HF_TOKEN:?' in script and ': "${WANDB_API_KEY:?' in script
    assert load_spec(paths.spec).launcher.env_passthrough == ["WANDB_API_KEY", "HF_TOKEN"]
    # the batch script under bash, with a stand-in srun that reports what it received
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(FAKE_SCONTROL)
    (bindir / "srun").write_text('#!/bin/bash\nprintenv HF_TOKEN WANDB_API_KEY >"$FAKE_OUT"\n')
    for f in bindir.iterdir():
        f.chmod(0o755)
    out = tmp_path / "srun-saw"
    base = {"PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "101", "SLURM_JOB_NODELIST": "n[1-2]",
            "SLURM_NNODES": "2", "FAKE_OUT": str(out), "FAKE_CALLS": str(tmp_path / "calls")}
    missing = subprocess.run(["bash", str(paths.launch_script)], env={**base, "HF_TOKEN": SECRETS["HF_TOKEN"]},
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode != 0 and "WANDB_API_KEY: is not set: launcher.env_passthrough" in missing.stdout
    assert not out.exists()
    ok = subprocess.run(["bash", str(paths.launch_script)], env={**base, **SECRETS}, capture_output=True, text=True,
                        timeout=30)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert out.read_text().split() == [SECRETS["HF_TOKEN"], SECRETS["WANDB_API_KEY"]]


def test_resubmit_takes_passthrough_credentials_from_the_environment(tmp_path: Path, fake_slurm: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from trainctl.cli.app import main

    for name in SECRETS:  # launch and resume put them into this process's environment: undone afterwards
        monkeypatch.delenv(name, raising=False)
    _, paths = _submitted_run(tmp_path, **{"launcher.env": f"{{HF_TOKEN: {SECRETS['HF_TOKEN']}}}"})
    monkeypatch.delenv("HF_TOKEN")  # a new shell: the value was never written, so it must be exported again
    with pytest.raises(UsageError, match="HF_TOKEN is not set in this environment"):
        submit.resubmit(paths)
    monkeypatch.setenv("HF_TOKEN", "hf-value-rotated")
    with pytest.raises(SystemExit) as e:  # also a new credential --set at resume: redacted where recorded
        main(["resume", str(paths.root), "--set", "launcher.env.WANDB_API_KEY=wandb-value-new"])
    assert e.value.code == 0
    job_env = (fake_slurm / "sbatch-102.env").read_text().splitlines()
    assert "HF_TOKEN=hf-value-rotated" in job_env and "WANDB_API_KEY=wandb-value-new" in job_env
    assert files_containing(paths.root, "hf-value", "wandb-value") == []
    assert "launcher.env.WANDB_API_KEY=<redacted>" in (paths.root / "events.jsonl").read_text()


@pytest.mark.parametrize("args", [["--export=NONE"], ["--export=PATH,HOME"]])
def test_an_export_that_keeps_passthrough_variables_from_the_job_is_refused(tmp_path: Path, args: list[str],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.setenv("WANDB_API_KEY", "x")
    s = slurm_spec(**{"launcher.env_passthrough": "[WANDB_API_KEY]", "launcher.sbatch_args": json.dumps(args)})
    with pytest.raises(UsageError, match="launcher.sbatch_args --export=.*keeps WANDB_API_KEY"):
        render.plan_slurm(s, tmp_path / "run")
    ok = slurm_spec(**{"launcher.env_passthrough": "[WANDB_API_KEY]",
                 "launcher.sbatch_args": '["--export=ALL,EXTRA=1"]'})
    assert ': "${WANDB_API_KEY:?' in render.plan_slurm(ok, tmp_path / "run2").script


def test_a_symbolic_link_in_the_run_directory_stops_the_attempt_before_any_write(tmp_path: Path) -> None:
    """A link put into the run directory while the job waited (a requeue no `trainctl resume` saw): the batch script
    stops with one line naming it, exit 1, and writes nothing through it (not even its own events)."""
    run = tmp_path / "run"
    launch = render.plan_slurm(slurm_spec(), run, python="/bin/false")
    run.mkdir()
    target = tmp_path / "elsewhere.jsonl"
    target.write_text("theirs\n")
    (run / "events.jsonl").symlink_to(target)
    script = tmp_path / "launch.sh"
    script.write_text(launch.script)
    bindir = fake_slurm_bin(tmp_path)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_NNODES": "2", "FAKE_CALLS": str(tmp_path / "calls")}
    r = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1, r.stdout + r.stderr
    assert (f"trainctl: {run}/events.jsonl is a symbolic link; trainctl writes only regular files it made there (it "
            f"points to {target}); replace the link with a regular file (or remove it), then trainctl resume {run}"
            ) in r.stdout.splitlines(), r.stdout + r.stderr
    assert target.read_text() == "theirs\n" and not (tmp_path / "calls").exists()  # no srun either

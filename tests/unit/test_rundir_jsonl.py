"""The run directory's JSONL files (trainctl/rundir/paths.py): every appender starts on a fresh line, every reader skips
and counts a line that is not a JSON object; and job.json rebuilt from a Slurm run's files (launch/repair.py).
The multi-process cases (a real resume and mfu-report, `resume --repair`) are tests/dist/test_rundir_damage.py."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from spec_utils import write_spec

from trainctl.launch.repair import plan_repair
from trainctl.rundir import runstate
from trainctl.rundir.paths import RunPaths, append_jsonl, last_jsonl, load_jsonl


def test_appends_start_on_a_fresh_line_and_reads_skip_and_count(tmp_path: Path) -> None:
    f = tmp_path / "metrics.jsonl"
    append_jsonl(f, {"step": 1})  # a new file: no leading newline
    f.write_bytes(f.read_bytes() + b'{"step": 2, "lo')  # torn by a writer killed mid-line
    append_jsonl(f, {"step": 3})
    f.write_bytes(f.read_bytes() + b"\xff\xfe not UTF-8\n[1, 2]\n\n")  # bytes, then JSON that is no object
    append_jsonl(f, {"step": 4})
    assert f.read_bytes().startswith(b'{"step":1}\n{"step": 2, "lo\n{"step":3}\n')
    read = load_jsonl(f)
    assert [r["step"] for r in read.records] == [1, 3, 4]
    assert read.bad_lines == [2, 4, 5]  # the blank line is no record and no damage
    assert read.skipped_note(f) == ("metrics.jsonl: skipped 3 unreadable lines (2, 4, 5): torn, not JSON or not "
                                    "UTF-8")
    assert last_jsonl(f) == {"step": 4}
    f.write_bytes(f.read_bytes() + b'{"step": 5')
    assert last_jsonl(f) == {"step": 4}  # the tail's last readable record
    assert load_jsonl(tmp_path / "absent.jsonl").records == [] and last_jsonl(tmp_path / "absent.jsonl") is None


def test_concurrent_appenders_after_a_torn_line_lose_no_record(tmp_path: Path) -> None:
    f = tmp_path / "events.jsonl"
    f.write_bytes(b'{"event": "tor')
    code = ("import sys; from pathlib import Path; from trainctl.rundir.paths import append_jsonl\n"
            "for i in range(200): append_jsonl(Path(sys.argv[1]), {'writer': sys.argv[2], 'i': i})")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(f), str(w)]) for w in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    read = load_jsonl(f)
    assert read.bad_lines == [1]
    assert sorted((r["writer"], r["i"]) for r in read.records) == [(str(w), i) for w in range(3) for i in range(200)]


def test_job_json_of_a_slurm_run_rebuilt_from_its_files(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    write_spec(paths.spec, {"launcher": {"backend": "slurm"}, "cluster": {"nodes": 2}, "parallel": {"dp": 2}})
    argv = ["sbatch", "--parsable", "--job-name=tiny", str(paths.launch_script)]
    paths.commands.write_text(f"# submission (run from anywhere)\n{shlex.join(argv)}\n\n# the training step\nsrun x\n")
    for e in ({"time": 10.0, "event": "submit", "backend": "slurm", "job_id": "41", "mode": "torchrun"},
              {"time": 20.0, "event": "slurm_start", "job_id": "41", "attempt": 0},
              {"time": 30.0, "event": "submit", "backend": "slurm", "job_id": "57", "mode": "torchrun",
               "resubmit": True, "previous_job_id": "41"}):
        append_jsonl(paths.events, e)
    repair = plan_repair(paths)  # job.json missing: rebuilt; plan.json missing: planned from the spec again
    assert [f.path.name for f in repair.fixes] == ["plan.json"]
    rebuilt = repair.job
    assert rebuilt is not None and repair.job_why == "missing"
    job = rebuilt.job
    assert job["backend"] == "slurm" and job["job_id"] == "57" and job["command"] == argv
    assert job["slurm"]["submit_command"] == argv and job["slurm"]["mode"] == "torchrun"
    assert [j["job_id"] for j in job["slurm"]["jobs"]] == ["41", "57"]
    assert rebuilt.sources == ["spec.yaml", "events.jsonl", "commands.txt"]
    json.dumps(job)  # what write_rebuilt writes


def test_shell_writers_start_on_a_fresh_line(tmp_path: Path) -> None:
    """The Slurm batch script's `event` function and launcher.setup's failure line (bash, not Python) append to
    events.jsonl after a torn line without gluing onto it."""
    from paths import REPO

    from trainctl.launch import environment
    from trainctl.launch.slurm import render
    from trainctl.spec import load_spec

    run = tmp_path / "run"
    spec = load_spec(REPO / "trainctl" / "spec" / "tiny-cpu.yaml",
                     ["cluster.nodes=2", "cluster.gpus_per_node=4", "launcher.backend=slurm"])
    script = render.plan_slurm(spec, run).script.splitlines()
    begin = next(i for i, ln in enumerate(script) if ln.startswith("event() {"))
    event_fn = "\n".join(script[begin:script.index("}", begin) + 1])
    run.mkdir()
    events = RunPaths(run).events
    events.write_bytes(b'{"event": "tor')
    r = subprocess.run(["bash", "-c", f"{event_fn}\nevent slurm_start"], capture_output=True, text=True,
                       env={"RUN_DIR": str(run), "SLURM_JOB_ID": "7", "attempt": "0", "PATH": "/bin:/usr/bin"})
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["bash", "-c", environment.exec_after_setup(["false"], events), "setup", "true"],
                       capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    read = load_jsonl(events)
    assert read.bad_lines == [1]
    assert [(e["event"], e.get("job_id")) for e in read.records] == [("slurm_start", "7"),
                                                                      (runstate.SETUP_FAILED, None)]

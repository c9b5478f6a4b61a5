"""A damaged run directory, through the real `trainctl` command and real torchrun runs: a torn or non-UTF-8
metrics.jsonl/events.jsonl (every reader skips and counts a bad line, every writer starts on a fresh line), a
truncated job.json (said with what is intact; `resume --repair` rebuilds it; `runs` lists the run as DAMAGED),
and a read-only or permission-denied target for every command that writes (one line, exit 2, nothing made).

One launch (2 ranks, stopped with a checkpoint after step 3 of 6) is copied for each case."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cli_utils import trainctl
from resume_utils import stop_after
from spec_utils import write_spec

from trainctl.data.prep import sample_text_path
from trainctl.errors import EXIT_STOPPED, EXIT_USAGE
from trainctl.rundir.paths import load_jsonl

pytestmark = pytest.mark.slow

STOPPED_AT = 3
STEPS = 6
STRACE = ("strace", "-f", "--seccomp-bpf", "-qq", "-e", "trace=fsync,fdatasync", "-e", "signal=none", "-y", "-o")
FSYNCS = "fsyncs.strace"  # beside the run directory


def ok(r: subprocess.CompletedProcess[str]) -> None:
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(spec file, run directory stopped after step 3 with checkpoints at steps 2 and 3)."""
    base = tmp_path_factory.mktemp("launched")
    spec_file = write_spec(base / "spec.yaml", {"parallel": {"dp": 2}, "cluster": {"gpus_per_node": 2},
                                                "train": {"steps": STEPS},
                                                "checkpoint": {"every_steps": 2, "keep_last": 5},
                                                # a value of two lines: its export spans two lines of launch.sh
                                                "launcher": {"env": {"RUN_NOTE": "first line\nsecond 'line'"}}})
    run = base / "run"
    # under strace where it runs: which files the launcher and the ranks fsync (test_records_are_fsynced)
    traced = (*STRACE, str(base / FSYNCS)) if shutil.which("strace") else ()
    r = trainctl("launch", str(spec_file), "--run-dir", str(run), env=stop_after(STOPPED_AT), prefix=traced)
    assert r.returncode == EXIT_STOPPED, r.stdout[-2000:] + r.stderr[-3000:]
    return spec_file, run


def copy_run(launched: tuple[Path, Path], where: Path) -> Path:
    run = where / "run"
    shutil.copytree(launched[1], run)
    return run


def steps(run: Path) -> list[int]:
    return [m["step"] for m in load_jsonl(run / "metrics.jsonl").records]


def test_torn_and_non_utf8_jsonl_resume_and_report(launched: tuple[Path, Path], tmp_path: Path) -> None:
    run = copy_run(launched, tmp_path)
    metrics, events = run / "metrics.jsonl", run / "events.jsonl"
    lines = metrics.read_bytes().split(b"\n")[:-1]
    assert len(lines) == STOPPED_AT
    # a line of bytes that are not UTF-8 after step 1, and step 3's record torn mid-line (no newline at the end)
    metrics.write_bytes(lines[0] + b"\n\xff\xfe\x80 not utf-8\n" + lines[1] + b"\n" + lines[2][:len(lines[2]) // 2])
    events.write_bytes(events.read_bytes() + b'{"time": 1.0, "event": "torn')  # the launcher appends next

    r = trainctl("resume", str(run))
    ok(r)
    assert "metrics.jsonl: skipped 2 unreadable lines (2, 4)" in r.stdout
    assert "events.jsonl: skipped 1 unreadable line" in r.stdout
    # every whole record kept, and the ranks' step 4 written on a fresh line, not glued onto the torn step 3
    assert steps(run) == [1, 2, 4, 5, 6]
    read = load_jsonl(metrics)
    assert read.bad_lines == [2, 4]
    ev = load_jsonl(events)
    assert len(ev.bad_lines) == 1  # the torn event alone: the launcher's next event is on a line of its own
    kinds = [e["event"] for e in ev.records]
    assert kinds.count("resume_requested") == 1 and kinds.count("resume_from") == 1 and kinds[-1] == "launcher_exit"

    r = trainctl("mfu-report", str(run), "--json")
    ok(r)
    (report,) = json.loads(r.stdout)["runs"]
    assert report["summary"]["steps_completed"] == STEPS
    assert [s["step"] for s in report["series"]] == [1, 2, 4, 5, 6]
    assert any("metrics.jsonl: skipped 2 unreadable lines" in w for w in report["warnings"])
    assert any("events.jsonl: skipped 1 unreadable line" in w for w in report["warnings"])
    r = trainctl("mfu-report", str(run))
    ok(r)
    assert "metrics.jsonl: skipped 2 unreadable lines" in " ".join(r.stdout.split())


def test_truncated_job_json_status_runs_and_repair(launched: tuple[Path, Path], tmp_path: Path) -> None:
    run = copy_run(launched, tmp_path)
    job = run / "job.json"
    whole = json.loads(job.read_text())
    job.write_text(job.read_text()[:120])  # truncated mid-record
    for command in (("status", str(run)), ("resume", str(run))):
        r = trainctl(*command)
        assert r.returncode == EXIT_USAGE, r.stderr
        (line,) = r.stderr.strip().splitlines()
        assert f"{job} is damaged" in line and f"checkpoints up to step {STOPPED_AT}" in line, line
        assert f"trainctl resume {run} --repair" in line and f"continues from step {STOPPED_AT}" in line, line
        assert "Traceback" not in r.stderr

    lost = tmp_path / "lost"  # job.json deleted: the spec and events still make it a run directory
    shutil.copytree(launched[1], lost)
    (lost / "job.json").unlink()
    r = trainctl("status", str(lost))
    assert r.returncode == EXIT_USAGE and f"{lost / 'job.json'} is damaged (missing)" in r.stderr, r.stderr
    r = trainctl("resume", str(lost), "--repair", "--dry-run")
    ok(r)
    assert "would rebuild job.json (local backend, 1 attempt(s))" in r.stdout and not (lost / "job.json").exists()

    r = trainctl("runs", str(tmp_path), "--json")
    ok(r)
    listed = {Path(s["run_dir"]).name: s for s in json.loads(r.stdout)}
    assert set(listed) == {"run", "lost"}
    for s in listed.values():
        assert s["state"] == "DAMAGED" and s["backend"] == "local" and s["steps_done"] == STOPPED_AT, s
        assert "--repair" in s["reason"], s

    r = trainctl("resume", str(run), "--repair", "--dry-run")
    ok(r)
    assert "would rebuild job.json (local backend, 1 attempt(s))" in r.stdout
    assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in launched[1].iterdir())  # unchanged

    r = trainctl("resume", str(run), "--repair")
    ok(r)
    assert "rebuilt job.json" in r.stdout and f"from step {STOPPED_AT}" in r.stdout
    assert steps(run) == list(range(1, STEPS + 1))
    rebuilt = json.loads(job.read_text())
    assert rebuilt["backend"] == "local" and rebuilt["command"] == whole["command"] and rebuilt["env"] == whole["env"]
    assert rebuilt["env"]["RUN_NOTE"] == "first line\nsecond 'line'"  # read from launch.sh whole, not line by line
    assert [(a["attempt"], a["kind"], a["status"]) for a in rebuilt["attempts"]] == [
        (1, "launch", "stopped"), (2, "resume", "completed")]
    assert (run / rebuilt["repaired"]["damaged_copy"]).read_text() == (launched[1] / "job.json").read_text()[:120]
    r = trainctl("status", str(run), "--json")
    ok(r)
    assert json.loads(r.stdout)["state"] == "COMPLETED"


# --- targets that cannot be written ----------------------------------------------------------------------

NO_DAC = ("setpriv", "--bounding-set=-dac_override,-dac_read_search")  # root, held to permission bits


@pytest.fixture(params=["read-only", "permission-denied"])
def unwritable(request: pytest.FixtureRequest, tmpfs: Callable[..., Path], launched: tuple[Path, Path],
               tmp_path: Path) -> Iterator[tuple[Path, tuple[str, ...], str]]:
    """(a directory holding a copy of the run that cannot be written, the command prefix, the problem's words):
    a read-only mount, or a directory of mode 0555 for root without CAP_DAC_OVERRIDE (tests run as root, who
    passes every permission check otherwise)."""
    if request.param == "read-only":
        target = tmpfs("64m")
        copy_run(launched, target)
        subprocess.run(["mount", "-o", "remount,ro", str(target)], check=True)
        yield target, (), "Read-only file system"
        return
    if shutil.which("setpriv") is None or subprocess.run([*NO_DAC, "true"]).returncode != 0:
        pytest.skip("setpriv cannot drop CAP_DAC_OVERRIDE here")
    target = tmp_path / "denied"
    target.mkdir()
    copy_run(launched, target)
    for d in (target, target / "run"):
        d.chmod(0o555)
    yield target, NO_DAC, "Permission denied"
    for d in (target, target / "run"):
        d.chmod(0o755)


def test_unwritable_targets_refused_in_one_line(unwritable: tuple[Path, tuple[str, ...], str],
                                                launched: tuple[Path, Path]) -> None:
    target, prefix, problem = unwritable
    spec, run = str(launched[0]), target / "run"
    before = sorted(p.relative_to(target) for p in target.rglob("*"))
    commands = {
        "launch --run-dir": ("launch", spec, "--run-dir", str(target / "new-run")),
        "resume": ("resume", str(run)),
        "export": ("export", str(run), "--format", "hf", str(target / "hf")),
        "data prepare": ("data", "prepare", str(sample_text_path()), str(target / "tokens.bin")),
        "calibrate --out": ("calibrate", spec, "--out", str(target / "calibration.json")),
    }
    for what, args in commands.items():
        r = trainctl(*args, prefix=prefix)
        assert r.returncode == EXIT_USAGE, f"{what}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, f"{what}: {r.stderr}"
        assert lines[0].startswith("error: ") and problem in lines[0] and str(target) in lines[0], f"{what}: {lines}"
    assert sorted(p.relative_to(target) for p in target.rglob("*")) == before  # nothing half-made


def test_hand_edited_spec_is_said_kept_and_recorded_on_resume(launched: tuple[Path, Path], tmp_path: Path) -> None:
    run = copy_run(launched, tmp_path)
    frozen = (run / "spec.yaml").read_text()
    assert "  lr: 0.001\n" in frozen
    (run / "spec.yaml").write_text(frozen.replace("  lr: 0.001\n", "  lr: 0.5\n"))  # by hand, no --set
    said = "spec change (spec.yaml edited by hand): train.lr: 0.001 -> 0.5 (the LR schedule is rescaled from here on)"

    r = trainctl("resume", str(run), "--dry-run")
    ok(r)
    assert said in r.stdout, r.stdout  # was: nothing said, the new rate used
    assert not (run / "spec.prev-1.yaml").exists()

    r = trainctl("resume", str(run))
    ok(r)
    assert said in r.stdout, r.stdout
    assert (run / "spec.prev-1.yaml").read_text() == frozen  # what the run trained with until now
    (changed,) = [e for e in load_jsonl(run / "events.jsonl").records if e["event"] == "spec_changed"]
    assert changed["hand_edits"] == [said.split(": ", 1)[1]] and changed["overrides"] == []
    assert changed["previous"] == "spec.prev-1.yaml" and changed["previous_plan"] == "plan.prev-1.json"
    job = json.loads((run / "job.json").read_text())
    assert job["frozen_spec"]["yaml"] == (run / "spec.yaml").read_text() and "  lr: 0.5\n" in job["frozen_spec"]["yaml"]
    assert (run / "plan.prev-1.json").read_text() == (launched[1] / "plan.json").read_text()
    r = trainctl("resume", str(run), "--dry-run", "--set", f"train.steps={STEPS + 2}")  # said once, not again
    ok(r)
    assert "edited by hand" not in r.stdout and f"spec change: train.steps: {STEPS} -> {STEPS + 2}" in r.stdout


# --- records that survive a crash, and those rebuilt when they did not ------------------------------------------

def test_records_are_fsynced(launched: tuple[Path, Path]) -> None:
    """Every record of the run directory reaches the disk: the whole files written by a temporary file's fsync, a
    rename and the directory's fsync; the appended logs by an fsync after their writes (was: spec.yaml, plan.json,
    launch.sh, events.jsonl and metrics.jsonl never fsynced, found empty after a file-system error)."""
    log = launched[1].parent / FSYNCS
    if not log.exists():
        pytest.skip("strace is not installed here")
    run = str(launched[1])
    synced = set(re.findall(r"fsync\(\d+<([^>]*)>\)\s+= 0", log.read_text()))
    names = {Path(p).name for p in synced if str(Path(p).parent) == run}
    for record in ("spec.yaml", "plan.json", "launch.sh", "job.json"):  # written as .<name>.<random>, renamed
        assert any(n.startswith(f".{record}.") for n in names), (record, sorted(names))
    assert run in synced  # the directory: the renamed names are durable
    assert {"events.jsonl", "metrics.jsonl"} <= names, sorted(names)


def damage(run: Path, *names: str) -> None:
    """Leave `names` as a file-system error leaves records that never reached the disk: empty."""
    for name in names:
        (run / name).write_bytes(b"")


def test_empty_records_are_rebuilt_from_what_survives(launched: tuple[Path, Path], tmpfs: Callable[..., Path],
                                                      tmp_path: Path) -> None:
    disk = tmpfs("64m")
    run = copy_run(launched, disk)
    damage(run, "spec.yaml", "plan.json", "launch.sh", "events.jsonl", "metrics.jsonl")  # job.json, checkpoints kept
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)  # as the file-system error left it

    r = trainctl("resume", str(run))
    assert r.returncode == EXIT_USAGE, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line == (f"error: {run / 'spec.yaml'} is damaged (empty); intact: checkpoints up to step {STOPPED_AT}; "
                    f"`trainctl resume {run} --repair` rebuilds it from job.json's record of it and continues from "
                    f"step {STOPPED_AT}"), line  # was: "the spec is empty"
    r = trainctl("resume", str(run), "--repair", "--dry-run")
    ok(r)
    said = " ".join(r.stdout.split())
    assert ("would rebuild spec.yaml (empty) from job.json's record of it; plan.json (empty) from spec.yaml; "
            "launch.sh (empty) from the command a resume runs; nothing to rebuild events.jsonl (empty), "
            "metrics.jsonl (empty) from: its history is lost; nothing changed") in said, said  # was: nothing to repair
    r = trainctl("resume", str(run), "--repair")
    assert r.returncode == EXIT_USAGE and "Read-only file system" in r.stderr, r.stderr

    subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
    r = trainctl("resume", str(run), "--repair")
    ok(r)
    assert f"resuming {run} from step {STOPPED_AT}" in " ".join(r.stdout.split()), r.stdout
    assert steps(run) == list(range(STOPPED_AT + 1, STEPS + 1))
    assert (run / "spec.yaml").read_text() == (launched[1] / "spec.yaml").read_text()
    assert (run / "plan.json").read_text() == (launched[1] / "plan.json").read_text()
    assert whole_command(run) == [w.replace(str(launched[1]), str(run)) for w in whole_command(launched[1])]

    # job.json lost as well: the spec comes back from the newest checkpoint's own copy of it
    both = copy_run(launched, tmp_path)
    damage(both, "spec.yaml", "job.json")
    r = trainctl("resume", str(both), "--repair", "--dry-run")
    ok(r)
    said = " ".join(r.stdout.split())
    assert f"would rebuild spec.yaml (empty) from checkpoint step {STOPPED_AT}'s copy; job.json (" in said, said
    (newest,) = [c for c in (both / "checkpoints").iterdir() if c.name.endswith(f"{STOPPED_AT:08d}")]
    assert json.loads((newest / "manifest.json").read_text())["meta"]["spec"] == \
        (launched[1] / "spec.yaml").read_text()


def whole_command(run: Path) -> list[str]:
    """The command of a local run's launch.sh (its `exec` statement's words)."""
    words = shlex.split((run / "launch.sh").read_text(), comments=True)
    return words[words.index("exec") + 1:]

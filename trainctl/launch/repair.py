"""A run directory whose records are damaged (empty after a file-system error, truncated, not JSON/YAML, missing):
what is still intact, and each record rebuilt from what survives (`trainctl resume RUN --repair`). No torch.

A valid checkpoint is always resumable: spec.yaml comes back from job.json's record of it (`frozen_spec`) or,
job.json damaged too, from the newest valid checkpoint's own copy (its manifest's meta); plan.json from the spec;
a local run's launch.sh from the command a resume runs. job.json is a record of the launches (backend, command,
attempts, Slurm job ids); none of it is needed to continue training: the frozen spec.yaml, launch.sh (the
command), events.jsonl (every launch, attempt and submission) and the checkpoints hold the rest. What they do not
hold (the git commit of the first launch) is recorded as unknown, and the damaged file is kept beside it for
inspection. An empty events.jsonl or metrics.jsonl has nothing to rebuild it from: the history it held is said
lost, and the resume appends to it.
"""

from __future__ import annotations

import json
import shlex
import stat
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainctl.errors import UsageError
from trainctl.fileio import write_atomic
from trainctl.rundir.paths import RunPaths, last_jsonl, read_jsonl, record_event

if TYPE_CHECKING:
    from trainctl.spec import RunSpec

DAMAGED = "DAMAGED"  # the state `trainctl status --json` / `runs` show for a run whose job.json is damaged
DAMAGED_COPY = "{name}.damaged-{stamp}"  # where --repair keeps the damaged job.json
LOCAL_ATTEMPT_EVENTS = ("launch", "resume")  # launch/local.py: one per local attempt, with its number


class DamagedJob(UsageError):
    """job.json cannot be parsed: one line naming it, what is intact and how to go on (exit 2)."""

    def __init__(self, paths: RunPaths, why: str) -> None:
        self.why = why
        run = shlex.quote(str(paths.root))
        newest = newest_checkpoint(paths)
        go_on = (f"continues from step {newest}" if newest is not None else "restarts from step 0")
        fix = (f"`trainctl resume {run} --repair` rebuilds it from {paths.spec.name}, {paths.launch_script.name} "
               f"and {paths.events.name} and {go_on}" if spec_source(paths, None) is not None else
               "nothing to rebuild it from: launch the spec again into a new run directory")
        super().__init__(f"{paths.job} is damaged ({why}); intact: {', '.join(intact(paths, newest))}; {fix}")


class DamagedSpec(UsageError):
    """spec.yaml is damaged (empty, truncated, missing): one line naming it, what is intact and how to go on."""

    def __init__(self, paths: RunPaths, why: str, job: dict[str, Any] | None) -> None:
        run = shlex.quote(str(paths.root))
        newest = newest_checkpoint(paths)
        found = spec_source(paths, job)
        go_on = f"continues from step {newest}" if newest is not None else "restarts from step 0"
        fix = (f"`trainctl resume {run} --repair` rebuilds it from {found[1]} and {go_on}" if found else
               "nothing to rebuild it from: launch the spec again into a new run directory")
        super().__init__(f"{paths.spec} is damaged ({why}); intact: {', '.join(intact(paths, newest)[1:])}; {fix}")


def job_problem(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the job record, None), or (None, what is wrong with it) for a job.json's text."""
    try:
        job = json.loads(text)
    except ValueError as e:
        return None, f"not valid JSON, truncated? {e}"
    if not isinstance(job, dict):
        return None, f"a JSON {type(job).__name__}, not an object"
    return job, None


def newest_checkpoint(paths: RunPaths) -> int | None:
    """The step of the newest committed checkpoint (the trainer verifies its checksums before it loads it)."""
    from trainctl.checkpoint import latest_valid, resolve_checkpoint_dir

    try:
        info = latest_valid(resolve_checkpoint_dir(paths.root))
    except OSError:
        return None
    return info.step if info is not None else None


def intact(paths: RunPaths, newest: int | None) -> list[str]:
    """What the run directory still holds that a resume needs or a person looks for, in words (`newest`: the
    newest committed checkpoint's step)."""
    out = [paths.spec.name if paths.spec.is_file() else f"no {paths.spec.name} (cannot be rebuilt)"]
    out.append(f"checkpoints up to step {newest}" if newest is not None else "no valid checkpoint")
    last = last_jsonl(paths.metrics) or {}
    if isinstance(last.get("step"), int):
        out.append(f"{paths.metrics.name} to step {last['step']}")
    return out


def recorded_backend(events: list[dict[str, Any]]) -> str | None:
    """The backend the run's last launch, resume or submission recorded in events.jsonl."""
    said = [e["backend"] for e in events if isinstance(e.get("backend"), str)]
    return said[-1] if said else None


def _iso(t: Any) -> str | None:
    return datetime.fromtimestamp(float(t), timezone.utc).isoformat(timespec="seconds") \
        if isinstance(t, (int, float)) else None


def _script_command(path: Path) -> tuple[list[str], dict[str, str]]:
    """(command, variables) of a launch.sh rendered by trainctl.launch.create.render_script; empty if absent or
    unparseable. The script is split as the shell reads it, whole: a quoted value may span lines (a
    launcher.env value holding a newline), so no line is split on its own."""
    command: list[str] = []
    env: dict[str, str] = {}
    try:
        words = shlex.split(path.read_text(encoding="utf-8"), comments=True)
    except (OSError, UnicodeDecodeError, ValueError):
        return command, env
    for i, word in enumerate(words):
        if word == "export" and i + 1 < len(words) and "=" in words[i + 1]:
            key, _, value = words[i + 1].partition("=")
            env[key] = value
        elif word == "exec":  # the script's last statement: the rest is the command
            command = words[i + 1:]
            break
    return command, env


def _slurm_submit_command(paths: RunPaths) -> list[str]:
    """The sbatch command line of commands.txt (its first line that is not a comment)."""
    try:
        lines = paths.commands.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    first = next((ln for ln in lines if ln.strip() and not ln.startswith("#")), "")
    return shlex.split(first)


def _local_attempts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """job.json's attempts as launch/local.py records them, from each attempt's start and launcher_exit events."""
    attempts: list[dict[str, Any]] = []
    for e in events:
        if e.get("event") in LOCAL_ATTEMPT_EVENTS and isinstance(e.get("attempt"), int):
            attempts.append({"attempt": e["attempt"], "started": _iso(e.get("time")), "kind": e["event"],
                             "_time": e.get("time")})
        elif e.get("event") == "launcher_exit" and attempts and "exit_code" not in attempts[-1]:
            began = attempts[-1]["_time"]
            attempts[-1].update(exit_code=e.get("exit_code"), status=str(e.get("state") or "").lower() or None,
                                seconds=round(float(e["time"]) - float(began), 3)
                                if isinstance(e.get("time"), (int, float)) and isinstance(began, (int, float))
                                else None)
    for a in attempts:
        del a["_time"]
    return attempts


def _slurm_record(paths: RunPaths, events: list[dict[str, Any]]) -> dict[str, Any]:
    """job.json's Slurm part (trainctl.launch.slurm.submit) from the submit events and commands.txt."""
    submits = [e for e in events if e.get("event") == "submit" and e.get("job_id") is not None]
    jobs = [{"job_id": str(e["job_id"]), "submitted": _iso(e.get("time"))} for e in submits]
    sl: dict[str, Any] = {"mode": submits[-1].get("mode") if submits else None, "script": paths.launch_script.name,
                          "submit_command": _slurm_submit_command(paths), "jobs": jobs}
    if jobs:
        sl.update(job_id=jobs[-1]["job_id"], submitted=jobs[-1]["submitted"])
    return sl


@dataclass(frozen=True)
class Rebuilt:
    job: dict[str, Any]
    sources: list[str]  # the files it was rebuilt from


def rebuild(paths: RunPaths, spec: RunSpec, spec_text: str,
            command: tuple[list[str], dict[str, str]] | None = None) -> Rebuilt:
    """job.json as the run directory's other files tell it, for the run's frozen `spec` (spec.yaml's `spec_text`);
    `command`: a local run's command and variables when launch.sh is damaged too (what a resume runs)."""
    from trainctl.launch.create import frozen_spec_record

    events = sorted(read_jsonl(paths.events), key=lambda e: float(e.get("time") or 0.0)
                    if isinstance(e.get("time"), (int, float)) else 0.0)
    backend = recorded_backend(events) or spec.backend
    sources = [paths.spec.name] + ([paths.events.name] if events else [])
    job: dict[str, Any] = {"backend": backend, "git": {"commit": None, "dirty": None},
                           "created": _iso(events[0].get("time")) if events else None, "attempts": []}
    if backend == "slurm":
        sl = _slurm_record(paths, events)
        job.update(command=sl["submit_command"], env={}, slurm=sl)  # the sbatch argv, as slurm.submit records it
        if sl.get("job_id"):
            job["job_id"] = sl["job_id"]
        sources.append(paths.commands.name)
    else:
        argv, env = command or _script_command(paths.launch_script)
        job.update(command=argv, env=env, attempts=_local_attempts(events))
        sources.append(paths.launch_script.name if command is None else "the command a resume runs")
    job["frozen_spec"] = frozen_spec_record(spec_text)
    return Rebuilt(job, sources)


def write_rebuilt(paths: RunPaths, rebuilt: Rebuilt) -> Path | None:
    """Keep the damaged job.json beside it, write the rebuilt one, record the repair; the damaged copy (None: there
    was no job.json)."""
    from trainctl.launch.create import now_iso

    kept = None
    if paths.job.exists():
        kept = paths.root / DAMAGED_COPY.format(name=paths.job.name, stamp=time.strftime("%Y%m%d-%H%M%S"))
        paths.job.replace(kept)
    copy = kept.name if kept else None
    job = {**rebuilt.job, "repaired": {"time": now_iso(), "from": rebuilt.sources, "damaged_copy": copy}}
    write_atomic(paths.job, json.dumps(job, indent=2) + "\n", fsync=True)
    record_event(paths, "job_repaired", sources=rebuilt.sources, damaged_copy=copy)
    return kept


# --- every record: spec.yaml, plan.json, launch.sh, job.json --------------------------------------------------

def text_problem(path: Path) -> str | None:
    """What is wrong with a record file whatever its format (missing, unreadable, empty), or None. A path that is
    no regular file (a FIFO, a device) is not damage but no record either: None here and in the checks below, and
    its reader refuses it in one line (fileio.read_capped) instead of waiting on it or reading for ever."""
    try:
        if not _regular(path):
            return None
        data = path.read_bytes()
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return "empty" if not data.strip() else None


def _regular(path: Path) -> bool:
    return stat.S_ISREG(path.stat().st_mode)


def spec_problem(path: Path) -> str | None:
    """spec.yaml damaged (missing, empty, not YAML, not a mapping: a file-system error's leftovers), or None. A
    spec that parses but breaks a rule is a spec error, not damage: its loader names the field and the fix."""
    import yaml

    if (problem := text_problem(path)) is not None or not _regular(path):
        return problem
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError):
        return "not valid YAML, truncated?"
    return None if isinstance(data, dict) else "not a YAML mapping, truncated?"


def plan_problem(path: Path) -> str | None:
    if (problem := text_problem(path)) is not None or not _regular(path):
        return problem
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return "not valid JSON, truncated?"
    return None


def script_problem(path: Path) -> str | None:
    """launch.sh damaged: missing, empty, or cut before its last statement (the `exec` of the command)."""
    if (problem := text_problem(path)) is not None or not _regular(path):
        return problem
    return None if _script_command(path)[0] else "truncated (no command)"


def spec_source(paths: RunPaths, job: dict[str, Any] | None) -> tuple[str, str] | None:
    """(text, where it comes from) of the run's frozen spec, from what survives: job.json's record of it, else the
    newest valid checkpoint's copy; None when neither holds one."""
    from trainctl.checkpoint import latest_valid, resolve_checkpoint_dir

    rec = (job or {}).get("frozen_spec")
    if isinstance(rec, dict) and isinstance(rec.get("yaml"), str) and rec["yaml"].strip():
        return rec["yaml"], f"{paths.job.name}'s record of it"
    try:
        info = latest_valid(resolve_checkpoint_dir(paths.root))
    except OSError:
        return None
    if info is not None and isinstance(info.meta.get("spec"), str):
        return info.meta["spec"], f"checkpoint step {info.step}'s copy"
    return None


@dataclass(frozen=True)
class Fix:
    """One record rebuilt: its file, what was wrong, where the new text comes from, the text."""

    path: Path
    why: str
    source: str
    text: str
    executable: bool = False

    def words(self) -> str:
        return f"{self.path.name} ({self.why}) from {self.source}"


@dataclass(frozen=True)
class RepairPlan:
    fixes: list[Fix]  # spec.yaml first: what the others are rebuilt from
    job: Rebuilt | None  # job.json rebuilt, when damaged
    job_why: str | None
    lost: list[str]  # histories with nothing to rebuild them from: 'events.jsonl (empty)'

    @property
    def nothing(self) -> bool:
        return not self.fixes and self.job is None


def plan_repair(paths: RunPaths) -> RepairPlan:
    """What `--repair` rebuilds, from what; changes nothing. UsageError when the spec has no surviving copy."""
    from trainctl.errors import SpecError
    from trainctl.launch.create import build_plan_json, render_script
    from trainctl.spec import load_spec, load_spec_text

    job, job_why = None, "missing"
    if paths.job.is_file():
        try:
            job, job_why = job_problem(paths.job.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            job_why = f"unreadable ({e})"
    fixes: list[Fix] = []
    if (why := spec_problem(paths.spec)) is not None:
        found = spec_source(paths, job)
        if found is None:
            raise UsageError(f"{paths.spec} is damaged ({why}) and neither {paths.job.name} nor a valid checkpoint "
                             "holds a copy of it: there is nothing to rebuild the run from",
                             hint="launch the spec again into a new run directory")
        text, source = found
        try:
            spec = load_spec_text(text, source=source)
        except SpecError as e:
            raise UsageError(f"{paths.spec} is damaged ({why}) and its copy in {source} is not a valid spec "
                             f"({str(e).splitlines()[0]})", hint="launch the spec again into a new run directory") \
                from None
        fixes.append(Fix(paths.spec, why, source, text))
    else:
        spec = load_spec(paths.spec)  # a rule it breaks is said as for any spec (exit 2)
        text = paths.spec.read_text(encoding="utf-8")
    if (why := plan_problem(paths.plan)) is not None:
        fixes.append(Fix(paths.plan, why, paths.spec.name, build_plan_json(spec)))
    backend = str((job or {}).get("backend") or spec.backend)
    command = None
    if backend != "slurm" and (why := script_problem(paths.launch_script)) is not None:
        from trainctl.launch.local import plan_local  # the command and variables a resume runs

        launch = plan_local(spec, paths.root, existing=True)
        command = (launch.command, launch.env)
        script = render_script(launch.command, launch.env, "trainctl resume --repair (local)",
                               spec.launcher.env_passthrough)
        fixes.append(Fix(paths.launch_script, why, "the command a resume runs", script, executable=True))
    rebuilt = rebuild(paths, spec, text, command) if job is None else None
    lost = [f"{p.name} ({why})" for p in (paths.events, paths.metrics)
            if (why := text_problem(p)) is not None and why != "missing"]
    return RepairPlan(fixes, rebuilt, job_why if rebuilt else None, lost)


def apply_repair(paths: RunPaths, plan: RepairPlan) -> Path | None:
    """Write what `plan` rebuilds (durably), record it; the damaged job.json's copy, when one was kept."""
    for fix in plan.fixes:
        write_atomic(fix.path, fix.text, executable=fix.executable, fsync=True)
    kept = write_rebuilt(paths, plan.job) if plan.job is not None else None
    if plan.fixes:
        record_event(paths, "records_repaired", records=[f.path.name for f in plan.fixes],
                     sources=[f.source for f in plan.fixes], lost=plan.lost)
    return kept

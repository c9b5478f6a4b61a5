"""Creating a run directory (layout in `trainctl.rundir.paths`): frozen spec, plan, launch script, job record.

No torch: the launch layer runs in the CLI process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainctl.checkpoint import owner, resolve_checkpoint_dir
from trainctl.data import identity as data_identity
from trainctl.errors import UsageError
from trainctl.fileio import (
    WRITABLE_FIX,
    bytes_digest,
    json_text,
    nearest_existing,
    os_error_line,
    require_writable,
    write_atomic,
    write_errors_as_usage,
)
from trainctl.launch import secrets
from trainctl.rundir.paths import RunPaths
from trainctl.spec import RunSpec, frozen_text


def default_run_dir(spec: RunSpec, now: datetime | None = None, base: Path = Path("runs"), *,
                    create: bool = False) -> Path:
    """runs/<name>-<YYYYmmdd-HHMMSS>; the name is reduced to filename-safe characters. `create`: made here, at
    once and only by this process (mkdir of a name nobody holds, else the next suffix), so launches started at
    the same second never share or refuse one; without it (a dry run), the name it would be."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", spec.name).strip("._") or "run"
    if create:
        with write_errors_as_usage(f"run directory under {base}"):
            base.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        candidate = base / (f"{name}-{stamp}" if n == 1 else f"{name}-{stamp}-{n}")
        n += 1
        if not create:
            if not _non_empty(candidate):
                return candidate
            continue
        try:
            candidate.mkdir()  # atomic: exactly one process makes a name
            return candidate
        except FileExistsError:
            continue
        except OSError as e:
            raise UsageError(f"run directory {candidate}: {os_error_line(e)}", hint=WRITABLE_FIX) from e


@contextlib.contextmanager
def reserved_run_dir(spec: RunSpec, given: Path | None, *, base: Path = Path("runs"),
                     dry_run: bool = False) -> Iterator[Path]:
    """The run directory of a launch: `given`, or a default one made for it now (default_run_dir(create=True));
    a default one is removed again when the launch stops before writing into it (a refused spec, a failed
    check), so refusals leave no empty directories behind."""
    if given is not None or dry_run:
        yield given or default_run_dir(spec, base=base)
        return
    made = default_run_dir(spec, base=base, create=True)
    try:
        yield made
    except BaseException:
        with contextlib.suppress(OSError):
            made.rmdir()  # only while still empty
        raise


def _non_empty(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def check_run_dir(path: Path, spec: RunSpec | None = None) -> None:
    """Refuse a run dir that already holds something (a run directory records exactly one run), or that cannot
    be made and written, and (`spec`: a run that trains) a checkpoint directory that is not empty: before anything
    is created."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"run directory {path} exists and is not a directory",
                         hint="pass another --run-dir")
    if _non_empty(path):
        raise UsageError(f"run directory {path} already exists and is not empty",
                         hint="pass a new --run-dir (or leave it out for a fresh runs/<name>-<time>); "
                              f"to continue that run from its last checkpoint: trainctl resume {path}")
    require_writable(path, f"run directory {path}")
    if spec is not None and (problem := owner.new_run_problem(resolve_checkpoint_dir(path, spec))) is not None:
        raise problem


def freeze_spec(spec: RunSpec) -> RunSpec:
    """The spec as the ranks will read it: relative data and model.init_from paths made absolute (ranks may start
    elsewhere), and credentials in launcher.env held back: their values go to the ranks through this process's
    environment, never into the run directory (trainctl.launch.secrets)."""
    spec = secrets.hold_back(spec)
    path = spec.data.path
    if path and not os.path.isabs(path):
        data = spec.data.model_copy(update={"path": str(Path(path).resolve())})
        spec = spec.model_copy(update={"data": data})
    if spec.data.blend and any(not os.path.isabs(s.path) for s in spec.data.blend):
        blend = [s.model_copy(update={"path": str(Path(s.path).resolve())}) for s in spec.data.blend]
        spec = spec.model_copy(update={"data": spec.data.model_copy(update={"blend": blend})})
    init_from = spec.model.init_from  # read by every rank, which may start elsewhere
    if init_from and not os.path.isabs(init_from):
        spec = spec.model_copy(update={"model": spec.model.model_copy(
            update={"init_from": str(Path(init_from).resolve())})})
    profile = spec.cluster.calibration  # the plan is rebuilt from the frozen spec elsewhere (resume)
    if profile and not os.path.isabs(profile):
        spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(
            update={"calibration": str(Path(profile).resolve())})})
    return spec


def write_frozen_spec(paths: RunPaths, spec: RunSpec) -> dict[str, str]:
    """Write RUN/spec.yaml (`spec` frozen: freeze_spec) durably, and return the record job.json keeps of it:
    its sha256 and its text. `trainctl resume` holds spec.yaml to the record: a hand edit since is shown and
    recorded as a `--set` is (resume.hand_edits), never used silently; the text is what the edit replaced."""
    text = frozen_text(spec)
    write_atomic(paths.spec, text, fsync=True)
    return frozen_spec_record(text)


def frozen_spec_record(text: str) -> dict[str, str]:
    return {"sha256": bytes_digest(text.encode("utf-8")), "yaml": text}


def git_info(where: Path | None = None) -> dict[str, Any]:
    """Commit and dirtiness of the code that runs (the installed package's tree); None without git."""
    where = where or Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        status = subprocess.run(["git", "-C", str(where), "status", "--porcelain"], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    return {"commit": head.stdout.strip(), "dirty": dirty}


def build_plan_json(spec: RunSpec) -> str:
    """The planner's prediction (with the rank placement) as JSON."""
    from trainctl.plan.plan import build_plan

    # Recorded, not enforced: a plan warning (e.g. memory) does not stop a launch the rules accepted.
    data = build_plan(spec).to_json(ranks=True)
    return data if isinstance(data, str) else json_text(data) + "\n"  # null for non-finite, as plan --json


def render_script(command: Sequence[str], env: Mapping[str, str], header: str,
                  passthrough: Sequence[str] = ()) -> str:
    """A bash script that re-runs exactly `command` with `env` (and the `passthrough` variables of the
    environment it runs in); every word shell-quoted."""
    lines = ["#!/usr/bin/env bash", f"# {header}", "set -euo pipefail"]
    lines += secrets.require_lines(passthrough, "this script runs in")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append("exec " + shlex.join(command))
    return "\n".join(lines) + "\n"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def create_run_dir(root: Path, spec: RunSpec, *, backend: str, command: Sequence[str],
                   env: Mapping[str, str], trains: bool = True) -> RunPaths:
    """Make RUN/ with spec.yaml, plan.json (when the planner exists), launch.sh, job.json (with the run's id and
    the identity of the data files: trainctl.data.identity) and logs/; for a run that `trains`, its checkpoint
    directory with this run as its owner (trainctl/checkpoint/owner.py).

    `spec` is frozen (`freeze_spec`) and `env` built from it: neither holds a credential's value."""
    check_run_dir(root, spec if trains else None)
    leaked = secrets.credential_names({**spec.launcher.env, **env})
    if leaked:  # a caller that skipped freeze_spec: refuse rather than publish the value
        raise RuntimeError(f"credential {', '.join(leaked)} would be written to {root}: freeze the spec first")
    paths = RunPaths(root.resolve())
    existed = nearest_existing(paths.root)  # a failed write takes back what is made below it
    try:
        with write_errors_as_usage(f"run directory {paths.root}"):
            paths.logs.mkdir(parents=True, exist_ok=True)
            frozen = write_frozen_spec(paths, spec)
            write_atomic(paths.plan, build_plan_json(spec), fsync=True)
            created = now_iso()
            write_atomic(paths.launch_script, render_script(command, env, f"trainctl launch ({backend}), {created}",
                                                            spec.launcher.env_passthrough), executable=True, fsync=True)
            run_id = owner.new_run_id()
            write_job(paths, {"backend": backend, "run_id": run_id, "command": list(command), "env": dict(env),
                              "git": git_info(), "created": created,
                              "data": [i.to_json() for i in data_identity.of_spec(spec)],
                              "frozen_spec": frozen, "attempts": []})
            if trains:  # last: a failure before leaves no record in a checkpoint directory outside the run
                ckdir = resolve_checkpoint_dir(paths.root, spec)
                with write_errors_as_usage(f"checkpoint directory {ckdir}"):
                    owner.write_owner(ckdir, run_id, paths.root)
    except BaseException:
        _take_back(paths.root, existed)
        raise
    return paths


def _take_back(root: Path, existed: Path) -> None:
    """Remove a run directory whose creation failed: the directories made for it (from below `existed`, the
    nearest one that was there before), or, when `root` itself existed (empty, as check_run_dir requires),
    what was written into it."""
    if existed == root:
        for p in list(root.iterdir()):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        return
    first_made = root
    while first_made.parent != existed:
        first_made = first_made.parent
    shutil.rmtree(first_made, ignore_errors=True)


def read_job(paths: RunPaths) -> dict[str, Any]:
    return json.loads(paths.job.read_text(encoding="utf-8"))


def write_job(paths: RunPaths, job: dict[str, Any]) -> None:
    write_atomic(paths.job, json.dumps(job, indent=2) + "\n", fsync=True)


def record_attempt(paths: RunPaths, **fields: Any) -> None:
    """Append (or, with the same `attempt` number, update) one attempt in job.json."""
    job = read_job(paths)
    attempts = job.setdefault("attempts", [])
    number = fields.get("attempt", len(attempts) + 1)
    for a in attempts:
        if a.get("attempt") == number:
            a.update(fields)
            break
    else:
        attempts.append({"attempt": number, **fields})
    write_job(paths, job)

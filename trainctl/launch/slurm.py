"""Slurm launch: check the request against the cluster (sinfo), render the sbatch script, submit, query.

We call sbatch/sinfo/squeue/scontrol directly (argv lists, never a shell) rather than submitit: submitit
pickles a Python callable and owns the script, while we need a plain, reviewable sbatch script (the
user's record of the run) with our own preemption/requeue chain, and srun/torchrun modes. No torch.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainctl.data_prep import check_data
from trainctl.errors import RunError, UsageError
from trainctl.launch.run_dir import (
    check_run_dir,
    create_run_dir,
    default_run_dir,
    freeze_spec,
    now_iso,
    read_job,
    write_atomic,
    write_job,
)
from trainctl.launch.sbatch_template import (
    CONTROL_CHARS,
    DEFAULT_GRACE_S,
    TRAINER_MODULE,
    SbatchRender,
    SbatchRequest,
    render,
)
from trainctl.rundir import RunPaths, record_event
from trainctl.spec import RunSpec

SLURM_TIMEOUT_S = 30.0
COMMANDS_FILE = "commands.txt"


@dataclass(frozen=True)
class SlurmLaunch:
    """Everything a Slurm launch will do, rendered before anything is created (what --dry-run prints)."""

    spec: RunSpec
    run_dir: Path
    request: SbatchRequest
    rendered: SbatchRender

    @property
    def script(self) -> str:
        return self.rendered.script

    def submit_argv(self) -> list[str]:
        return self.rendered.argv(str(RunPaths(self.run_dir).launch_script))


# --- rendering ----------------------------------------------------------------------------------------

def _check_text(field: str, value: str | None) -> None:
    if value is not None and CONTROL_CHARS.search(value):
        raise UsageError(f"{field} = {value!r} contains a newline or control character",
                         hint=f"remove it from {field}: Slurm options and paths must be one plain line")


def _check_args(field: str, args: list[str]) -> None:
    for a in args:
        _check_text(field, a)
        if not a.startswith("-"):
            raise UsageError(f"{field} item {a!r} is not an option",
                             hint=f"give each {field} item as one --option=value word, e.g. '--reservation=r1'")


def plan_slurm(spec: RunSpec, run_dir: Path | None = None, *, grace_s: int = DEFAULT_GRACE_S,
               python: str | None = None, trainer_module: str = TRAINER_MODULE) -> SlurmLaunch:
    """Validate what can be checked without the cluster (exit 2 on a problem) and render the script."""
    if spec.backend != "slurm":
        raise UsageError(f"launcher.backend = {spec.launcher.backend!r} resolves to {spec.backend!r}, not slurm",
                         hint="use --set launcher.backend=slurm")
    spec = freeze_spec(spec)
    root = (run_dir or default_run_dir(spec)).absolute()
    check_run_dir(root)
    return _render_launch(spec, root, grace_s=grace_s, python=python, trainer_module=trainer_module)


def _render_launch(spec: RunSpec, root: Path, *, grace_s: int, python: str | None,
                   trainer_module: str) -> SlurmLaunch:
    """Vet every user value of the spec and render the script for the run directory `root`."""
    check_data(spec)
    c, lz = spec.cluster, spec.launcher
    for name, value in (("name", spec.name), ("cluster.partition", c.partition), ("cluster.account", c.account),
                        ("cluster.qos", c.qos), ("cluster.time", c.time), ("cluster.constraint", c.constraint),
                        ("cluster.exclude", c.exclude), ("cluster.mem", c.mem), ("run directory", str(root))):
        _check_text(name, value)
    if "\\" in str(root):  # sbatch expands no %j at all in an --output path with a backslash
        raise UsageError(f"run directory {str(root)!r} contains a backslash, which Slurm's --output cannot take",
                         hint="pass a --run-dir without backslashes")
    _check_args("launcher.srun_args", lz.srun_args)
    _check_args("launcher.sbatch_args", lz.sbatch_args)
    for k, v in lz.env.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise UsageError(f"launcher.env key {k!r} is not a valid environment variable name",
                             hint="use letters, digits and underscores, not starting with a digit")
        _check_text(f"launcher.env.{k}", v)
    if c.time is not None and parse_time(c.time) is None:
        raise UsageError(f"cluster.time = {c.time!r} is not a Slurm time",
                         hint="use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 12:00:00)")
    if not 1 <= grace_s <= 65535:
        raise UsageError(f"--grace {grace_s} is out of range", hint="give 1..65535 seconds")
    req = SbatchRequest(
        run_dir=str(root), job_name=spec.name, nodes=c.nodes, gpus_per_node=c.gpus_per_node,
        mode=lz.mode, python=python or sys.executable, request_gpus=c.gpu != "cpu",
        cpus_per_rank=c.cpus_per_task, mem=c.mem, time=c.time, partition=c.partition, account=c.account,
        qos=c.qos, constraint=c.constraint, exclude=c.exclude, max_restarts=lz.max_restarts, grace_s=grace_s,
        srun_args=tuple(lz.srun_args), sbatch_args=tuple(lz.sbatch_args), env=dict(lz.env),
        trainer_module=trainer_module,
        header=f"trainctl launch (slurm, {lz.mode} mode): {c.nodes} node(s) x {c.gpus_per_node} rank(s); "
               "spec.yaml and plan.json are next to this script",
    )
    return SlurmLaunch(spec=spec, run_dir=root, request=req, rendered=render(req))


# --- the cluster (sinfo) ------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeInfo:
    partition: str
    default: bool
    available: str  # up/down/drain/inact
    max_time_min: int | None  # None: UNLIMITED
    node: str
    state: str
    gpus: int
    cpus: int


SINFO_FORMAT = "%P|%a|%l|%N|%t|%G|%c"  # partition(* = default)|avail|timelimit|node|state|gres|cpus


def parse_time(text: str) -> int | None:
    """Slurm time limit -> minutes (rounded up); None if malformed. UNLIMITED/infinite -> a huge number."""
    t = text.strip()
    if t.upper() in ("UNLIMITED", "INFINITE"):
        return 10**9
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t)
    if not m:
        return None
    days, a, b, c = (int(x) if x is not None else None for x in m.groups())
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        h, mi, s = a, b or 0, c or 0
    elif c is not None:  # HH:MM:SS
        h, mi, s = a, b, c
    elif b is not None:  # MM:SS
        h, mi, s = 0, a, b
    else:  # minutes
        h, mi, s = 0, a, 0
    assert h is not None and mi is not None
    total_s = ((days or 0) * 24 + h) * 3600 + mi * 60 + s
    return -(-total_s // 60)


def parse_gres_gpus(gres: str) -> int:
    """'gpu:4', 'gpu:a100:8(S:0-1)', 'gpu:2,shard:4' -> GPUs; '(null)' -> 0."""
    total = 0
    for item in gres.split(","):
        item = re.sub(r"\(.*?\)", "", item)
        parts = item.split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def parse_sinfo(text: str) -> list[NodeInfo]:
    out = []
    for line in text.splitlines():
        f = line.strip().split("|")
        if len(f) != 7:
            continue
        part, avail, limit, node, state, gres, cpus = f
        out.append(NodeInfo(partition=part.rstrip("*"), default=part.endswith("*"), available=avail,
                            max_time_min=parse_time(limit) if limit not in ("", "n/a") else None,
                            node=node, state=state, gpus=parse_gres_gpus(gres),
                            cpus=int(cpus) if cpus.isdigit() else 0))
    return out


def run_slurm(*argv: str, timeout: float = SLURM_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    if shutil.which(argv[0]) is None:
        raise UsageError(f"{argv[0]} not found: this machine is not a Slurm login node",
                         hint="run trainctl launch where sbatch works, or use --dry-run to see the script")
    try:
        return subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RunError(f"{' '.join(argv)} did not answer within {timeout:.0f}s",
                       hint="is slurmctld up? try `sinfo`") from e


def query_sinfo() -> list[NodeInfo]:
    proc = run_slurm("sinfo", "-h", "-N", "-o", SINFO_FORMAT)
    if proc.returncode != 0:
        raise RunError(f"sinfo failed: {proc.stderr.strip() or proc.stdout.strip()}",
                       hint="is slurmctld up? try `sinfo`")
    return parse_sinfo(proc.stdout)


DEAD_STATES = ("down", "drain", "drng", "fail", "maint", "unk", "npc", "futr", "inval")


def check_cluster(spec: RunSpec, nodes: list[NodeInfo]) -> list[str]:
    """What would make this job impossible on this cluster: each a message naming the field and the fix."""
    c = spec.cluster
    parts = sorted({n.partition for n in nodes})
    if c.partition is None:
        default = sorted({n.partition for n in nodes if n.default})
        if not default:
            return [f"cluster.partition is not set and the cluster has no default partition; set "
                    f"cluster.partition to one of: {', '.join(parts)}"]
        name = default[0]
    else:
        name = c.partition
    mine = [n for n in nodes if n.partition == name]
    if not mine:
        return [f"cluster.partition = {name!r}: no such partition; use one of: {', '.join(parts) or '(none)'}"]
    problems = []
    where = f"partition {name!r}" + (" (the default)" if c.partition is None else "")
    if mine[0].available != "up":
        problems.append(f"{where} is {mine[0].available}, jobs will not start; pick another cluster.partition")
    count = len({n.node for n in mine})
    usable = {n.node for n in mine if not n.state.rstrip("*~#!%$@^-").startswith(DEAD_STATES)}
    if c.nodes > count:
        problems.append(f"cluster.nodes = {c.nodes} but {where} has {count} node(s); lower cluster.nodes or pick "
                        f"a bigger partition")
    elif c.nodes > len(usable):
        problems.append(f"cluster.nodes = {c.nodes} but only {len(usable)} node(s) of {where} are up; the job "
                        "would wait until nodes return (lower cluster.nodes or pick another partition)")
    if c.gpu != "cpu":
        with_gpus = {n.node for n in mine if n.gpus >= c.gpus_per_node}
        most = max((n.gpus for n in mine), default=0)
        if len(with_gpus) < c.nodes:
            problems.append(f"cluster.gpus_per_node = {c.gpus_per_node} but {where} has "
                            f"{len(with_gpus)} node(s) with that many GPUs (at most {most} per node, from gres); "
                            "lower cluster.gpus_per_node or pick a GPU partition")
    limit = mine[0].max_time_min
    if c.time is not None and limit is not None:
        want = parse_time(c.time)
        if want is not None and want > limit:
            problems.append(f"cluster.time = {c.time!r} is over {where}'s limit of {_fmt_minutes(limit)}; lower "
                            "cluster.time (the run requeues itself at the limit and resumes) or pick another "
                            "partition")
    return problems


def _fmt_minutes(m: int) -> str:
    d, rest = divmod(m, 24 * 60)
    h, mi = divmod(rest, 60)
    return f"{d}-{h:02d}:{mi:02d}:00" if d else f"{h:02d}:{mi:02d}:00"


def require_cluster_fits(spec: RunSpec) -> None:
    problems = check_cluster(spec, query_sinfo())
    if problems:
        raise UsageError("\n".join(problems), hint="`sinfo` shows the partitions, nodes, GPUs and time limits")


# --- creating and submitting --------------------------------------------------------------------------

def create(launch: SlurmLaunch) -> RunPaths:
    """The run directory: spec.yaml, plan.json, launch.sh (the sbatch script), commands.txt, job.json."""
    argv = launch.submit_argv()
    paths = create_run_dir(launch.run_dir, launch.spec, backend="slurm", command=argv, env=dict(launch.request.env))
    write_atomic(paths.launch_script, launch.script, mode=0o755)
    write_atomic(paths.root / COMMANDS_FILE, commands_text(launch))
    job = read_job(paths)
    job["slurm"] = {"mode": launch.request.mode, "script": paths.launch_script.name,
                    "submit_command": argv, "options": launch.rendered.options,
                    # what `trainctl resume` needs to render the script again after a --set
                    "render": {"python": launch.request.python, "grace_s": launch.request.grace_s,
                               "trainer_module": launch.request.trainer_module},
                    "jobs": []}
    write_job(paths, job)
    return paths


def commands_text(launch: SlurmLaunch) -> str:
    """The exact command lines, as plain text a person can paste into a shell."""
    return ("# submission (run from anywhere; every value is quoted for a POSIX shell)\n"
            f"{shlex.join(launch.submit_argv())}\n\n"
            "# the training step the batch script runs ($VARS are set by the script)\n"
            f"{' '.join(launch.rendered.step)}\n")


def submit(launch: SlurmLaunch, paths: RunPaths) -> str:
    """sbatch --parsable; the job id is recorded in job.json and events.jsonl."""
    return _sbatch(paths, launch.submit_argv(), mode=launch.request.mode)


def _sbatch(paths: RunPaths, argv: list[str], *, mode: str, **event: Any) -> str:
    proc = run_slurm(*argv, timeout=60)
    out = proc.stdout.strip()
    job_id = out.split(";")[0].strip()  # --parsable: "ID" or "ID;cluster"
    if proc.returncode != 0 or not job_id.isdigit():
        record_event(paths, "submit_failed", backend="slurm", error=(proc.stderr or out).strip()[:500])
        raise RunError(f"sbatch failed (exit {proc.returncode}): {(proc.stderr or out).strip()}",
                       hint=f"the script is {paths.launch_script}; commands in {paths.root / COMMANDS_FILE}")
    job = read_job(paths)
    sl = job.setdefault("slurm", {})
    submitted = now_iso()
    job["job_id"] = job_id
    sl["job_id"] = job_id
    sl["submitted"] = submitted
    sl.setdefault("jobs", []).append({"job_id": job_id, "submitted": submitted, "command": argv,
                                      **({"resubmit_of": event["previous_job_id"]} if "previous_job_id" in event
                                         else {})})
    write_job(paths, job)
    record_event(paths, "submit", backend="slurm", job_id=job_id, mode=mode, **event)
    return job_id


# --- resubmitting an existing run (`trainctl resume RUN`) ---------------------------------------------

ACTIVE_HINT = "wait for it to end, or stop it first: trainctl cancel {run}"


def require_not_active(paths: RunPaths) -> None:
    """Refuse to resubmit while the run's last job is still queued or running: two jobs would train into
    the same run directory (and `trainctl resume --from-step` would move checkpoints under a live job)."""
    from trainctl.launch.status import TERMINAL

    job = read_job(paths)
    job_id = job.get("job_id")
    if job_id is None:
        return
    state = job_state(str(job_id))["state"]
    if state not in TERMINAL and state != "UNKNOWN":
        raise UsageError(f"Slurm job {job_id} of {paths.root} is {state}: it is still this run's job",
                         hint=ACTIVE_HINT.format(run=shlex.quote(str(paths.root)))
                         + (" (a REQUEUED/PENDING job resumes from the latest checkpoint by itself)"
                            if state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED") else ""))


def resubmit(paths: RunPaths) -> str:
    """Submit a Slurm run directory's launch.sh again; returns the new job id.

    The script needs no change to continue a run: every start of the trainer resumes from the newest valid
    checkpoint in the run directory, and the job appends to the same logs, metrics.jsonl and events.jsonl.
    When the frozen spec changed since the script was rendered (`trainctl resume --set ...`), the script is
    rendered again from it (the old one is kept as launch.prev-N.sh). The cluster is checked first (sinfo),
    and the submission is recorded in job.json (`job_id`, `slurm.jobs`) and as a `submit` event.
    """
    from trainctl.spec import load_spec

    paths = RunPaths(Path(paths.root).absolute())
    require_not_active(paths)
    job = read_job(paths)
    sl = job.get("slurm") or {}
    previous = job.get("job_id")
    spec = freeze_spec(load_spec(paths.spec))
    if spec.backend != "slurm":
        raise UsageError(f"{paths.spec}: launcher.backend resolves to {spec.backend!r}, but this run was launched "
                         "on Slurm", hint="resume it with --set launcher.backend=slurm")
    require_cluster_fits(spec)
    argv = list(sl.get("submit_command") or [])
    mode = str(sl.get("mode") or spec.launcher.mode)
    render_args = sl.get("render")
    if render_args:
        launch = _render_launch(spec, paths.root, grace_s=int(render_args["grace_s"]),
                                python=render_args.get("python"),
                                trainer_module=str(render_args.get("trainer_module") or TRAINER_MODULE))
        current = paths.launch_script.read_text(encoding="utf-8") if paths.launch_script.exists() else None
        if current != launch.script or argv != launch.submit_argv():
            _replace_script(paths, launch, current)
            job = read_job(paths)  # _replace_script updated it
        argv, mode = launch.submit_argv(), launch.request.mode
    elif not argv or not paths.launch_script.exists():
        raise UsageError(f"{paths.root}: no recorded sbatch command or launch.sh to resubmit",
                         hint="the run directory is damaged; launch the spec again into a new run directory")
    return _sbatch(paths, argv, mode=mode, resubmit=True,
                   **({"previous_job_id": str(previous)} if previous is not None else {}))


def _replace_script(paths: RunPaths, launch: SlurmLaunch, current: str | None) -> None:
    """Write the re-rendered launch.sh and commands.txt, keeping the old script as launch.prev-N.sh."""
    kept = None
    if current is not None:
        n = 1
        while (paths.root / f"launch.prev-{n}.sh").exists():
            n += 1
        kept = paths.root / f"launch.prev-{n}.sh"
        os.replace(paths.launch_script, kept)
    write_atomic(paths.launch_script, launch.script, mode=0o755)
    write_atomic(paths.root / COMMANDS_FILE, commands_text(launch))
    job = read_job(paths)
    sl = job.setdefault("slurm", {})
    sl.update({"mode": launch.request.mode, "submit_command": launch.submit_argv(),
               "options": launch.rendered.options})
    write_job(paths, job)
    record_event(paths, "launch_script_changed", previous=kept.name if kept else None,
                 reason="the frozen spec changed (trainctl resume --set)")


# --- querying a job -----------------------------------------------------------------------------------

def parse_kv(text: str) -> dict[str, str]:
    """`scontrol show job -o` / jobcomp.log line -> {Key: value} (values never contain spaces we need)."""
    out: dict[str, str] = {}
    for m in re.finditer(r"(\w+)=(\S*)", text):
        out.setdefault(m.group(1), m.group(2))
    return out


def scontrol_job(job_id: str) -> dict[str, str] | None:
    """The live record (pending, running, or finished within MinJobAge); None when Slurm forgot it."""
    if shutil.which("scontrol") is None:
        return None
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0 or "JobState=" not in proc.stdout:
        return None
    # JobName may contain spaces: take it separately, then parse the rest.
    line = proc.stdout.strip().splitlines()[0]
    return parse_kv(line)


def jobcomp_path() -> Path | None:
    """Where jobcomp/filetxt appends finished jobs (the local cluster; no sacct there)."""
    if shutil.which("scontrol") is None:
        return None
    try:
        proc = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                              timeout=SLURM_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None
    cfg = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", proc.stdout, re.M))
    if cfg.get("JobCompType") == "jobcomp/filetxt" and cfg.get("JobCompLoc"):
        return Path(cfg["JobCompLoc"])
    return None


def jobcomp_record(job_id: str, path: Path | None = None) -> dict[str, str] | None:
    path = path if path is not None else jobcomp_path()
    if path is None or not path.exists():
        return None
    last = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(f"JobId={job_id} "):
                last = line
    return parse_kv(last) if last else None


def sacct_state(job_id: str) -> str | None:
    """Accounting, where the cluster has it (real clusters); None otherwise."""
    if shutil.which("sacct") is None:
        return None
    try:
        proc = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True,
                              text=True, timeout=SLURM_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    return lines[-1].split()[0] if proc.returncode == 0 and lines else None


def job_state(job_id: str) -> dict[str, Any]:
    """{'state': Slurm's word, 'reason', 'restarts', 'source'}: live record, then jobcomp.log, then sacct."""
    rec = scontrol_job(job_id)
    if rec is not None:
        return {"state": rec.get("JobState", "UNKNOWN"), "reason": rec.get("Reason"),
                "restarts": int(rec.get("Restarts", "0") or 0), "nodes": rec.get("NodeList"),
                "source": "scontrol"}
    rec = jobcomp_record(job_id)
    if rec is not None:
        return {"state": rec.get("JobState", "UNKNOWN"), "reason": None, "restarts": None,
                "nodes": rec.get("NodeList"), "source": "jobcomp"}
    state = sacct_state(job_id)
    if state is not None:
        return {"state": state, "reason": None, "restarts": None, "nodes": None, "source": "sacct"}
    return {"state": "UNKNOWN", "reason": "Slurm no longer knows the job", "restarts": None, "nodes": None,
            "source": None}


def cancel(job_id: str, signal: str | None = None) -> None:
    argv = ["scancel", *([f"--signal={signal}", "--full"] if signal else []), job_id]
    proc = run_slurm(*argv)
    if proc.returncode != 0:
        raise RunError(f"scancel {job_id} failed: {proc.stderr.strip() or proc.stdout.strip()}")

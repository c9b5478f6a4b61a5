"""The run directory: the name of every file in it, and the JSONL helpers. No torch.

Launch, runtime, report and the CLI all find a run's files through `RunPaths`; no other module spells a
name out (docs/design/run-states.md, "Run directory"). Checkpoint-internal names (step directories, manifest,
marker) belong to trainctl/checkpoint/format.py.

    RUN/spec.yaml                    frozen, fully resolved spec (spec.prev-<n>.yaml: before a resume --set)
    RUN/plan.json                    the planner's prediction for spec.yaml (plan.prev-<n>.json: spec.prev-<n>.yaml's)
    RUN/launch.sh                    the rendered launch script / command line (launch.prev-<n>.sh: replaced)
    RUN/commands.txt                 Slurm: the exact submission and step command lines
    RUN/job.json                     backend, ids, attempts, git commit
    RUN/run.lock                     local: the live launcher (host, pid, start time, boot id); one job per run
    RUN/run.lock.takeover            held for milliseconds while a stale run.lock is removed
    RUN/.launcher-reserve            local: 64 KiB the launcher holds while a run trains and frees to record its end
                                     when the disk filled
    RUN/metrics.jsonl                one JSON object per training step (rank 0)
    RUN/events.jsonl                 starts, restarts, checkpoints, preemptions, failures
    RUN/placement.json               where every rank really ran (rank 0)
    RUN/calibration.json             `trainctl calibrate`: the profile its worker measured (rank 0)
    RUN/preflight.json               `trainctl preflight`: what its worker measured on every node (rank 0)
    RUN/excluded_nodes.json          nodes kept out of this run's jobs, each with its reason (preflight, crashes)
    RUN/tensorboard/events.out.tfevents.*  tracking.tensorboard: TensorBoard event files, one per attempt (rank 0)
    RUN/wandb/                       tracking.wandb: wandb's own directory (offline-run-*/, run-*/), rank 0
    RUN/wandb/trainctl-run-id        the W&B run id every attempt resumes
    RUN/profile/trace-rank<R>-steps<S>-<E>.json    train.profile: rank R's Chrome/Perfetto trace of steps S..E
    RUN/profile/memory-rank<R>-steps<S>-<E>.pickle on GPU: rank R's CUDA memory snapshot of the same steps
    RUN/final_weights/               the trained weights, when a test asks for them
    RUN/checkpoints/                 committed checkpoints (unless checkpoint.dir says elsewhere)
    RUN/logs/launcher.log            local: the console of torchrun, in full
    RUN/logs/slurm-<job>.out         Slurm: the batch script's output, every attempt appended
    RUN/logs/slurm-<job>.err         Slurm's own messages (srun, slurmstepd, torchrun's agent), kept out of the output
    RUN/logs/steptimes-rank<N>.jsonl each rank's step times (stragglers)
    RUN/logs/heartbeat-rank<N>       each rank's liveness (hang watchdog)
    RUN/logs/oom-rank<N>.json        each rank's out-of-memory kill counters at its start (hardware/oom_kills.py)
    RUN/logs/<torchrun run id>/...   local: torchrun's per-rank stdout/stderr (its --log-dir is RUN/logs)
    RUN/logs/torchrun/<job>.<restart>/<node>/...   Slurm torchrun mode: the same, per job attempt and node

The hang watchdog's stack dumps go to the rank's stderr, i.e. into torchrun's per-rank log or the Slurm
output: they have no file of their own.
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainctl.errors import UsageError
from trainctl.fileio import LINK_FIX, LINK_REFUSED, fsync_path, open_append

SPEC = "spec.yaml"
PLAN = "plan.json"
LAUNCH_SCRIPT = "launch.sh"
COMMANDS = "commands.txt"
JOB = "job.json"
LOCK = "run.lock"  # trainctl/launch/runlock.py: which launcher owns the run directory now
LOCK_TAKEOVER = "run.lock.takeover"  # held for milliseconds while a stale run.lock is removed
LAUNCHER_RESERVE = ".launcher-reserve"  # local: space the launcher frees to record how a run ended on a full disk
LOGS = "logs"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
PLACEMENT = "placement.json"
CALIBRATION = "calibration.json"
PREFLIGHT = "preflight.json"
EXCLUDED_NODES = "excluded_nodes.json"
FINAL_WEIGHTS = "final_weights"
TENSORBOARD = "tensorboard"
WANDB = "wandb"  # wandb.init(dir=RUN) makes RUN/wandb itself: the name is wandb's, spelled here once
WANDB_RUN_ID = "trainctl-run-id"  # under WANDB
PROFILE = "profile"
TRACE = "trace-rank{rank}-steps{first}-{last}.json"
MEMORY_SNAPSHOT = "memory-rank{rank}-steps{first}-{last}.pickle"
CHECKPOINTS = "checkpoints"
LAUNCHER_LOG = "launcher.log"
TORCHRUN_LOGS = "torchrun"  # under logs/: Slurm torchrun mode's --log-dir, one per job attempt and node
SLURM_OUTPUT = "slurm-{job}.out"  # {job}: a job id, or Slurm's %j in the sbatch --output pattern
SLURM_MESSAGES = "slurm-{job}.err"  # the same job's sbatch --error: Slurm's own messages
STEPTIMES = "steptimes-rank{rank}.jsonl"
HEARTBEAT = "heartbeat-rank{rank}"
OOM_COUNTERS = "oom-rank{rank}.json"
PREVIOUS_SPEC = "spec.prev-{n}.yaml"
PREVIOUS_PLAN = "plan.prev-{n}.json"  # the plan of the attempts that ran spec.prev-{n}.yaml
PREVIOUS_LAUNCH_SCRIPT = "launch.prev-{n}.sh"
# torchrun's own layout under its --log-dir: <rendezvous run id>/attempt_<n>/<local rank>/{stdout,stderr}.log
TORCHRUN_RANK_LOGS = "*/attempt_*/{local_rank}/std*.log"

# The entries of a run directory that trainctl, its launcher or a rank writes (or writes into): none may be a
# symbolic link (RunPaths.links), nor may anything in logs/, which is wholly theirs and torchrun's.
WRITTEN = (SPEC, PLAN, LAUNCH_SCRIPT, COMMANDS, JOB, LOCK, LOCK_TAKEOVER, LOGS, METRICS, EVENTS, PLACEMENT, CALIBRATION,
           PREFLIGHT, EXCLUDED_NODES, FINAL_WEIGHTS, TENSORBOARD, WANDB, PROFILE, CHECKPOINTS)

TAIL_BYTES = 64 * 1024  # last_jsonl: enough for the last records of any of our JSONL files

_STEPTIMES_RE = re.compile(re.escape(STEPTIMES).replace(re.escape("{rank}"), r"(\d+)"))


def _numbered(pattern: str) -> re.Pattern[str]:
    """A regex of a file-name pattern whose {fields} are numbers, captured by name."""
    return re.compile(re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>\\d+)", re.escape(pattern)))


_PROFILE_FILES = {"trace": _numbered(TRACE), "memory_snapshot": _numbered(MEMORY_SNAPSHOT)}


@dataclass(frozen=True)
class ProfileFile:
    """One file of RUN/profile: a rank's trace or memory snapshot of steps first..last."""

    kind: str  # "trace" | "memory_snapshot"
    rank: int
    first: int
    last: int
    path: Path


@dataclass(frozen=True)
class RunPaths:
    """Every path of one run directory. `root` may also be a shell word (e.g. "$RUN_DIR") for a script."""

    root: Path

    @property
    def spec(self) -> Path:
        return self.root / SPEC

    def links(self) -> list[Path]:
        """The entries trainctl writes (WRITTEN, and everything in logs/) that are symbolic links: a write there
        would land in the link's target, outside the run."""
        found = [p for p in (self.root / name for name in WRITTEN) if p.is_symlink()]
        if self.logs.is_dir() and not self.logs.is_symlink():
            found += sorted(p for p in self.logs.iterdir() if p.is_symlink())
        return found

    def refuse_links(self) -> None:
        """Refuse (UsageError: one line naming the first link, where it points and the fix) a run directory with
        a symbolic link where trainctl writes, before anything is written (`links`)."""
        found = self.links()
        if found:
            more = f" (and {len(found) - 1} more in the run directory)" if len(found) > 1 else ""
            raise UsageError(f"{found[0]} {LINK_REFUSED} (it points to {os.readlink(found[0])}){more}",
                             hint=f"{LINK_FIX}, then run the command again")

    def previous_spec(self, n: int) -> Path:
        """Where the n-th replaced spec.yaml is kept (`trainctl resume --set`)."""
        return self.root / PREVIOUS_SPEC.format(n=n)

    def previous_plan(self, n: int) -> Path:
        """The plan of the n-th replaced spec, kept beside it when `trainctl resume --set` plans the new one."""
        return self.root / PREVIOUS_PLAN.format(n=n)

    @property
    def plan(self) -> Path:
        return self.root / PLAN

    @property
    def launch_script(self) -> Path:
        return self.root / LAUNCH_SCRIPT

    def previous_launch_script(self, n: int) -> Path:
        """Where the n-th replaced launch.sh is kept (re-rendered after a spec change)."""
        return self.root / PREVIOUS_LAUNCH_SCRIPT.format(n=n)

    @property
    def commands(self) -> Path:
        return self.root / COMMANDS

    @property
    def job(self) -> Path:
        return self.root / JOB

    @property
    def lock(self) -> Path:
        return self.root / LOCK

    @property
    def lock_takeover(self) -> Path:
        return self.root / LOCK_TAKEOVER

    @property
    def launcher_reserve(self) -> Path:
        return self.root / LAUNCHER_RESERVE

    @property
    def logs(self) -> Path:
        return self.root / LOGS

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def events(self) -> Path:
        return self.root / EVENTS

    @property
    def placement(self) -> Path:
        return self.root / PLACEMENT

    @property
    def calibration(self) -> Path:
        return self.root / CALIBRATION

    @property
    def preflight(self) -> Path:
        return self.root / PREFLIGHT

    @property
    def excluded_nodes(self) -> Path:
        return self.root / EXCLUDED_NODES

    @property
    def final_weights(self) -> Path:
        return self.root / FINAL_WEIGHTS

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD

    @property
    def wandb(self) -> Path:
        return self.root / WANDB

    @property
    def wandb_run_id(self) -> Path:
        return self.wandb / WANDB_RUN_ID

    @property
    def profile(self) -> Path:
        return self.root / PROFILE

    def trace(self, rank: int, first: int, last: int) -> Path:
        return self.profile / TRACE.format(rank=rank, first=first, last=last)

    def memory_snapshot(self, rank: int, first: int, last: int) -> Path:
        return self.profile / MEMORY_SNAPSHOT.format(rank=rank, first=first, last=last)

    def profile_files(self) -> list[ProfileFile]:
        """Every finished trace and memory snapshot, by rank, then steps (a file being written has another
        name until it is complete)."""
        if not self.profile.is_dir():
            return []
        found = []
        for f in self.profile.iterdir():
            for kind, regex in _PROFILE_FILES.items():
                m = regex.fullmatch(f.name)
                if m:
                    found.append(ProfileFile(kind, int(m["rank"]), int(m["first"]), int(m["last"]), f))
        return sorted(found, key=lambda x: (x.rank, x.first, x.last, x.kind))

    @property
    def launcher_log(self) -> Path:
        return self.logs / LAUNCHER_LOG

    def slurm_output(self, job_id: str) -> Path:
        """A Slurm job's output file; job_id "%j" gives the pattern sbatch --output expands."""
        return self.logs / SLURM_OUTPUT.format(job=job_id)

    def slurm_messages(self, job_id: str) -> Path:
        """Slurm's own messages of a job (its --error file, and srun's lines the batch script sets apart)."""
        return self.logs / SLURM_MESSAGES.format(job=job_id)

    def steptimes(self, rank: int) -> Path:
        return self.logs / STEPTIMES.format(rank=rank)

    def steptimes_by_rank(self) -> dict[int, Path]:
        """Every rank's step-time file that exists, by rank."""
        if not self.logs.is_dir():
            return {}
        found = {}
        for f in sorted(self.logs.iterdir()):  # by name, as the report has always read them
            m = _STEPTIMES_RE.fullmatch(f.name)
            if m:
                found[int(m.group(1))] = f
        return found

    def heartbeat(self, rank: int) -> Path:
        return self.logs / HEARTBEAT.format(rank=rank)

    def oom_counters(self, rank: int) -> Path:
        return self.logs / OOM_COUNTERS.format(rank=rank)

    @property
    def torchrun_logs(self) -> Path:
        return self.logs / TORCHRUN_LOGS

    def torchrun_attempt_logs(self, job_id: str, restart: str) -> Path:
        """Slurm torchrun mode: the --log-dir of one job attempt (each node adds its name below it)."""
        return self.torchrun_logs / f"{job_id}.{restart}"

    def local_rank_logs(self, rank: int) -> list[Path]:
        """A local run's torchrun files of one rank (logs/ is torchrun's --log-dir), every attempt."""
        return _files(self.logs.glob(TORCHRUN_RANK_LOGS.format(local_rank=rank)))

    def slurm_rank_logs(self, node: str, local_rank: int) -> list[Path]:
        """Slurm torchrun mode: the torchrun files of one local rank on one node, every job and attempt."""
        return _files(self.torchrun_logs.glob(f"*/{node}/" + TORCHRUN_RANK_LOGS.format(local_rank=local_rank)))


@dataclass(frozen=True)
class DirIdentity:
    """Which directory a path named when a job started (device and inode): a run directory deleted under the job,
    or deleted and made again, is told apart from the one it started in. Neither the launcher nor a rank then
    writes there again (nothing of the run is recreated: docs/FAILURES.md)."""

    dev: int
    ino: int

    @classmethod
    def of(cls, path: Path) -> DirIdentity:
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino)

    def lost(self, path: Path) -> OSError | None:
        """Why `path` is no longer this directory (ENOENT: deleted, or replaced by another), or None."""
        try:
            if DirIdentity.of(path) == self:
                return None
        except OSError as e:
            return e
        return FileNotFoundError(errno.ENOENT, "deleted and made again", str(path))


def _files(paths: Any) -> list[Path]:
    """Plain files, oldest first (then by name: stdout and stderr of one attempt keep their order)."""
    files = [p for p in paths if p.is_file()]
    return sorted(files, key=lambda p: (p.stat().st_mtime, p.name))


def append_text(path: Path, text: str, fsync: bool = False) -> None:
    """Append `text` (whole lines) in a single write(), so concurrent appenders do not interleave, and on a
    fresh line: after a torn last line (a writer killed mid-line, a full disk) the new line would otherwise
    be glued onto it and both be lost. `fsync`: durable on return (and the file's name, when it made it)."""
    with open_append(path) as f:  # never through a symbolic link (fileio.NOFOLLOW)
        data = text.encode("utf-8")
        made = f.tell() == 0  # append mode: the position is the end
        if not made:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                data = b"\n" + data
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    if fsync and made:
        fsync_path(path.parent)


def shell_fresh_line(path_word: str) -> str:
    """`append_text`'s fresh line for a shell script's `printf FORMAT ... >>FILE`: a word to put right before the
    quoted FORMAT that gives printf a leading `\\n` when FILE (a shell word, quoted as needed) does not end with
    a newline."""
    return f'"$([ -n "$(tail -c1 {path_word} 2>/dev/null)" ] && printf %s \'\\n\')"'


def append_jsonl(path: Path, record: dict[str, Any], fsync: bool = False) -> None:
    """Append one JSON object as one line (on a fresh line, in one write: `append_text`)."""
    append_text(path, json.dumps(record, separators=(",", ":")) + "\n", fsync=fsync)


def record_event(paths: RunPaths, kind: str, **fields: Any) -> None:
    """Append one event, durably: events are few (starts, saves, stops, failures) and each is what `status`,
    `resume --repair` and the report read a run's history from after a crash."""
    append_jsonl(paths.events, {"time": time.time(), "event": kind, "pid": os.getpid(), **fields}, fsync=True)


@dataclass(frozen=True)
class JsonlRead:
    """The records of a JSONL file, and the lines skipped as unreadable (torn, not JSON, not UTF-8, not an
    object), by line number (1-based)."""

    records: list[dict[str, Any]]
    bad_lines: list[int]

    def skipped_note(self, path: Path) -> str | None:
        """'metrics.jsonl: skipped 2 unreadable lines (3, 9)', or None when every line was read."""
        n = len(self.bad_lines)
        if not n:
            return None
        shown = ", ".join(map(str, self.bad_lines[:5])) + (", ..." if n > 5 else "")
        return (f"{path.name}: skipped {n} unreadable line{'s' if n != 1 else ''} ({shown}): torn, not JSON "
                "or not UTF-8")


def parse_jsonl_line(raw: bytes) -> dict[str, Any] | None:
    """One JSONL line as a JSON object, or None where it is not one (the one parser of every JSONL reader)."""
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def load_jsonl(path: Path) -> JsonlRead:
    """Read a JSONL file; every line that is not a JSON object is skipped and counted, none stops the
    reading (a missing file reads as empty)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return JsonlRead([], [])
    records, bad = [], []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        rec = parse_jsonl_line(raw)
        if rec is None:
            bad.append(n)
        else:
            records.append(rec)
    return JsonlRead(records, bad)


def last_jsonl(path: Path) -> dict[str, Any] | None:
    """The last readable record of a (possibly huge, possibly torn) JSONL file, reading only its tail."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        return None
    return next((rec for raw in reversed(lines) if (rec := parse_jsonl_line(raw)) is not None), None)


def read_yaml(path: Path) -> dict[str, Any] | None:
    """A run's YAML file (its frozen spec, a replaced one) as plain data, no validation; None when it is missing,
    unreadable or not a mapping."""
    from trainctl.errors import SpecError
    from trainctl.spec.loader import parse_yaml, read_spec_text  # here: most readers never need YAML

    try:  # read as a spec file is: a regular file of bounded size, no duplicate key (a hand-made run directory)
        return parse_yaml(read_spec_text(path), str(path))
    except SpecError:
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file, its unreadable lines skipped (`load_jsonl` also counts them)."""
    return load_jsonl(path).records

"""One truth about a run: its state, derived in one place from the run directory and its backend. No torch.

`trainctl status`, `runs`, `cancel`, `logs -f`, `resume`, `mfu-report` and the local launcher's last line all
read it (docs/design/run-states.md, "Run states", has the transition table). The states:

- PENDING    submitted, not running (Slurm's queue, or a requeued job waiting for its eligible time)
- STARTING   the job runs, the trainer has not begun training (torchrun, process groups, checkpoint load), or
             begins again after a rank's failure that torchrun restarts
- RUNNING    training
- STOPPING   a stop was asked for (Ctrl-C, SIGTERM, `trainctl cancel`); every rank saves after its step. Or a
             rank failed with no torchrun restart left, and the processes are exiting (nothing is saved)
- STOPPED    stopped after committing a checkpoint (Ctrl-C, SIGTERM, a killed launcher): `trainctl resume`
- CANCELLED  stopped by `trainctl cancel` or scancel (with a checkpoint when the ranks had time): resumable
- COMPLETED  every step done
- FAILED     a rank failed: the first cause names the rank, its node, what happened and the log
- DIVERGED   the divergence guard stopped it (runtime/train/divergence.py)

An *attempt* is one start of the job: a local `launch` or `resume` (the launcher's event), or one Slurm
allocation of a job (the batch script's `slurm_start`). Its outcome comes from the events written after it
began; the backend says whether anything still runs (the run lock's processes, or Slurm's job state).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from trainctl.errors import EXIT_DIVERGED, EXIT_OK, EXIT_RUN_FAILED, EXIT_STOPPED
from trainctl.hardware.hostname import as_named
from trainctl.hardware.oom_kills import killed_by_oom
from trainctl.rundir.paths import RunPaths, read_jsonl

# Named here, where a run's state is read from them; written by checkpoint/space.py and launch/environment.py
DISK_FULL = "disk full"  # the kind of failure, first in the line a full disk prints
SETUP_FAILED = "setup_failed"  # the event a failing launcher.setup line records

PENDING = "PENDING"
STARTING = "STARTING"
RUNNING = "RUNNING"
STOPPING = "STOPPING"
STOPPED = "STOPPED"
CANCELLED = "CANCELLED"
COMPLETED = "COMPLETED"
FAILED = "FAILED"
DIVERGED = "DIVERGED"

EXIT_CODE = {COMPLETED: EXIT_OK, STOPPED: EXIT_STOPPED, CANCELLED: EXIT_STOPPED, DIVERGED: EXIT_DIVERGED,
             FAILED: EXIT_RUN_FAILED}

LAUNCHER_SIGNAL = {"SIGINT": "Ctrl-C", "SIGTERM": "SIGTERM to the launcher", "SIGHUP": "the terminal closed"}
BEGIN_EVENTS = ("launch", "resume", "slurm_start")  # one attempt begins (launcher / batch script)
STOP_EVENTS = ("stop_requested", "cancel_requested")
FORCED = "`trainctl cancel --force`"  # what killed a run's processes, in words (`outcome`)

# A failure whose message says a peer went away is the consequence of another rank's death, not its cause.
SECONDARY = re.compile(r"Connection (closed|reset) by peer|Broken pipe|connectFullMesh|Socket Timeout|"
                       r"NCCL communicator was aborted|ProcessGroupNCCL.*(abort|timeout)|"
                       r"Timed out waiting|final barrier failed|Connection refused|RecvMsg|SendMsg",
                       re.IGNORECASE)


LOST_PEER = "lost a peer"  # a Cause kind: this rank saw another one die
OUT_OF_MEMORY = "out of memory"  # a Cause kind: an allocation failed, or the kernel's OOM killer struck


@dataclass(frozen=True)
class Cause:
    """The first cause of a failed attempt."""

    kind: str  # "exception", "out of memory", "disk full", "hang", "signal", "stopped by the launcher"
    message: str
    rank: int | None = None
    host: str | None = None

    def line(self) -> str:
        where = "" if self.rank is None else f"rank {self.rank}" + (f" on {self.host}" if self.host else "")
        return f"{where + ': ' if where else ''}{self.kind}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "rank": self.rank, "host": self.host}


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended, from its events alone (None from `outcome` while nothing says so)."""

    state: str  # COMPLETED, STOPPED, CANCELLED, DIVERGED, FAILED
    step: int | None  # the step it ended after (the checkpoint a stop committed; where it diverged)
    reason: str
    cause: Cause | None = None
    kept: int | None = None  # DIVERGED: the last finite checkpoint
    before_first_step: bool = False  # stopped before training: `step` is what was loaded, nothing was saved

    @property
    def exit_code(self) -> int:
        return EXIT_CODE[self.state]


@dataclass
class RunState:
    """What `trainctl status` shows, and what every other command decides by."""

    state: str
    reason: str | None
    active: bool  # something of the run still runs or waits: cancel has something to stop
    backend: str
    job_state: str | None  # the backend's own word (Slurm's), when it has one
    attempts: int
    outcome: Outcome | None = None  # of the latest attempt, once it ended
    eligible_at: str | None = None  # a pending requeue: when Slurm lets it start
    nodes: str | None = None


# --- one attempt ----------------------------------------------------------------------------------------

def event_time(e: dict[str, Any]) -> float:
    t = e.get("time")
    return float(t) if isinstance(t, (int, float)) else 0.0


def in_time_order(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events in the order they happened: by the time each bears (ties in file order). The file's own order is
    the order of the appends, which two ranks failing microseconds apart can make the reverse of the order
    they failed in; every reader of "what came first" (the launcher's last line, `status`, `mfu-report`) reads
    the events in this order, so they name the same first cause."""
    return sorted(events, key=event_time)


def read_events(paths: RunPaths) -> list[dict[str, Any]]:
    """The run's events.jsonl, in time order (`in_time_order`)."""
    return in_time_order(read_jsonl(paths.events))


def attempt_begin(events: list[dict[str, Any]]) -> float:
    """When the latest attempt began (0.0: none recorded)."""
    return max((float(e.get("time", 0.0)) for e in events if e.get("event") in BEGIN_EVENTS), default=0.0)


def since(events: list[dict[str, Any]], t: float) -> list[dict[str, Any]]:
    return [e for e in events if float(e.get("time", 0.0)) >= t]


def _last(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((e for e in reversed(events) if e.get("event") == kind), None)


def forced(events: list[dict[str, Any]]) -> bool:
    """`trainctl cancel --force` was asked for (it records so before it signals: a SIGTERM cannot say it)."""
    return any(e.get("event") == "cancel_requested" and e.get("force") for e in events)


def outcome(events: list[dict[str, Any]], killed: str | None = None) -> Outcome | None:
    """The outcome of an attempt from its events (those written after it began), or None while none is
    recorded. `killed`: what made the local launcher kill the ranks, in words (a second Ctrl-C, `trainctl
    cancel --force`); once it has returned, its own verdict is in its `launcher_exit` event."""
    if (fin := _last(events, "finish")) is not None:
        return Outcome(COMPLETED, fin.get("steps"), "every step done")
    if (div := _last(events, "diverged")) is not None:
        kept = div.get("last_finite_checkpoint")
        return Outcome(DIVERGED, div.get("step"), f"the loss or gradient norm was NaN/inf for "
                       f"{div.get('skipped_in_row')} steps in a row (since step {div.get('first_skipped_step')}); "
                       f"last finite checkpoint {f'step {kept}' if kept else 'none'}", kept=kept)
    cancelled = _last(events, "cancel_requested") is not None
    slurm = slurm_stop(events)
    if (sig := _last(events, "checkpoint_on_signal")) is not None or (sig := _last(events, "stopped")) is not None:
        step, early = sig.get("step"), bool(sig.get("before_first_step"))
        saved = (f"checkpoint step {step} committed" if not early else
                 f"before the first step, nothing new to save (checkpoint step {step} kept)" if step else
                 "before the first step, nothing to save")
        asked = _last(events, "stop_requested")
        by = (LAUNCHER_SIGNAL.get(asked.get("signal"), f"{asked.get('signal')} to the launcher") if asked
              else slurm or sig.get("reason") or sig.get("signal"))
        why = "cancelled" if cancelled else f"stopped ({by})"
        return Outcome(CANCELLED if cancelled else STOPPED, step, f"{why}; {saved}", before_first_step=early)
    cause = first_cause(events)
    if slurm is not None and _last(events, "start") is None and (cause is None or cause.kind == LOST_PEER):
        # Slurm ended the attempt while the ranks started: KillWait's SIGKILL came before they could record it
        why = "cancelled" if cancelled else f"stopped ({slurm})"
        return Outcome(CANCELLED if cancelled else STOPPED, None, f"{why}; before the first step, nothing to save")
    ex = _last(events, "launcher_exit")
    if ex is not None and ex.get("state") in EXIT_CODE and (cause is None or cause.kind == LOST_PEER):
        # the local launcher's verdict: a kill, or torchrun's own record of a rank that died by a signal
        recorded = Cause(**ex["cause"]) if isinstance(ex.get("cause"), dict) else None
        return Outcome(ex["state"], ex.get("step"), str(ex.get("reason") or ""), recorded)
    if cause is not None:
        return Outcome(FAILED, _last_step(events), cause.line(), cause)
    killed = killed or (FORCED if forced(events) else None)  # Slurm: scancel --signal=KILL, nothing recorded
    if killed:
        return Outcome(CANCELLED if cancelled else STOPPED, None,
                       f"killed before the ranks could save ({killed}); steps after the newest valid "
                       "checkpoint are lost")
    if ex is not None:  # a launcher of an older trainctl, or one that recorded no verdict
        return Outcome(FAILED, _last_step(events), "the trainer exited without recording why (see the logs)")
    return None


def slurm_stop(events: list[dict[str, Any]]) -> str | None:
    """The stop signal the Slurm batch script got in this attempt, with why Slurm sent it (`slurm_stop`,
    launch/slurm/stop_cause.py): "SIGTERM: scancel", "SIGUSR1"; None when it got none."""
    sig = _last(events, "signal")
    if sig is None:
        return None
    cause = _last(events, "slurm_stop")
    return f"SIG{sig.get('signal')}" + (f": {cause['reason']}" if cause and cause.get("reason") else "")


def live_outcome(events: list[dict[str, Any]]) -> Outcome | None:
    """The outcome of what runs now, while the job is active: torchrun restarts the workers inside one attempt
    (launcher.max_restarts; an elastic run's lost node), and a `start` after a failure supersedes it, so only
    the events since the latest `start` count (all of them before any)."""
    begun = [float(e.get("time", 0.0)) for e in events if e.get("event") == "start"]
    return outcome(since(events, max(begun)) if begun else events)


def _last_step(events: list[dict[str, Any]]) -> int | None:
    steps = [e.get("step") for e in events if isinstance(e.get("step"), int)]
    return steps[-1] if steps else None


def first_cause(events: list[dict[str, Any]]) -> Cause | None:
    """The failure that came first and was not the consequence of another (a peer's "connection closed"),
    from the events of one attempt: a full disk, a rank's exception, a hang, then a peer-loss error."""
    if (full := _last(events, "disk_full")) is not None:
        # the recorded line names the kind already ("disk full: saving checkpoint ..."): said once
        line = str(full.get("message") or "no space left for a checkpoint")
        return Cause(DISK_FULL, line.removeprefix(f"{DISK_FULL}: "))
    if (gave_up := _last(events, "start_failed")) is not None and gave_up.get("gave_up"):
        return Cause("launch failure", f"the step failed to start (srun exit status {gave_up.get('exit_code')}) "
                     "and launcher.start_retries requeues were used up; the job's log has srun's words")
    if (setup := _last(events, SETUP_FAILED)) is not None:  # a launcher.setup line failed: no trainer began
        where = f" on {setup['host']}" if setup.get("host") else " in the batch script"
        return Cause("setup failed", f"launcher.setup[{setup.get('item')}] exited with status "
                     f"{setup.get('exit_code')}{where}; the trainer did not start")
    events = in_time_order(events)  # the first to fail, whatever order the ranks' appends landed in
    failures = [e for e in events if e.get("event") == "failure"]
    primary = [e for e in failures if not SECONDARY.search(str(e.get("error") or ""))]
    hangs = [e for e in events if e.get("event") == "hang"]
    pick = primary[:1] or hangs[:1] or failures[:1]
    if not pick:
        return None
    e = pick[0]
    if e.get("event") == "hang":
        return Cause("hang", hang_message(e), e.get("rank"), e.get("host"))
    msg = str(e.get("error") or "failed")
    kind = (OUT_OF_MEMORY if re.search(r"out of memory|OutOfMemoryError", msg, re.IGNORECASE)
            else LOST_PEER if SECONDARY.search(msg) else "exception")
    return Cause(kind, msg, e.get("rank"), e.get("host"))


def hang_message(e: dict[str, Any]) -> str:
    """A `hang` event in words: the rank's own watchdog fired, or another rank's found it stopped
    (runtime/observe/watchdog.py names the rank whose heartbeat went stale first)."""
    by = e.get("detected_by", e.get("rank"))
    if by == e.get("rank"):
        return f"no step progress for {e.get('idle_s')} s at step {e.get('step')} (watchdog)"
    return (f"no step progress after step {e.get('step')}: its process stopped running (heartbeat "
            f"{e.get('heartbeat_age_s')} s old when rank {by}'s watchdog fired, which waited for it"
            f"{'; killed' if e.get('killed') else ''})")


def restart_cause(events: list[dict[str, Any]]) -> str | None:
    """Why torchrun restarted the workers, from the events since their previous `start` (None without one): the
    first cause, unless it is only a lost peer; then the ranks of that world that recorded nothing while the
    others lost them, with their nodes (a rank killed by a signal writes no event)."""
    begun = [i for i, e in enumerate(events) if e.get("event") == "start"]
    if not begun:
        return None
    cause = first_cause(events[begun[-1] + 1:])
    if cause is not None and cause.kind != LOST_PEER:
        return cause.line()
    after = events[begun[-1] + 1:]
    spoke = {e.get("rank") for e in after if e.get("event") in ("failure", "hang")}
    where = next((e.get("ranks") or [] for e in reversed(events[:begun[-1] + 1]) if e.get("event") == "placement"),
                 [])
    world = int(events[begun[-1]].get("world_size") or len(where))
    silent = [f"rank {r}" + (f" on {where[r][0]}" if r < len(where) else "") for r in range(world) if r not in spoke]
    if not spoke or not silent:
        return cause.line() if cause is not None else None
    return (f"{', '.join(silent)} ended without a record (killed by a signal: a kill -9, the out-of-memory killer, "
            f"a lost node); {len(spoke)} other rank(s) lost {'it' if len(silent) == 1 else 'them'}")


# --- the run ---------------------------------------------------------------------------------------------

def stop_requested(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((e for e in reversed(events) if e.get("event") in STOP_EVENTS), None)


def failed_unasked(attempt: list[dict[str, Any]]) -> Outcome | None:
    """The failure of what runs now (`live_outcome`) when no stop was asked of the attempt: a rank failed while
    the job goes on (torchrun restarts the workers, or ends the job); no rank saves a checkpoint for it."""
    live = live_outcome(attempt)
    return live if live is not None and live.state == FAILED and stop_requested(attempt) is None else None


def stop_in_flight(paths: RunPaths) -> str | None:
    """The stop asked of the run's current attempt and where it is, in words ("`trainctl cancel` asked it to
    stop at 19:40:02; step 12, checkpoint in progress"); None when none was asked. For a refusal while the
    attempt still runs: the advice is then to wait, not to cancel again."""
    events = read_jsonl(paths.events)
    current = since(events, attempt_begin(events))
    # a cancel's own record first: the launcher then records the SIGTERM the cancel sent it as a stop_requested
    asked = _last(current, "cancel_requested") or stop_requested(current)
    if asked is None:
        return None
    who = ((FORCED if asked.get("force") else "`trainctl cancel`") if asked.get("event") == "cancel_requested"
           else LAUNCHER_SIGNAL.get(asked.get("signal"), f"{asked.get('signal')} to the launcher"))
    when = time.strftime("%H:%M:%S", time.localtime(float(asked.get("time") or 0.0)))
    return f"{who} asked it to stop at {when}; {stopping_progress(paths)}"


def stopping_progress(paths: RunPaths) -> str:
    """Where a stopping run is, in words: its step and whether the checkpoint it stops with is committed."""
    events = read_events(paths)
    current = since(events, attempt_begin(events))
    if (sig := _last(current, "checkpoint_on_signal")) is not None:
        return ("before the first step, nothing to save" if sig.get("before_first_step")
                else f"step {sig.get('step')}, checkpoint committed; the ranks are exiting")
    if (failed := failed_unasked(current)) is not None:
        return f"{failed.reason}; nothing is saved, the ranks are exiting"
    if _last(current, "start") is None:
        return "before the first step, nothing to save"
    steps = [m.get("step") for m in read_jsonl(paths.metrics) if isinstance(m.get("step"), int)]
    return f"step {steps[-1] if steps else 0}, checkpoint in progress"


# --- torchrun's own record -------------------------------------------------------------------------------

_FAILURE = re.compile(r"^\s*host\s*:\s*(?P<host>\S+)\s*\n\s*rank\s*:\s*(?P<rank>\d+).*\n"
                      r"\s*exitcode\s*:\s*(?P<code>-?\d+)(?:\s*\(pid: \d+\))?\s*(?:\((?P<sig>SIG\w+)\))?",
                      re.MULTILINE)


def lost_peer_ranks(events: list[dict[str, Any]]) -> set[int]:
    """Ranks whose recorded failure is only the loss of a peer ("connection closed by peer")."""
    return {int(e["rank"]) for e in events if e.get("event") == "failure" and isinstance(e.get("rank"), int)
            and SECONDARY.search(str(e.get("error") or ""))}


def torchrun_root_cause(console: str, lost_peer: set[int] | frozenset[int] = frozenset()) -> Cause | None:
    """A rank that died by a signal (SIGKILL from the kernel's OOM killer, a segfault) writes no event: take
    it from torchrun's ChildFailedError block ("host : ..., rank : N (local_rank: ...), exitcode : -9 (pid: P)
    (SIGKILL)", torch 2.x's format) in the console of one attempt. The "Root Cause (first observed failure)"
    entry first: torchrun SIGKILLs the ranks that outlive it, so most others read -9. But torchrun orders by
    the time it has for each failure, a rank's own error file for a rank that raised and the moment it looked
    for one killed by a signal, so a survivor that raised on the lost connection (`lost_peer`) can come
    first; then the cause is the rank among the other failures that a signal killed and that recorded no
    failure itself."""
    head, sep, root = console.rpartition("Root Cause (first observed failure):")
    m = _FAILURE.search(root) if sep else None
    if m is None:
        return None
    cause = _torchrun_cause(m)
    if cause.kind == "exception" and cause.rank in lost_peer:
        others = head.rsplit("Failures:", 1)[-1]
        killed = [x for x in _FAILURE.finditer(others) if int(x["code"]) < 0 and int(x["rank"]) not in lost_peer]
        if killed:
            return _torchrun_cause(killed[0])
    return cause


def oom_or(cause: Cause | None, paths: RunPaths) -> Cause | None:
    """`cause`, or out of memory where it is a SIGKILL and the rank's out-of-memory kill counters grew since it
    started (trainctl/hardware/oom_kills.py; readable on the rank's own node only)."""
    if cause is None or cause.kind != "signal" or "SIGKILL" not in cause.message or cause.rank is None:
        return cause
    why = killed_by_oom(paths.oom_counters(cause.rank))
    if why is None:
        return cause
    return Cause(OUT_OF_MEMORY, f"killed by the kernel's out-of-memory killer ({why})", cause.rank, cause.host)


def _torchrun_cause(m: re.Match[str]) -> Cause:
    code = int(m["code"])
    if code < 0:
        sig = m["sig"] or f"signal {-code}"
        why = " (the kernel's out-of-memory killer, or a kill -9)" if sig == "SIGKILL" else ""
        return Cause("signal", f"killed by {sig}{why}", int(m["rank"]), as_named(m["host"]))
    return Cause("exception", f"exited with status {code}", int(m["rank"]), as_named(m["host"]))

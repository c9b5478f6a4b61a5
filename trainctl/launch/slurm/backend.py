"""The Slurm backend: `launch` submits a batch script, `status` asks Slurm, `cancel` is scancel, `resume`
submits the run directory's script again. No torch."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from typing import Any

from trainctl.errors import EXIT_OK, RunError
from trainctl.launch.backend import (
    DEFAULT_GRACE_S,
    TRAINER_MODULE,
    Backend,
    JobState,
    Line,
    LogFiles,
    Say,
    no_rank_logs,
    note,
    verbatim,
)
from trainctl.launch.slurm import NAME, array, cluster, submit
from trainctl.launch.slurm import job_state as jobs
from trainctl.launch.slurm.render import SlurmLaunch, plan_slurm
from trainctl.launch.slurm.stop_cause import NODE_FAILURE
from trainctl.rundir.paths import RunPaths
from trainctl.spec import RunSpec


class SlurmBackend(Backend[SlurmLaunch, RunPaths]):
    name = NAME

    def prepare(self, spec: RunSpec, run_dir: Path | None, *, grace_s: int = DEFAULT_GRACE_S,
                module: str = TRAINER_MODULE, dry_run: bool = False) -> SlurmLaunch:
        return plan_slurm(spec, run_dir, grace_s=grace_s, trainer_module=module, dry_run=dry_run)

    def dry_run(self, launch: SlurmLaunch) -> list[Line]:
        lines = [note(("run dir (not created)", "bold"), f" {launch.run_dir}")]
        lines += [note(text) for text in plan_summary(launch.spec)]
        lines += self._cluster_check(launch)
        lines += [note(("warning:", "yellow"), f" {w}") for w in launch.warnings]
        lines += [note(("submit with", "bold")), verbatim(shlex.join(launch.submit_argv())),
                  note(("sbatch script", "bold")), verbatim(launch.script.removesuffix("\n"))]
        return lines

    @staticmethod
    def _cluster_check(launch: SlurmLaunch) -> list[Line]:
        # A dry run shows what would be submitted even where the controller cannot be reached;
        # `launch` itself refuses then (require_cluster_fits).
        if not shutil.which("sinfo"):
            return [note(("sinfo not found: cluster checks skipped", "dim"))]
        try:
            nodes = cluster.query_sinfo()
        except RunError as e:
            return [note(("cluster checks skipped:", "yellow"), f" {e}")]
        problems = cluster.check_cluster(launch.spec, nodes)
        if not problems:
            return [note("cluster check (sinfo): ok")]
        return [note(("cluster check:", "red"), f" {p}") for p in problems]

    def start(self, launch: SlurmLaunch, say: Say, *, verbose: bool = False) -> int:
        cluster.require_cluster_fits(launch.spec)
        for w in launch.warnings:
            say(note(("warning:", "yellow"), f" {w}"))
        paths = submit.create(launch)
        job_id = submit.submit(launch, paths)
        say(note(("submitted", "bold"), f" Slurm job {job_id}  run dir {paths.root}"))
        run = shlex.quote(str(paths.root))
        say(note(f"follow it:  trainctl status {run}   |   trainctl logs {run} -f"))
        return EXIT_OK

    def create(self, launch: SlurmLaunch) -> RunPaths:
        return submit.create(launch)

    def require_not_active(self, paths: RunPaths) -> None:
        submit.require_not_active(paths)

    def prepare_resume(self, spec: RunSpec, paths: RunPaths) -> RunPaths:
        # Rendered at submission from the spec then on disk (resubmit), after `resume --set` has written it.
        return paths

    def resume_details(self, relaunch: RunPaths) -> dict[str, Any]:
        return {}

    def resume_dry_run(self, relaunch: RunPaths) -> list[Line]:
        return []

    def resume(self, relaunch: RunPaths, say: Say, *, verbose: bool = False) -> int:
        job_id = submit.resubmit(relaunch, lambda line: say(note(line)))
        say(note(f"submitted job {job_id}"))
        return EXIT_OK

    def job_state(self, paths: RunPaths, job: dict[str, Any], events: list[dict[str, Any]]) -> JobState:
        job_id = job.get("job_id")
        if job_id is None:
            return JobState(jobs.UNKNOWN, f"never submitted (see {paths.events.name})", attempts=0, active=False)
        info = jobs.job_state(str(job_id))
        state, reason = info["state"], info["reason"]
        if state == jobs.UNKNOWN and array.never_started(str(job_id), events):  # Slurm keeps no record of it
            return JobState(jobs.CANCELLED, "cancelled before it started", attempts=0, active=False,
                            state_hint=jobs.CANCELLED)
        # Attempts of every job of the run (`trainctl resume` submits a new job into the same run dir).
        seen = {(str(e.get("job_id")), e.get("attempt")) for e in events if e.get("event") == "slurm_start"}
        earlier = sum(1 for j, _ in seen if j != str(job_id))
        attempts = max(len(seen), earlier + (info["restarts"] or 0) + 1 if info["restarts"] is not None else 0)
        pending = state in jobs.WAITING
        if reason in ("None", ""):  # scontrol's word for no reason (e.g. just after a requeue)
            reason = None
        # a requeued job is held until its EligibleTime (BeginTime, ~2 minutes); the Reason may lag behind
        held = pending and (reason == "BeginTime" or jobs.in_future(info.get("eligible")))
        eligible = info.get("eligible") if held else None
        if info["restarts"] and pending:
            reason = requeued_because(events, str(job_id), info["restarts"] - 1, reason)
        if eligible:
            reason = f"{reason}; eligible to start at {eligible}"
        return JobState(state, reason, attempts=attempts, active=jobs.is_active(state), nodes=info["nodes"],
                        pending=pending, eligible_at=eligible, state_hint=jobs.RUN_STATE_OF.get(state))

    def log_files(self, paths: RunPaths, job: dict[str, Any], rank: int | None) -> LogFiles:
        outputs = slurm_outputs(paths, job)
        if rank is None:
            return LogFiles(outputs)
        if (job.get("slurm") or {}).get("mode") == "srun":
            return LogFiles(outputs, prefix=srun_label_prefix(rank))  # srun's task id is the global rank
        files = torchrun_rank_logs(paths, rank)
        if not files:
            raise no_rank_logs(paths, rank, f"torchrun mode on Slurm needs RUN/{paths.placement.name} to find a "
                                            "rank's node")
        return LogFiles(files)

    def cancel(self, paths: RunPaths, job: dict[str, Any], *, force: bool = False) -> str:
        job_id = array.scancel_target(job)  # a sweep's job array element by its task
        if force:  # slurmctld turns a SIGKILL for a running job into its own cancel: there is no quicker kill
            submit.cancel(job_id, signal="KILL")
            return (f"cancelled Slurm job {job_id} with scancel --signal=KILL: Slurm sends SIGTERM now and SIGKILL "
                    "after its KillWait")
        submit.cancel(job_id)
        return f"cancelled Slurm job {job_id}"


def requeued_because(events: list[dict[str, Any]], job_id: str, attempt: int, slurm_reason: str | None) -> str:
    """A requeued job's reason: why Slurm ended its last attempt, as the batch script found it (`slurm_stop`:
    a node failure, scontrol requeue...; launch/slurm/stop_cause.py), or that the script requeued it itself
    (the stop warning, a preemption, a failed start), else Slurm's own word (BeginTime)."""
    mine = [e for e in events if str(e.get("job_id")) == job_id and e.get("attempt") == attempt]
    why = next((str(e["reason"]) for e in reversed(mine) if e.get("event") == "slurm_stop" and e.get("reason")),
               "the job requeued itself" if any(e.get("event") == "requeue" for e in mine) else None)
    if why is not None and why.startswith(NODE_FAILURE):
        return f"requeued after {why}"
    because = why or slurm_reason
    return f"requeued ({because})" if because else "requeued"


def plan_summary(spec: RunSpec) -> list[str]:
    """A few lines of the plan: layout, placement, the planner's headline estimate (if it is there)."""
    c, par = spec.cluster, spec.parallel
    lines = [f"{spec.name}: {spec.world_size:,} ranks = tp {par.tp} x pp {par.pp} x dp {spec.dp} on "
             f"{c.nodes} node(s) x {c.gpus_per_node} ({c.gpu}); launcher {spec.launcher.mode}, "
             f"max_restarts {spec.launcher.max_restarts}; {spec.train.steps} steps"]
    from trainctl.plan.placement import Layout, tp_groups_across_nodes

    across = tp_groups_across_nodes(Layout.from_spec(spec))
    lines.append("placement: every TP group inside one node" if not across
                 else f"placement: {len(across)} TP group(s) span nodes, e.g. {across[0]}")
    from trainctl.checkpoint import storage

    try:
        from trainctl.plan.plan import build_plan
    except ImportError:
        return lines
    p = build_plan(spec)
    est = [f"predicted MFU {p.mfu:.1%}" if p.mfu is not None else None,
           "fits in memory" if p.fits else "DOES NOT FIT in memory"]
    lines.append("plan: " + ", ".join(x for x in est if x))
    lines += [f"plan {w.level}: {w.message}" for w in p.warnings
              if w.code != storage.WARNING_CODE]  # the check before training has said it already
    return lines


def slurm_outputs(paths: RunPaths, job: dict[str, Any]) -> list[Path]:
    """The output file of every Slurm job of the run (first submission, then each resubmission)."""
    ids = [j["job_id"] for j in (job.get("slurm") or {}).get("jobs", []) if j.get("job_id") is not None]
    if job.get("job_id") is not None and job["job_id"] not in ids:
        ids.append(job["job_id"])
    return [paths.slurm_output(str(i)) for i in ids]


def torchrun_rank_logs(paths: RunPaths, rank: int) -> list[Path]:
    """torchrun's files of a global rank, oldest attempt first. Rendezvous order decides a rank's node and
    local rank, in every attempt anew (docs/design/trainer.md, "Rank order"): each attempt's `placement` event
    says where the rank ran then; a run without them falls back to placement.json (the latest attempt)."""
    from trainctl.rundir.paths import TORCHRUN_RANK_LOGS, read_jsonl

    found: list[Path] = []
    for e in read_jsonl(paths.events):
        where = e.get("ranks") if e.get("event") == "placement" and e.get("job_id") else None
        if not where or rank >= len(where):
            continue
        node, local = where[rank]
        base = paths.torchrun_attempt_logs(str(e["job_id"]), str(e.get("slurm_restart", "0"))) / str(node)
        pattern = TORCHRUN_RANK_LOGS.replace("attempt_*", f"attempt_{e.get('torchrun_restart', '0')}")
        found += sorted(base.glob(pattern.format(local_rank=local)))
    if found:
        return found
    try:
        data = json.loads(paths.placement.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return []
    where = {str(r["rank"]): r for r in data.get("ranks", [])}.get(str(rank))
    if where is None:
        return []
    return paths.slurm_rank_logs(where["node"], where["local_rank"])


def srun_label_prefix(rank: int) -> str:
    """`srun --label` prefixes every line with the task id (right-aligned), then ': '."""
    return f"{rank}: "

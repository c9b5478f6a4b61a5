"""Render the sbatch script of a Slurm launch (pure text; no Slurm, no torch).

The script is what a Slurm expert writes by hand: #SBATCH resource lines, MASTER_ADDR/MASTER_PORT from
the allocation, one `srun` step (one task per GPU, or one torchrun per node), and the preemption chain:

    Slurm --signal=B:USR1@GRACE -> batch script (trap) -> kill -USR1 <srun> -> srun forwards it to the
    step -> slurmstepd signals every process of every task -> the ranks checkpoint at the next step
    boundary and exit -> the batch script runs `scontrol requeue $SLURM_JOB_ID` itself.

Preemption by a higher-tier partition signals the *steps* (SIGTERM), not the batch script, and a job
that then ends by itself is recorded COMPLETED, not requeued (slurm/README.md); the script notices it
from `PreemptTime=` in `scontrol show job` and requeues too. So does a step whose ranks stopped on a
signal sent to them alone after committing a checkpoint (exit 75 under srun; under torchrun they exit 0
and record `checkpoint_on_signal`), unless the batch script got SIGTERM (scancel, `scontrol requeue`: Slurm
decides). A `finish` recorded by this attempt always wins: a run that completed is never requeued.

Shell safety: every value that comes from the spec is shlex-quoted in the body. #SBATCH lines cannot
be quoted (sbatch parses them itself), so only values made of plain characters go there; anything else
is handed to sbatch as a command-line argument (an argv list, no shell; see `SbatchRender.argv`).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainctl.errors import EXIT_DIVERGED, EXIT_RUN_FAILED
from trainctl.fileio import LINK_FIX, LINK_REFUSED
from trainctl.launch import environment, secrets
from trainctl.launch.backend import DEFAULT_GRACE_S, TRAINER_MODULE
from trainctl.rundir.paths import COMMANDS, EVENTS, WRITTEN, RunPaths, shell_fresh_line
from trainctl.rundir.runstate import SECONDARY, SETUP_FAILED

RUN = RunPaths(Path("$RUN_DIR"))  # the run directory's files as the script's body names them
EVENTS_WORD = f'"{RUN.events}"'  # events.jsonl as one shell word
RELATIVE = RunPaths(Path())  # and relative to the run directory
MASTER_PORT_BASE = 20000

# Characters a #SBATCH line carries verbatim: sbatch splits the line at whitespace, strips quotes and
# stops at '#', so anything outside this set goes on the command line instead.
SAFE_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.,:=@%/+\-\[\]]*$")
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
SETUP_FAIL = "setup_failed"  # the batch script's function for a failing launcher.setup line


@dataclass(frozen=True)
class SbatchRequest:
    """What to ask Slurm for; every string here may come from a user (treated as hostile)."""

    run_dir: str
    job_name: str
    nodes: int
    gpus_per_node: int
    mode: str  # "srun" (one task per GPU) or "torchrun" (one torchrun per node)
    python: str
    request_gpus: bool = True  # False for CPU "GPUs" (cluster.gpu: cpu): no gres in the request
    cpus_per_rank: int | None = None
    mem: str | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    max_restarts: int = 0
    min_nodes: int | None = None  # cluster.min_nodes below nodes: elastic (torchrun mode only; spec rules)
    start_retries: int = 3  # launcher.start_retries
    grace_s: int = DEFAULT_GRACE_S
    srun_args: Sequence[str] = ()
    sbatch_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    passthrough: Sequence[str] = ()  # variables the job takes from sbatch's environment (never written here)
    trainer_module: str = TRAINER_MODULE
    header: str = "trainctl launch (slurm)"
    setup: Sequence[str] = ()  # launcher.setup: the user's shell lines, verbatim
    container_image: str | None = None  # launcher.container (pyxis); None: no container
    container_mounts: Sequence[str] = ()
    container_workdir: str | None = None


@dataclass(frozen=True)
class SbatchRender:
    script: str
    options: list[str]  # every sbatch option, in order (#SBATCH lines and command line together)
    cli_options: list[str]  # the ones #SBATCH lines could not carry: pass as sbatch arguments
    step: list[str]  # the srun command line of the training step, shell words (for commands.txt)

    def argv(self, script_path: str, sbatch: str = "sbatch") -> list[str]:
        """The exact submission command: no shell involved, so these values need no quoting."""
        return [sbatch, "--parsable", *self.cli_options, script_path]


def sbatch_options(req: SbatchRequest) -> list[str]:
    """Every sbatch option of the request, as `--flag=value` words (values not yet vetted)."""
    tasks_per_node = req.gpus_per_node if req.mode == "srun" else 1
    # '%' starts a Slurm filename pattern: a literal one in the run dir is written '%%'.
    root = req.run_dir.rstrip('/').replace('%', '%%')
    # Slurm's own messages (slurmstepd's "*** JOB J CANCELLED ***") go to --error, apart from the job's log.
    logs, messages = f"{root}/{RELATIVE.slurm_output('%j')}", f"{root}/{RELATIVE.slurm_messages('%j')}"
    opts = [f"--job-name={req.job_name}", f"--nodes={req.nodes}", f"--ntasks-per-node={tasks_per_node}"]
    if req.request_gpus:
        opts.append(f"--gpus-per-node={req.gpus_per_node}")
    cpus = _cpus_per_task(req)
    if cpus is not None:
        opts.append(f"--cpus-per-task={cpus}")
    for flag, value in (("mem", req.mem), ("time", req.time), ("partition", req.partition),
                        ("account", req.account), ("qos", req.qos), ("constraint", req.constraint),
                        ("exclude", req.exclude)):
        if value is not None:
            opts.append(f"--{flag}={value}")
    opts += [f"--output={logs}", f"--error={messages}", "--open-mode=append", "--requeue",
             f"--signal=B:USR1@{req.grace_s}"]
    if req.min_nodes is not None:
        opts.append("--no-kill")  # elastic: a failed node does not end the allocation; the others go on
    return opts


def _cpus_per_task(req: SbatchRequest) -> int | None:
    # cluster.cpus_per_task is per rank; in torchrun mode one task (torchrun) holds the node's ranks.
    # Unset in torchrun mode would leave one CPU for torchrun and all its workers: give each rank one.
    if req.mode == "torchrun":
        return (req.cpus_per_rank or 1) * req.gpus_per_node
    return req.cpus_per_rank


def split_options(ours: list[str], extra: Sequence[str]) -> tuple[list[str], list[str]]:
    """(#SBATCH-line options, command-line options). Command-line options override #SBATCH lines, so
    once one of ours must go on the command line, the user's extra arguments follow it there (they were
    appended to ours and must keep winning)."""
    lines: list[str] = []
    cli: list[str] = []
    for opt in ours:
        (lines if SAFE_SBATCH_VALUE.match(opt) else cli).append(opt)
    if cli or not all(SAFE_SBATCH_VALUE.match(a) for a in extra):
        cli += list(extra)
    else:
        lines += list(extra)
    return lines, cli


def step_command(req: SbatchRequest) -> list[str]:
    """The srun line as shell words: literal words are shlex-quoted, `$VAR` words are ours."""
    q = shlex.quote
    G = req.gpus_per_node
    cpus = _cpus_per_task(req)
    # Elastic: one node's task ending (its node lost) must not end the step: the other torchruns re-rendezvous.
    common = [f"--kill-on-bad-exit={0 if req.min_nodes is not None else 1}", "--label"]
    if req.min_nodes is not None:
        common.append("--no-kill")
    if cpus is not None:
        # Slurm >= 22.05: srun no longer inherits sbatch's --cpus-per-task; say it again.
        common.append(f"--cpus-per-task={cpus}")
    common += [q(o) for o in container_options(req)]
    user = [q(a) for a in req.srun_args]
    events = str(RunPaths(Path(req.run_dir)).events)
    if req.mode == "srun":
        # In a container each task runs the setup itself, inside the image (see `batch_setup`): one per rank.
        setup = (["bash", "-c", q(environment.exec_after_setup(req.setup, events)), "trainctl-setup"]
                 if req.setup and req.container_image else [])
        return ["srun", f"--nodes={req.nodes}", f"--ntasks={req.nodes * G}", f"--ntasks-per-node={G}",
                *common, *user, *setup, '"$STEP_PYTHON"', "-u", "-m", q(req.trainer_module), '"$RUN_DIR"']
    # torchrun mode. The wrapper (a fixed string; its arguments are passed as "$@", never parsed):
    # USR1 and TERM reach every process of the step (proctrack). USR1 would kill torchrun (not a signal it
    # handles); on TERM torchrun raises SignalException, SIGTERMs its workers and SIGKILLs them 30 s later,
    # with tracebacks. So torchrun ignores both (--signals-to-handle without SIGTERM keeps it from installing
    # its own TERM handler over the inherited SIG_IGN; torchrun overwrites TORCHELASTIC_SIGNALS_TO_HANDLE from
    # that option, so the variable alone does nothing) while the ranks, which install their handler first thing,
    # save after the same step and exit 0, and torchrun ends with them. Slurm's SIGKILL after KillWait
    # still ends a hung job. PET_LOG_DIR (torchrun's --log-dir) is per node, so `trainctl logs --rank N`
    # can find a rank. launcher.setup runs first, in the node's task (inside the container, if any), so what it
    # sets is torchrun's environment and therefore the ranks'.
    # Elastic: torchrun's --nnodes=MIN:MAX; c10d re-forms the group on the nodes left (docs/design/launch.md,
    # "Elastic node ranges"). The rendezvous store lives in the first node's agent: losing that node ends the job.
    nnodes = "--nnodes=$SLURM_NNODES" if req.min_nodes is None else f"--nnodes={req.min_nodes}:{req.nodes}"
    # is_host: the first node's agent hosts the c10d store. torch decides it by matching the endpoint's name
    # against the machine's, which every node of a host running several slurmds (the test cluster) matches: the
    # store then lived in whichever agent bound first, n2's included, and losing n2 ended the job. The variable
    # is torchrun's --rdzv-conf (read when the option is absent); a launcher.env value of it is kept in front.
    # The trap comes first, before launcher.setup: a stop during the task's setup must not kill the task (a failed
    # step); the batch script has recorded it, and the ranks read it once started (runtime/train/signals.recorded_stop).
    wrapper = ('export PET_LOG_DIR="$0/$SLURMD_NODENAME"; '
               'export PET_RDZV_CONF="${PET_RDZV_CONF:+$PET_RDZV_CONF,}is_host=$([ "$SLURMD_NODENAME" = '
               '"$MASTER_ADDR" ] && echo 1 || echo 0)"; exec "$@"')
    wrapper = "\n".join(['trap "" USR1 TERM', *environment.task_setup(req.setup, events), wrapper])
    return ["srun", f"--nodes={req.nodes}", f"--ntasks={req.nodes}", "--ntasks-per-node=1", *common, *user,
            "bash", "-c", q(wrapper), f'"{RUN.torchrun_attempt_logs("$SLURM_JOB_ID", "${SLURM_RESTART_COUNT:-0}")}"',
            '"$STEP_PYTHON"', "-m", "torch.distributed.run", nnodes, f"--nproc-per-node={G}",
            "--rdzv-backend=c10d", '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"', '--rdzv-id="$SLURM_JOB_ID"',
            f"--max-restarts={req.max_restarts}", "--redirects=3", "--tee=3",
            "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT",
            "-m", q(req.trainer_module), '"$RUN_DIR"']


def container_options(req: SbatchRequest) -> list[str]:
    """pyxis's srun options for launcher.container. The others (--container-name, --no-container-mount-home,
    --container-writable, --container-env...) depend on the site's enroot setup: launcher.srun_args."""
    if req.container_image is None:
        return []
    opts = [f"--container-image={req.container_image}"]
    if req.container_mounts:
        opts.append(f"--container-mounts={','.join(req.container_mounts)}")
    if req.container_workdir:
        opts.append(f"--container-workdir={req.container_workdir}")
    return opts


def batch_setup(req: SbatchRequest) -> list[str]:
    """launcher.setup in the batch script, before the step: srun hands the batch shell's environment to every
    task. Not with a container: its lines are meant for the image (the host may lack its paths), and the
    image's own variables override the job's (pyxis), so each task runs them inside it instead."""
    if not req.setup or req.container_image is not None:
        return []
    return [
        f"{SETUP_FAIL}() {{  # INDEX STATUS: a launcher.setup line failed; the step is not started",
        '    echo "trainctl: launcher.setup[$1] failed (status $2); the training step was not started"',
        f'    event {SETUP_FAILED} ",\\"item\\":$1,\\"exit_code\\":$2"',
        "    exit 1",
        "}",
        "# launcher.setup: the spec's own shell lines, verbatim",
        *environment.guarded(req.setup, SETUP_FAIL),
        "",
    ]


def render(req: SbatchRequest) -> SbatchRender:
    q = shlex.quote
    ours = sbatch_options(req)
    lines, cli = split_options(ours, req.sbatch_args)
    step = step_command(req)
    G = req.gpus_per_node
    omp = '"${SLURM_CPUS_PER_TASK:-1}"' if req.mode == "srun" else f'"$(( ${{SLURM_CPUS_PER_TASK:-{G}}} / {G} ))"'

    out = [
        "#!/bin/bash",
        f"# {_comment(req.header)}",
        f"# mode {req.mode}: " + ("srun starts one task per GPU (ranks from SLURM_PROCID/SLURM_LOCALID/"
                                  "SLURM_NTASKS)" if req.mode == "srun" else
                                  "srun starts one torchrun per node (c10d rendezvous on the first node)"),
        *[f"#SBATCH {opt}" for opt in lines],
    ]
    if cli:
        out.append("# More options are given on the sbatch command line (values a #SBATCH line cannot carry): "
                   + " ".join(sorted({o.split("=", 1)[0] for o in cli})) + f"; see {COMMANDS}")
    out += [
        "",
        "set -u  # no -e/pipefail: the step's exit status is handled below",
        "exec 2>&1  # this script's own errors belong in the job's log; --error holds Slurm's messages",
        f"RUN_DIR={q(req.run_dir)}",
        f'SLURM_MESSAGES="{RUN.slurm_messages("$SLURM_JOB_ID")}"',
        f"PYTHON={q(req.python)}  # launcher.python, or the launching venv (compute nodes share this filesystem)",
        "",
        "# Rendezvous: the first host of the allocation, a port derived from the job id (the same on every",
        "# node and for every attempt of this job).",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        f"MASTER_PORT=$(( {MASTER_PORT_BASE} + SLURM_JOB_ID % {MASTER_PORT_BASE} ))",
        "export MASTER_ADDR MASTER_PORT",
        "",
        f"export OMP_NUM_THREADS={omp}  # one thread per allocated CPU, not one per core of the node",
        "export PYTHONUNBUFFERED=1  # step lines reach the log as they happen",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1  # a failed collective aborts the rank instead of hanging",
        "export TORCH_NCCL_BLOCKING_WAIT=0",
        *([] if "NCCL_DEBUG" in req.env else ["export NCCL_DEBUG=WARN"]),
        *[f"export {k}={q(v)}" for k, v in req.env.items()],
        *secrets.require_lines(req.passthrough, "sbatch ran in (trainctl launch/resume)"),
        "",
        'attempt="${SLURM_RESTART_COUNT:-0}"',
        'messages_at_start="$(wc -l <"$SLURM_MESSAGES" 2>/dev/null || echo 0)"',
        "slurm_said() {  # a failed attempt: Slurm's messages of this attempt, which a clean one keeps out of the log",
        '    if [ "$(wc -l <"$SLURM_MESSAGES" 2>/dev/null || echo 0)" -gt "$messages_at_start" ]; then',
        '        echo "trainctl: Slurm\'s messages of this attempt ($SLURM_MESSAGES):"',
        '        tail -n +"$((messages_at_start + 1))" "$SLURM_MESSAGES" | sed "s/^/    /"',
        "    fi",
        "}",
        f"event() {{  # event KIND [EXTRA_JSON]: one line of RUN/{EVENTS} (values are ours: numbers, words)",
        f"    printf {shell_fresh_line(EVENTS_WORD)}"
        '\'{"time":%s,"event":"%s","pid":%d,"job_id":"%s","attempt":%d%s}\\n\' '
        f'"$(date +%s.%N)" "$1" "$$" "$SLURM_JOB_ID" "$attempt" "${{2:-}}" >>{EVENTS_WORD}',
        "}",
        "# trainctl writes only regular files it made in the run directory: a symbolic link put there while the job",
        "# waited stops the attempt before anything is written through it (rundir.paths.RunPaths.links).",
        f'for f in "$RUN_DIR"/{{{",".join(WRITTEN)}}} "{RUN.logs}"/*; do',
        '    if [ -L "$f" ]; then',
        f'        echo "trainctl: $f {LINK_REFUSED} (it points to $(readlink "$f")); {LINK_FIX}, then trainctl'
        ' resume $RUN_DIR"',
        f"        exit {EXIT_RUN_FAILED}",
        "    fi",
        "done",
        'echo "trainctl: job $SLURM_JOB_ID attempt $attempt on $SLURM_JOB_NODELIST,'
        ' master $MASTER_ADDR:$MASTER_PORT"',
        'event slurm_start ",\\"nodes\\":\\"$SLURM_JOB_NODELIST\\""',
        "",
        "requeue=0",
        "terminated=0",
        "step_pid=",
        f'events_at_start="$(wc -l <"{RUN.events}" 2>/dev/null || echo 0)"',
        "this_attempt() {  # whether this attempt recorded event $1 (not an earlier job or attempt)",
        f'    tail -n +"$((events_at_start + 1))" "{RUN.events}" 2>/dev/null |',
        '        grep -qs "\\"event\\": *\\"$1\\""',
        "}",
        "event_line() {  # this attempt's last event $1",
        f'    tail -n +"$((events_at_start + 1))" "{RUN.events}" 2>/dev/null | grep "\\"event\\": *\\"$1\\"" |',
        "        tail -n 1",
        "}",
        "event_step() {  # the step of this attempt's last event $1",
        "    event_line \"$1\" | grep -o '\"step\": *[0-9]*' | grep -o '[0-9]*$'",
        "}",
        "on_usr1() {  # Slurm's warning (--signal=B:USR1) or `scancel --batch --signal=USR1`",
        '    echo "trainctl: SIGUSR1: the ranks checkpoint and stop; then this job requeues itself"',
        "    requeue=1",
        '    event signal \',"signal":"USR1"\'',
        '    if [ -n "$step_pid" ]; then kill -USR1 "$step_pid" 2>/dev/null; fi  # srun forwards it to the step',
        "}",
        "on_term() {  # scancel, scontrol requeue, a node failure, a preemption's grace: Slurm decides what follows",
        "    terminated=1",
        '    event signal \',"signal":"TERM"\'  # first: ranks starting now read it (train/signals.recorded_stop)',
        '    if [ -n "$step_pid" ]; then kill -TERM "$step_pid" 2>/dev/null; fi',
        '    stopped_by="$("$PYTHON" -m trainctl.launch.slurm.stop_cause "$SLURM_JOB_ID" "$attempt" \\',
        '        "$SLURM_JOB_NODELIST" "$SLURM_MESSAGES" "$messages_at_start" 2>/dev/null)"',
        '    echo "trainctl: SIGTERM (${stopped_by:-from Slurm}): stopping the ranks"',
        '    event slurm_stop ",\\"reason\\":\\"${stopped_by:-unknown}\\""',
        "}",
        "trap on_usr1 USR1",
        "trap on_term TERM",
        "",
        *exclusion_lines(),
        *batch_setup(req),
        "# The test-only start-failure fault (trainctl/runtime/train/faults.py): this attempt's launch fails for real.",
        'STEP_PYTHON="$PYTHON"',
        'for a in $("$PYTHON" -m trainctl.runtime.train.faults get start_fail_attempts 2>/dev/null | tr "+" " "); do',
        '    if [ "$a" = "$attempt" ]; then STEP_PYTHON=/nonexistent/trainctl-fault/python; fi',
        "done",
        "",
        *step_lines(step),
        "# The run directory was deleted under the job (its ranks stopped by themselves): nothing to record, and a",
        "# requeued attempt would only fail there; nothing of the run is made again.",
        'if [ ! -d "$RUN_DIR" ]; then',
        '    echo "trainctl: the run directory $RUN_DIR was deleted under the job; nothing more of this run is recorded'
        ' there"',
        f"    exit {EXIT_RUN_FAILED}",
        "fi",
        "# One line that says what happened (the ranks' events), not only an exit status.",
        'if [ "$step_started" = 0 ]; then',
        '    echo "trainctl: the stop came before the training step started, which was not started; nothing to save"',
        "elif this_attempt finish; then",
        '    echo "trainctl: every step done"',
        f"elif this_attempt {SETUP_FAILED}; then",
        '    echo "trainctl: launcher.setup failed in the step (the line above says where); the trainer did not'
        ' start"',
        "elif event_line checkpoint_on_signal | grep -qs '\"before_first_step\": *true'; then",
        '    echo "trainctl: the ranks stopped before their first step; nothing new to save"',
        "elif this_attempt checkpoint_on_signal; then",
        '    echo "trainctl: the ranks stopped after step $(event_step checkpoint_on_signal) with a committed'
        ' checkpoint"',
        "elif this_attempt diverged; then",
        '    echo "trainctl: diverged at step $(event_step diverged) (see the lines above)"',
        "else",
        '    echo "trainctl: the training step failed (status $rc); \\`trainctl status $RUN_DIR\\` names the first'
        ' cause"',
        "    slurm_said",
        "fi",
        "",
        "# The step failed to start (srun could not launch it: a revoked credential, a node lost at start, a",
        "# program missing on a node): the trainer never began and recorded no failure. Requeue, at most",
        f"# launcher.start_retries = {req.start_retries} times per job; Slurm holds a requeued job ~2 minutes.",
        'if [ "$rc" != 0 ] && [ "$terminated" = 0 ] && ! this_attempt start && ! this_attempt failure \\',
        f'        && ! this_attempt {SETUP_FAILED}; then',
        '    tries=$(grep -c "\\"event\\":\\"start_failed\\".*\\"job_id\\":\\"$SLURM_JOB_ID\\"" \\',
        f'        "{RUN.events}" 2>/dev/null)',
        f'    if [ "${{tries:-0}}" -lt {req.start_retries} ]; then',
        '        echo "trainctl: the step failed to start (status $rc; Slurm\'s words above): requeue $((tries + 1)) of'
        f' {req.start_retries}"',
        '        event start_failed ",\\"exit_code\\":$rc,\\"retry\\":$((tries + 1))"',
        "        requeue=1",
        "    else",
        f'        echo "trainctl: the step failed to start {req.start_retries + 1} times; giving up (status $rc)"',
        '        event start_failed ",\\"exit_code\\":$rc,\\"gave_up\\":true"',
        "    fi",
        "fi",
        "# Preempted (PreemptTime set): Slurm signalled the ranks, not us, and will not requeue a job that ends",
        "# by itself.",
        'if [[ "$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null)" =~ PreemptTime=[0-9] ]]; then requeue=1; fi',
        "# The ranks stopped on a signal sent to them alone (e.g. `scancel --signal=USR1 J`, no --batch) after",
        "# committing a checkpoint: they exit 75 under srun, 0 under torchrun (whose agent would restart them",
        "# otherwise) with a checkpoint_on_signal event. They ask to be requeued, unless Slurm is ending the job",
        "# (SIGTERM: scancel, scontrol requeue), which then decides itself.",
        'if [ "$terminated" = 0 ] && { [ "$rc" = 75 ] || this_attempt checkpoint_on_signal; }; then requeue=1; fi',
        "# A run that finished all its steps is done, whatever signal came late.",
        'if [ "$requeue" = 1 ] && this_attempt finish; then requeue=0; fi',
        "# The divergence guard stopped the run (its ranks exit 0 under torchrun): a failure of its own, and a",
        "# requeue would only diverge again.",
        f'if this_attempt diverged; then requeue=0; rc={EXIT_DIVERGED}; fi',
        *(["# Elastic: a lost node's task ended non-zero while the nodes left finished every step.",
            'if this_attempt finish; then rc=0; fi'] if req.min_nodes is not None else []),
        'if [ "$requeue" = 1 ]; then',
        '    echo "trainctl: requeueing job $SLURM_JOB_ID (attempt $((attempt + 1)) resumes from the latest'
        ' checkpoint)"',
        "    event requeue",
        "    trap '' TERM  # the SIGTERM of our own requeue: nothing is left to stop",
        '    if scontrol requeue "$SLURM_JOB_ID"; then exclude_next; exit 0; fi',
        '    echo "trainctl: scontrol requeue failed" >&2',
        "fi",
        'exit "$rc"',
    ]
    return SbatchRender(script="\n".join(out) + "\n", options=[*ours, *req.sbatch_args], cli_options=cli,
                        step=step)


# Slurm's own lines on srun's stderr: srun's ("srun: error: n2: task 1: Killed"), slurmstepd's ("0: slurmstepd-n1:
# error: *** STEP J.0 ON n1 CANCELLED AT ... ***", srun --label puts the task first) and, in torchrun mode, the
# agent's log lines ("1: E1126 14:08:42.423000 15665 .../api.py:1002] failed (exitcode: 1) ..."). An awk ERE.
SLURM_LINE = "^ *([0-9]+: )?((srun|slurmstepd)(-[^ :]*)?: |[IWE][0-9][0-9][0-9][0-9] [0-9:.]+ +[0-9]+ )"
# The filter of srun's stderr (awk, a line at a time as it comes). To the messages file: SLURM_LINE, and a rank's
# traceback up to the one-line summary the rank prints after it (runtime/entry.py), with that summary too when it
# is only the loss of a peer (runstate.SECONDARY). To the log: everything else, the summary of a real error too.
# A line's key is its prefix (srun's task id, torchrun's [defaultN]), so that ranks' lines may interleave.
STDERR_FILTER = (
    '{ key = match($0, /^ *[0-9]+: (\\[[^]]*\\]:)?/) ? substr($0, 1, RLENGTH) : ""; '
    "body = substr($0, length(key) + 1) } "
    f"/{SLURM_LINE}/ {{ print >> to; fflush(to); next }} "
    "body ~ /^Traceback \\(most recent call last\\):/ { tb[key] = 1 } "
    "key in tb && body ~ /^trainctl: rank [0-9]+ failed: / { delete tb[key]; "
    f"if (tolower(body) !~ /{SECONDARY.pattern.lower()}/) {{ print; fflush(); next }} }} "
    "key in tb { print >> to; fflush(to); next } "
    "body ~ /^trainctl: rank [0-9]+ failed: / && "
    f"tolower(body) ~ /{SECONDARY.pattern.lower()}/ {{ print >> to; fflush(to); next }} "
    "{ print; fflush() }")


def step_lines(step: list[str]) -> list[str]:
    """Start the training step, unless a stop came first, and wait for it to end: rc, and a step_exit event.

    srun's stderr passes a filter (STDERR_FILTER) that moves Slurm's own lines and the ranks' tracebacks to
    $SLURM_MESSAGES, so the log of a clean stop holds no "forcing job termination" or "STEP ... CANCELLED", and
    a lost rank's peers add no gloo traceback; the ranks' own lines stay (their logs have everything). The filter
    ignores the stop signals (Slurm signals every process of the batch step) so that it reads until srun ends."""
    filter_lines = f"(trap '' TERM USR1 INT; exec awk -v to=\"$SLURM_MESSAGES\" '{STDERR_FILTER}') <\"$lines\" &"
    return [
        "step_started=0",
        'if [ "$terminated" = 0 ] && [ "$requeue" = 0 ]; then',
        "    step_started=1",
        "    filter_pid=",
        '    if lines="$(mktemp -u "${TMPDIR:-/tmp}/trainctl-step-$SLURM_JOB_ID.XXXXXX")" \\',
        '            && mkfifo -m 600 "$lines"; then',
        f"        {filter_lines}",
        "        filter_pid=$!",
        "    else",
        "        lines=/dev/stderr  # no FIFO here: srun's lines go to the log unfiltered",
        "    fi",
        "    " + " \\\n        ".join(_wrap(step)) + ' 2>"$lines" &',
        "    step_pid=$!",
        "    # wait returns early (status > 128) for every trapped signal: wait until srun is really gone. Its",
        "    # stderr is bash's note of a child killed by a signal (KillWait's SIGKILL), not the log's business.",
        '    while :; do wait "$step_pid" 2>/dev/null; rc=$?; kill -0 "$step_pid" 2>/dev/null || break; done',
        '    wait "$step_pid" 2>/dev/null; rc=$?',
        '    while [ -n "$filter_pid" ] && kill -0 "$filter_pid" 2>/dev/null; do wait "$filter_pid" 2>/dev/null; done',
        '    if [ -p "$lines" ]; then rm -f "$lines"; fi',
        '    event step_exit ",\\"exit_code\\":$rc"',
        "else  # the stop (SIGTERM or SIGUSR1) came first: the ranks are not started at all",
        '    event stopped \',"before_first_step":true,"reason":"the stop came before the training step started"\'',
        "    rc=0",
        "fi",
    ]


def exclusion_lines() -> list[str]:
    """At the start of each attempt: the nodes the run's record excludes (trainctl/launch/exclusions.py, which
    also adds those its failures name). An allocation holding one does not train: the job requeues itself and,
    once pending, gets the list as its ExcNodeList (Slurm changes it only on a pending job); so does every
    requeue below."""
    return [
        f"# RUN/{RELATIVE.excluded_nodes}: nodes this run keeps out (with the spec's cluster.exclude)",
        'excluded="$("$PYTHON" -m trainctl.launch.exclusions "$RUN_DIR" 2>/dev/null)"',
        "exclude_next() {  # after scontrol requeue: keep the next attempt off the excluded nodes",
        '    excluded="$("$PYTHON" -m trainctl.launch.exclusions "$RUN_DIR" 2>/dev/null)"',
        '    if [ -n "$excluded" ]; then scontrol update jobid="$SLURM_JOB_ID" ExcNodeList="$excluded"; fi',
        "}",
        'for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do',
        '    case ",$excluded," in *",$node,"*)',
        '        echo "trainctl: node $node is excluded from this run ($RUN_DIR/'
        f'{RELATIVE.excluded_nodes}): requeue without it"',
        '        event excluded_node_allocated ",\\"node\\":\\"$node\\""',
        "        trap '' TERM  # the SIGTERM of our own requeue",
        '        if scontrol requeue "$SLURM_JOB_ID"; then exclude_next; exit 0; fi',
        '        echo "trainctl: scontrol requeue failed; training on $node anyway" >&2;;',
        "    esac",
        "done",
        "",
    ]


def _wrap(words: list[str], width: int = 96) -> list[str]:
    """srun and its options, then the program: lines of at most ~width characters (readability only)."""
    cut = next((i for i, w in enumerate(words) if w in ("bash", '"$PYTHON"')), len(words))
    lines: list[str] = []
    for i, w in enumerate(words):
        if lines and i != cut and len(lines[-1]) + len(w) < width:
            lines[-1] += " " + w
        else:
            lines.append(w)
    return lines


def _comment(text: str) -> str:
    return CONTROL_CHARS.sub(" ", text)

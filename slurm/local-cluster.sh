#!/usr/bin/env bash
# A real, local Slurm test cluster on this one host: slurmctld plus two slurmd daemons acting as
# nodes n1 and n2, each with 8 CPUs and 4 emulated GPUs (copies of /dev/null), Debian's Slurm 22.05.
#
#   slurm/local-cluster.sh up       install (if missing), configure, start, wait until both nodes are idle
#   slurm/local-cluster.sh down     cancel jobs, stop the daemons (packages stay installed)
#   slurm/local-cluster.sh down --purge   ... and delete the state directory
#   slurm/local-cluster.sh status   daemons and sinfo; exit 0 only if everything is up
#
# Needs root; up and down are serialized by a lock, so concurrent callers are safe. Exit codes: 0 ok, 1 the cluster failed (log tails are printed), 2 usage,
# 3 cannot run here (not root, no apt-get, or the packages cannot be installed).
# Environment: TRAINCTL_SLURM_DIR (state, logs; default /var/lib/trainctl-slurm),
# TRAINCTL_SLURM_UP_TIMEOUT (seconds to wait for the nodes; default 45).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STATE_DIR="${TRAINCTL_SLURM_DIR:-/var/lib/trainctl-slurm}"
CONF_DIR=/etc/slurm            # where sbatch/squeue/sinfo look for slurm.conf by default
UP_TIMEOUT="${TRAINCTL_SLURM_UP_TIMEOUT:-45}"
CTLD_PORT=6817
N1_PORT=6818
N2_PORT=6819
NODES=(n1 n2)
PACKAGES=(slurmctld slurmd slurm-client munge)
BINARIES=(slurmctld slurmd sinfo squeue sbatch srun scontrol scancel munged munge unmunge)
MUNGE_PIDFILE=/run/munge/munged.pid
RUN_DIR="$STATE_DIR/run"
LOG_DIR="$STATE_DIR/log"
export PATH="$PATH:/usr/sbin:/sbin"

log() { printf '[local-cluster] %s\n' "$*"; }
warn() { printf '[local-cluster] %s\n' "$*" >&2; }

# Print the last lines of every log that may explain a failure.
log_tails() {
    local f
    for f in "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd-n1.log" "$LOG_DIR/slurmd-n2.log" \
             /var/log/munge/munged.log; do
        if [[ -s "$f" ]]; then
            printf -- '----- last lines of %s -----\n' "$f" >&2
            tail -n 15 "$f" >&2
        fi
    done
}

die() {  # die EXIT_CODE MESSAGE [nolog]
    local code="$1" msg="$2"
    warn "ERROR: $msg"
    if [[ "${3:-}" != nolog ]]; then log_tails; fi
    exit "$code"
}

usage() {
    sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit "${1:-2}"
}

need_root() {
    [[ "$(id -u)" -eq 0 ]] || die 3 "must run as root (it installs packages and starts system daemons)" nolog
}

# ---------------------------------------------------------------- processes

# pid_alive PIDFILE COMM -> prints the pid if the process named in PIDFILE runs and is COMM. A killed
# daemon that is not yet reaped (state Z) still has its comm: it counts as gone.
pid_alive() {
    local pidfile="$1" comm="$2" pid stat
    [[ -r "$pidfile" ]] || return 1
    pid="$(tr -dc '0-9' <"$pidfile")"
    [[ -n "$pid" ]] || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" == "$comm" ]] || return 1
    stat="$(cat "/proc/$pid/stat" 2>/dev/null || true)"
    [[ -n "$stat" && "${stat##*) }" != Z* ]] || return 1
    printf '%s\n' "$pid"
}

ctld_pid() { pid_alive "$RUN_DIR/slurmctld.pid" slurmctld; }
slurmd_pid() { pid_alive "$RUN_DIR/slurmd-$1.pid" slurmd; }
munged_pid() { pid_alive "$MUNGE_PIDFILE" munged; }

# wait_gone PID... : wait up to ~15 s for the processes to exit, then SIGKILL what is left.
wait_gone() {
    local pid i
    for pid in "$@"; do
        for ((i = 0; i < 150; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            warn "pid $pid did not exit; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
}

# ---------------------------------------------------------------- install

install_packages() {
    local b missing=0
    for b in "${BINARIES[@]}"; do
        command -v "$b" >/dev/null 2>&1 || missing=1
    done
    [[ "$missing" -eq 0 ]] && return 0

    command -v apt-get >/dev/null 2>&1 || die 3 "Slurm is not installed and there is no apt-get (Debian/Ubuntu needed)" nolog
    mkdir -p "$LOG_DIR"
    log "installing ${PACKAGES[*]} (apt-get; output in $LOG_DIR/apt.log)"
    # Keep package scripts from trying to start daemons (there is no init system here); we start them.
    local own_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        own_policy=1
    fi
    local rc=0
    {
        if ! apt-cache show slurmctld >/dev/null 2>&1; then
            apt-get update -q
        fi
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" \
            || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
                    --no-install-recommends "${PACKAGES[@]}"; }
    } >"$LOG_DIR/apt.log" 2>&1 || rc=$?
    [[ "$own_policy" -eq 1 ]] && rm -f /usr/sbin/policy-rc.d
    if [[ "$rc" -ne 0 ]]; then
        warn "----- last lines of $LOG_DIR/apt.log -----"
        tail -n 20 "$LOG_DIR/apt.log" >&2
        die 3 "apt-get could not install ${PACKAGES[*]}" nolog
    fi
    for b in "${BINARIES[@]}"; do
        command -v "$b" >/dev/null 2>&1 || die 3 "installed the packages but $b is still missing" nolog
    done
}

# ---------------------------------------------------------------- host names

ensure_hosts() {
    local host="$1" names=() n
    for n in "${NODES[@]}" "$host"; do
        getent hosts "$n" >/dev/null 2>&1 || names+=("$n")
    done
    if [[ "${#names[@]}" -gt 0 ]]; then
        log "adding to /etc/hosts: 127.0.0.1 ${names[*]}"
        printf '127.0.0.1 %s  # trainctl local slurm cluster\n' "${names[*]}" >>/etc/hosts
    fi
}

# run_daemon NAME CMD...: start a self-daemonizing program with no tie to our stdout/stderr (callers
# that capture our output must not wait on daemons); what it prints before detaching goes to a file.
run_daemon() {
    local out="$LOG_DIR/$1.start.out"
    shift
    if ! "$@" </dev/null >"$out" 2>&1 9>&-; then  # 9: the command lock, which a daemon must not keep
        warn "----- $* printed: -----"
        cat "$out" >&2
        die 1 "$* did not start"
    fi
}

# ---------------------------------------------------------------- munge

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    install -d -o munge -g munge -m 0700 /etc/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key

    if munged_pid >/dev/null && munge_works; then
        return 0
    fi
    if ! munged_pid >/dev/null; then
        log "starting munged"
        run_daemon munged runuser -u munge -- munged
        touch "$RUN_DIR/munged.ours"
    fi
    local i
    for ((i = 0; i < 50; i++)); do
        munge_works && return 0
        sleep 0.1
    done
    die 1 "munged runs but 'munge -n | unmunge' fails"
}

# ---------------------------------------------------------------- config

render() {  # render TEMPLATE HOST
    sed -e "s|@HOST@|$2|g" -e "s|@STATE_DIR@|$STATE_DIR|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" \
        -e "s|@N1_PORT@|$N1_PORT|g" -e "s|@N2_PORT@|$N2_PORT|g" "$1"
}

# Emulated GPUs. They must be character devices: for plain empty files slurmd logs "is not a valid
# character or block device" and then sets no CUDA_VISIBLE_DEVICES. A copy of /dev/null (c 1:3) works;
# where mknod is not allowed, a symlink to /dev/null does too.
make_gpu_devices() {
    local n i dev
    for n in "${NODES[@]}"; do
        mkdir -p "$STATE_DIR/spool/$n" "$STATE_DIR/dev/$n"
        for i in 0 1 2 3; do
            dev="$STATE_DIR/dev/$n/gpu$i"
            [[ -c "$dev" ]] && continue
            rm -f "$dev"
            mknod -m 0666 "$dev" c 1 3 2>/dev/null || ln -s /dev/null "$dev"
        done
    done
}

# ---------------------------------------------------------------- slurm daemons

stop_slurm() {
    local pids=() pid n
    if pid="$(ctld_pid)"; then
        pids+=("$pid")
        # Asks slurmctld and every slurmd it knows to save state and exit.
        timeout 10 scontrol shutdown >/dev/null 2>&1 || kill -TERM "$pid" 2>/dev/null || true
    fi
    for n in "${NODES[@]}"; do
        if pid="$(slurmd_pid "$n")"; then
            pids+=("$pid")
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    if [[ "${#pids[@]}" -gt 0 ]]; then
        wait_gone "${pids[@]}"
    fi
    rm -f "$RUN_DIR/started.sha"
}

# wait_pidfile WHAT CHECK...: a daemon writes its pid file some milliseconds after its launcher has
# returned (it forks first, then loads plugins); under load that is long enough for a check to find the
# file missing, or still naming the process a killed cluster left, and call the new daemon dead.
wait_pidfile() {
    local what="$1" i
    shift
    for ((i = 0; i < 100; i++)); do
        "$@" >/dev/null && return 0
        sleep 0.1
    done
    die 1 "$what is not running 10 s after it started (no live process behind its pid file)"
}

start_slurm() {
    local n
    if ! ctld_pid >/dev/null; then
        log "starting slurmctld"
        rm -f "$RUN_DIR/slurmctld.pid"  # a killed cluster's: it must not stand for the new daemon
        run_daemon slurmctld slurmctld
        wait_pidfile slurmctld ctld_pid
    fi
    for n in "${NODES[@]}"; do
        if ! slurmd_pid "$n" >/dev/null; then
            log "starting slurmd -N $n"
            rm -f "$RUN_DIR/slurmd-$n.pid"
            run_daemon "slurmd-$n" slurmd -N "$n"
            wait_pidfile "slurmd -N $n" slurmd_pid "$n"
        fi
    done
}

# node_states -> "n1 idle" / "n2 drained" ... (one line per node)
node_states() {
    sinfo -h -N -o '%N %T' 2>/dev/null | sort -u
}

wait_nodes() {
    local deadline=$((SECONDS + UP_TIMEOUT)) resumed=0 states ok n st
    while true; do
        if ! ctld_pid >/dev/null; then die 1 "slurmctld exited"; fi
        for n in "${NODES[@]}"; do
            slurmd_pid "$n" >/dev/null || die 1 "slurmd -N $n exited"
        done
        states="$(node_states || true)"
        ok=1
        for n in "${NODES[@]}"; do
            st="$(awk -v n="$n" '$1 == n {print $2}' <<<"$states")"
            case "$st" in
                idle | mixed | allocated | completing) ;;
                drained | draining | down | inval | "drained*" | "draining*")
                    ok=0
                    # A node that registered under an earlier config (e.g. before gres was right)
                    # stays drained/down; once its slurmd runs with this config, resume it.
                    if [[ "$resumed" -lt 3 ]]; then
                        log "node $n is $st; resuming it"
                        scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
                        resumed=$((resumed + 1))
                    fi
                    ;;
                *) ok=0 ;;
            esac
        done
        [[ "$ok" -eq 1 ]] && return 0
        if ((SECONDS >= deadline)); then
            warn "node states after ${UP_TIMEOUT}s:"
            printf '%s\n' "$states" >&2
            scontrol show node n1 n2 2>/dev/null | grep -E 'NodeName|State=|Reason=' >&2 || true
            die 1 "nodes n1/n2 did not become idle within ${UP_TIMEOUT}s"
        fi
        sleep 0.3
    done
}

print_status() {  # prints daemons and sinfo; returns 0 if everything is up
    local all=0 pid n
    if pid="$(munged_pid)" && munge_works; then log "munged     running (pid $pid)"; else log "munged     NOT running"; all=1; fi
    if pid="$(ctld_pid)"; then log "slurmctld  running (pid $pid)"; else log "slurmctld  NOT running"; all=1; fi
    for n in "${NODES[@]}"; do
        if pid="$(slurmd_pid "$n")"; then log "slurmd $n  running (pid $pid)"; else log "slurmd $n  NOT running"; all=1; fi
    done
    if [[ "$all" -eq 0 ]]; then
        if ! timeout 10 sinfo -o '%P %a %l %D %T %N %G'; then
            all=1
        else
            local states
            states="$(node_states)"
            for n in "${NODES[@]}"; do
                grep -Eq "^$n (idle|mixed|allocated|completing)\$" <<<"$states" || all=1
            done
        fi
    fi
    return "$all"
}

# ---------------------------------------------------------------- commands

cmd_up() {
    local t0=$SECONDS host
    need_root
    mkdir -p "$RUN_DIR" "$LOG_DIR" "$STATE_DIR/ctld" "$STATE_DIR/spool" "$CONF_DIR"
    install_packages
    host="$(hostname -s)"
    ensure_hosts "$host"
    start_munge

    # Render the config; the daemons are (re)started only if what runs differs from it.
    local new_conf new_gres want_sha
    new_conf="$(render "$SCRIPT_DIR/slurm.conf.in" "$host")"
    new_gres="$(render "$SCRIPT_DIR/gres.conf.in" "$host")"
    want_sha="$(printf '%s\n%s\n' "$new_conf" "$new_gres" | sha256sum | cut -d' ' -f1)"
    local running_sha=""
    [[ -r "$RUN_DIR/started.sha" ]] && running_sha="$(cat "$RUN_DIR/started.sha")"
    local any_running=0 n
    ctld_pid >/dev/null && any_running=1
    for n in "${NODES[@]}"; do slurmd_pid "$n" >/dev/null && any_running=1; done
    local installed
    installed="$(cat "$CONF_DIR/slurm.conf" 2>/dev/null || true)"
    if [[ "$installed" != "$new_conf" || "$(cat "$CONF_DIR/gres.conf" 2>/dev/null || true)" != "$new_gres" ]]; then
        running_sha="changed by hand"  # the daemons may have (re)read a config that is not ours
    fi
    if [[ "$any_running" -eq 1 && "$running_sha" != "$want_sha" ]]; then
        log "daemons run with another configuration; restarting them"
        stop_slurm
    fi
    if [[ "$(cat "$CONF_DIR/slurm.conf" 2>/dev/null || true)" != "$new_conf" ]]; then
        if [[ -s "$CONF_DIR/slurm.conf" ]] && ! grep -q 'trainctl local test cluster' "$CONF_DIR/slurm.conf"; then
            cp "$CONF_DIR/slurm.conf" "$CONF_DIR/slurm.conf.before-trainctl"
            log "saved the existing $CONF_DIR/slurm.conf as slurm.conf.before-trainctl"
        fi
        printf '%s\n' "$new_conf" >"$CONF_DIR/slurm.conf"
        log "wrote $CONF_DIR/slurm.conf"
    fi
    if [[ "$(cat "$CONF_DIR/gres.conf" 2>/dev/null || true)" != "$new_gres" ]]; then
        printf '%s\n' "$new_gres" >"$CONF_DIR/gres.conf"
        log "wrote $CONF_DIR/gres.conf"
    fi
    make_gpu_devices

    start_slurm
    printf '%s\n' "$want_sha" >"$RUN_DIR/started.sha"
    wait_nodes
    print_status || die 1 "the cluster is not fully up"
    log "up in $((SECONDS - t0))s (config /etc/slurm/slurm.conf, state and logs in $STATE_DIR)"
}

cmd_down() {
    local purge=0 pid
    [[ "${1:-}" == "--purge" ]] && purge=1
    need_root
    if ctld_pid >/dev/null; then
        local jobs
        jobs="$(timeout 10 squeue -h -o '%i' 2>/dev/null || true)"
        if [[ -n "$jobs" ]]; then
            log "cancelling jobs: $(tr '\n' ' ' <<<"$jobs")"
            # shellcheck disable=SC2086  # one job id per word
            timeout 10 scancel $jobs 2>/dev/null || true
            local i
            for ((i = 0; i < 100; i++)); do
                [[ -z "$(timeout 5 squeue -h -t R,CG -o '%i' 2>/dev/null || true)" ]] && break
                sleep 0.2
            done
        fi
    fi
    stop_slurm
    # Job step daemons left behind by the slurmd we stopped.
    local stepds
    stepds="$(pgrep -x slurmstepd || true)"
    if [[ -n "$stepds" ]]; then
        # shellcheck disable=SC2086
        kill -TERM $stepds 2>/dev/null || true
        # shellcheck disable=SC2086
        wait_gone $stepds
    fi
    if [[ -e "$RUN_DIR/munged.ours" ]] && pid="$(munged_pid)"; then
        log "stopping munged"
        kill -TERM "$pid" 2>/dev/null || true
        wait_gone "$pid"
    fi
    rm -f "$RUN_DIR/munged.ours"
    if [[ "$purge" -eq 1 ]]; then
        rm -rf "$STATE_DIR"
        log "removed $STATE_DIR"
    fi
    log "down"
}

cmd_status() {
    print_status
}

# up and down change shared daemons and files: one at a time on this host. pytest's workers each set
# the cluster up for their session and may call `up` in the same second; without the lock both start
# munged and one of them fails on munged's socket lock.
serialized() {
    need_root
    mkdir -p "$STATE_DIR"
    exec 9>"$STATE_DIR/.lock"
    flock 9
    "$@"
}

case "${1:-}" in
    up) serialized cmd_up ;;
    down) shift; serialized cmd_down "$@" ;;
    status) cmd_status ;;
    -h | --help | help) usage 0 ;;
    *) usage ;;
esac

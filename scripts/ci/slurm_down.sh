#!/usr/bin/env bash
# Stop the cluster that scripts/ci/slurm_up.sh started: cancel its jobs, stop slurmd and slurmctld, and munged if
# slurm_up.sh started it. Idempotent (nothing running: nothing to do). The directory $LH_SLURM_DIR is removed unless
# LH_SLURM_KEEP=1 (keep the logs for a look).
set -uo pipefail

DIR=${LH_SLURM_DIR:-/tmp/lh-slurm}
export SLURM_CONF="$DIR/slurm.conf"

stop_pidfile() {  # stop_pidfile FILE NAME: TERM, wait up to 10 s, then KILL
    local file=$1 name=$2 pid
    [ -s "$file" ] || return 0
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null && grep -qa "$name" "/proc/$pid/cmdline" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

if [ -f "$SLURM_CONF" ] && [ -s "$DIR/slurmctld.pid" ]; then
    scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    # wait (briefly) for the job steps to end so that slurmd does not leave their processes behind
    for _ in $(seq 50); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
fi
# slurmstepd (one per job step, the parent of the job's processes) runs detached from slurmd and can outlive it.
# This cluster's are the ones writing to its slurmd log; end them and their sessions (the jobs) once slurmd is gone.
our_steps() {
    local fd pid
    for fd in /proc/[0-9]*/fd/*; do
        [ "$(readlink "$fd" 2>/dev/null)" = "$DIR/log/slurmd.log" ] || continue
        pid=${fd#/proc/}; pid=${pid%%/*}
        [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmstepd ] && echo "$pid"
    done | sort -u
}
stop_pidfile "$DIR/slurmd.pid" slurmd
stop_pidfile "$DIR/slurmctld.pid" slurmctld
for pid in $(our_steps); do
    sid=$(ps -o sid= -p "$pid" | tr -d ' ')
    kill -KILL "$pid" 2>/dev/null || true
    [ -n "$sid" ] && pkill -KILL -s "$sid" 2>/dev/null || true
done
if [ -f "$DIR/munged.ours" ]; then
    munged --stop >/dev/null 2>&1 || stop_pidfile /run/munge/munged.pid munged
    rm -f "$DIR/munged.ours"
fi
if [ "${LH_SLURM_KEEP:-0}" != 1 ]; then
    rm -rf "$DIR"
fi
echo "slurm_down: cluster in $DIR stopped" >&2
exit 0

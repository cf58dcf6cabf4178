#!/usr/bin/env bash
# Bring up a private one-node SLURM cluster on this machine (for the engine tests and for trying job scripts).
#
#   scripts/ci/slurm_up.sh            # start munged (if not running), slurmctld and slurmd; wait until the node is idle
#   LH_SLURM_INSTALL=1 scripts/ci/slurm_up.sh   # apt-get install the Debian packages first (root)
#   export SLURM_CONF=/tmp/lh-slurm/slurm.conf   # then srun / sbatch / squeue talk to this cluster
#   scripts/ci/slurm_down.sh          # stop what this script started
#
# Everything of the cluster lives in $LH_SLURM_DIR (default /tmp/lh-slurm): slurm.conf, state, spool, logs, pid files.
# Idempotent: a cluster already up (its node answering) is left as it is. Needs root (slurmd starts jobs as the
# submitting user) and SLURM 22.05-style daemons (Debian bookworm: slurmctld slurmd slurm-client munge).
#
# One node named after this host (`hostname -s`) at 127.0.0.1 with CPUs=8 whatever the machine has (and its real
# memory, so that jobs asking for memory, e.g. submitit's --mem, can be placed):
# SlurmdParameters=config_overrides keeps slurmd from draining a node whose real CPU count is lower. Jobs run as
# plain processes (proctrack/linuxproc, task/none: no cgroups needed, works in containers without systemd) and there
# is no accounting database: `sacct` does not work here (see scripts/ci/bin/sacct for a stand-in).
set -euo pipefail

DIR=${LH_SLURM_DIR:-/tmp/lh-slurm}
NODE=$(hostname -s)
CPUS=${LH_SLURM_CPUS:-8}
MEM_MB=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)  # without RealMemory any --mem request is refused
export SLURM_CONF="$DIR/slurm.conf"

log() { echo "slurm_up: $*" >&2; }

if [ "${LH_SLURM_INSTALL:-0}" = 1 ] && ! command -v slurmctld >/dev/null; then
    log "installing slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi
for tool in munged munge unmunge slurmctld slurmd srun sinfo scontrol; do
    command -v "$tool" >/dev/null || { log "missing $tool (install: apt-get install slurmctld slurmd slurm-client munge, or LH_SLURM_INSTALL=1)"; exit 1; }
done
[ "$(id -u)" = 0 ] || { log "must run as root (slurmd starts the jobs as their user)"; exit 1; }

mkdir -p "$DIR"/{state,spool,log}

node_state() { sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n1; }

# 1. munge: reuse a running munged, else start one as the munge user (the key comes with the package)
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    if [ ! -s /etc/munge/munge.key ]; then
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    runuser -u munge -- munged
    touch "$DIR/munged.ours"  # slurm_down.sh stops munged only if we started it
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || { log "munged did not come up"; exit 1; }
fi

# 2. slurm.conf (rewritten each time; identical content unless the host name or CPU count changed)
cat > "$DIR/slurm.conf.new" <<CONF
# written by scripts/ci/slurm_up.sh: a private one-node cluster
ClusterName=lh
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=batch_sched_delay=0
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
MinJobAge=3600
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
mv "$DIR/slurm.conf.new" "$DIR/slurm.conf"

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# 3. the daemons (no systemd here: started directly; each daemonizes and writes its pid file)
if ! alive "$DIR/slurmctld.pid"; then
    slurmctld -f "$SLURM_CONF" -i   # -i: ignore state left by an earlier cluster in $DIR
fi
if ! alive "$DIR/slurmd.pid"; then
    slurmd -f "$SLURM_CONF" -N "$NODE"
fi

# 4. wait for the node to report idle (about a second)
for _ in $(seq 300); do
    case "$(node_state)" in
        idle*|mixed*|allocated*) log "cluster up: node $NODE $(node_state), SLURM_CONF=$SLURM_CONF"; exit 0 ;;
        down*|drain*) scontrol update nodename="$NODE" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.1
done
log "node $NODE did not become idle (state: $(node_state)); logs in $DIR/log"
tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
exit 1

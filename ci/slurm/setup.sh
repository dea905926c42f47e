#!/usr/bin/env bash
# A single-node Slurm on this machine, for the grid's tests (tests/grid/test_slurm_grid.py) and for trying
# `opalctl grid --executor slurm` on a laptop: Debian's slurm-wlm and munge, a slurm.conf for this host alone,
# a munge key, and munged, slurmctld and slurmd started as root. Idempotent: a second call finds everything
# running, writes nothing and starts nothing. Needs root (CI runs as root). No accounting storage: sacct warns
# that it is off, and submitit carries on without it.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
KEY=/etc/munge/munge.key
HOST="$(hostname -s)"
CPUS="$(nproc)"
# a little under the total, so that slurmd never finds less memory than slurm.conf promises and drains the node
MEMORY_MB="$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.95)}' /proc/meminfo)"

say() { echo "ci/slurm: $*"; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    say "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi

mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge \
         /var/log/munge /etc/munge
if [ ! -s "$KEY" ]; then
    say "creating the munge key"
    dd if=/dev/urandom of="$KEY" bs=1024 count=1 status=none
fi
chown root:root "$KEY" /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 0400 "$KEY"
chmod 0700 /etc/munge /var/log/munge
chmod 0755 /run/munge
chmod 0711 /var/lib/munge

wanted="$(cat <<CONFIG
# written by ci/slurm/setup.sh: one node, this host, everything as root
ClusterName=opalctl-ci
SlurmctldHost=${HOST}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits this long before it starts again (120 s by default): the grid's tests requeue one
AuthInfo=cred_expire=5
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# a requeued job becomes eligible cred_expire + 1 s after its requeue and then waits for a pass of a scheduling loop
# (the main one every 60 s, backfill every 30 s by default): on one node, a pass every second costs nothing
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=300
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=${HOST} CPUs=${CPUS} RealMemory=${MEMORY_MB} State=UNKNOWN
PartitionName=main Nodes=${HOST} Default=YES MaxTime=INFINITE State=UP
CONFIG
)"
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$wanted" ]; then
    say "writing $CONF (${HOST}, ${CPUS} CPUs, ${MEMORY_MB} MB)"
    printf '%s\n' "$wanted" > "$CONF"
    changed=1
else
    changed=0
fi

running() { pgrep -x "$1" >/dev/null; }

# a daemon started before slurm.conf changed reads some settings (cred_expire) only when it starts: restart it,
# by the process id it wrote itself
restart_if_changed() {
    local daemon="$1" pidfile="$2"
    if [ "$changed" = 1 ] && running "$daemon" && [ -s "$pidfile" ]; then
        say "restarting $daemon (slurm.conf changed)"
        kill "$(cat "$pidfile")" 2>/dev/null || true
        for _ in $(seq 1 50); do running "$daemon" || break; sleep 0.2; done
    fi
}

if ! running munged; then
    say "starting munged"
    munged --force
fi
restart_if_changed slurmctld /run/slurmctld.pid
restart_if_changed slurmd /run/slurmd.pid
if ! running slurmctld; then
    say "starting slurmctld"
    slurmctld
fi
if ! running slurmd; then
    say "starting slurmd"
    slurmd
fi

for _ in $(seq 1 60); do
    if sinfo --noheader --nodes="$HOST" --format=%T 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'; then
        say "up: $(sinfo --noheader --format='%P %D %T %c')"
        exit 0
    fi
    state="$(sinfo --noheader --nodes="$HOST" --format=%T 2>/dev/null || true)"
    case "$state" in
        down*|drain*) scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 1
done
say "slurm did not come up; see /var/log/slurm/slurmctld.log and /var/log/slurm/slurmd.log"
exit 1

#!/usr/bin/env bash
# Starts a real one-machine Slurm cluster for the launcher tests: munged, slurmctld and
# SLURM_CI_NODES "pretend" slurmd nodes (n1, n2, ...) that all run on this host.
#
# Usage:  bash .ci/slurm_up.sh        # then: sinfo; python -m pytest tests/test_slurm.py
#         bash .ci/slurm_down.sh      # stops what this started
# Env:    SLURM_CI_NODES (default 2), SLURM_CI_CPUS (CPUs advertised per node, default 2)
#
# Needs root and Debian (installs slurmctld slurmd slurm-client munge with apt-get when
# missing). Idempotent: with the same configuration already up it returns at once; a
# changed configuration restarts the daemons (a node-count change needs `slurmctld -c`).
# docs/slurm-in-ci.md explains each step and the pitfalls it avoids.
set -euo pipefail

NODES=${SLURM_CI_NODES:-2}
CPUS=${SLURM_CI_CPUS:-2}
HOST=$(hostname -s)
CONF=/etc/slurm/slurm.conf
WAIT_S=30

log() { echo "slurm_up: $*"; }

# The process of pid file $1 is a live $2 (exited daemons can linger here as zombies, so
# kill -0 is not enough).
alive() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ -n $pid && -r /proc/$pid/stat ]] || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] || return 1 # not a reused pid
  [[ $(sed 's/.*) //' "/proc/$pid/stat" | cut -d' ' -f1) != Z ]]
}

node_names() {
  local i names=()
  for ((i = 1; i <= NODES; i++)); do names+=("n$i"); done
  echo "${names[*]}"
}

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
  || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  log "installing slurmctld slurmd slurm-client munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

# Pretend nodes resolve to this host; rewrite /etc/hosts in place (it may be a bind mount).
hosts_line="127.0.0.1 $(node_names) # slurm-ci"
if ! grep -qxF "$hosts_line" /etc/hosts; then
  hosts=$(grep -v '# slurm-ci$' /etc/hosts || true)
  printf '%s\n%s\n' "$hosts" "$hosts_line" >/etc/hosts
fi

mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/log/slurm /run/munge
for ((i = 1; i <= NODES; i++)); do mkdir -p "/var/lib/slurm/slurmd/n$i"; done

new_conf=$(
  cat <<EOF
# Written by .ci/slurm_up.sh: $NODES pretend nodes on host $HOST.
ClusterName=ci
SlurmctldHost=$HOST(127.0.0.1)
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=5
MinJobAge=5
EOF
  for ((i = 1; i <= NODES; i++)); do
    echo "NodeName=n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((17000 + i))" \
      "CPUs=$CPUS RealMemory=2000 State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
)

all_up() {
  alive /run/munge/munged.pid munged && alive /run/slurmctld.pid slurmctld || return 1
  local i
  for ((i = 1; i <= NODES; i++)); do alive "/run/slurmd-n$i.pid" slurmd || return 1; done
}

restart=0
if [[ ! -f $CONF || $(cat "$CONF") != "$new_conf" ]]; then
  restart=1
elif ! all_up; then
  restart=1
fi

if ((restart)); then
  if [[ -f $CONF ]]; then bash "$(dirname "$0")/slurm_down.sh" --keep-munge; fi
  printf '%s\n' "$new_conf" >"$CONF"

  if ! alive /run/munge/munged.pid munged; then
    [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key /run/munge
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- munged
  fi
  log "starting slurmctld and $NODES slurmd nodes"
  slurmctld -c -i
  for ((i = 1; i <= NODES; i++)); do slurmd -N "n$i"; done
fi

# Wait until every node is idle (slurmd registered, nothing running).
deadline=$((SECONDS + WAIT_S))
until [[ $(sinfo -h -N -o '%T' 2>/dev/null | grep -cx idle) -eq $NODES ]]; do
  if ((SECONDS >= deadline)); then
    log "nodes not idle after ${WAIT_S}s:"
    sinfo -N 2>&1 || true
    tail -n 20 /var/log/slurm/slurmctld.log 2>/dev/null || true
    exit 1
  fi
  sleep 0.5
done
log "up: $NODES nodes idle ($(node_names)); conf $CONF"

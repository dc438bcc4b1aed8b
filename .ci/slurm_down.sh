#!/usr/bin/env bash
# Stops the one-machine Slurm cluster that .ci/slurm_up.sh started: cancels its jobs, then
# stops every slurmd, slurmctld and munged by the pid in its pid file.
#
# Usage:  bash .ci/slurm_down.sh [--keep-munge]
# Leaves /etc/slurm/slurm.conf, the spool dirs and the /etc/hosts line in place (harmless;
# slurm_up.sh rewrites them). Safe to run when nothing is up.
set -uo pipefail

keep_munge=0
[[ ${1:-} == --keep-munge ]] && keep_munge=1

# The process of pid file $1 is a live $2 (zombies and reused pids are not).
alive() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ -n $pid && -r /proc/$pid/stat ]] || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] || return 1 # not a reused pid
  [[ $(sed 's/.*) //' "/proc/$pid/stat" | cut -d' ' -f1) != Z ]]
}

# stop NAME PIDFILE...: SIGTERM to each live NAME process, wait up to 10 s, then SIGKILL.
stop() {
  local name=$1 f pending=()
  shift
  for f in "$@"; do
    if alive "$f" "$name"; then
      kill "$(cat "$f")" 2>/dev/null && pending+=("$f")
    fi
  done
  local deadline=$((SECONDS + 10))
  for f in "${pending[@]}"; do
    while alive "$f" "$name"; do
      if ((SECONDS >= deadline)); then
        kill -9 "$(cat "$f")" 2>/dev/null
        break
      fi
      sleep 0.2
    done
    rm -f "$f"
  done
}

if alive /run/slurmctld.pid slurmctld && command -v squeue >/dev/null; then
  mapfile -t jobs < <(squeue -h -o %i 2>/dev/null)
  ((${#jobs[@]})) && scancel "${jobs[@]}" 2>/dev/null
fi
shopt -s nullglob
stop slurmd /run/slurmd-*.pid
stop slurmctld /run/slurmctld.pid
((keep_munge)) || stop munged /run/munge/munged.pid
echo "slurm_down: stopped"

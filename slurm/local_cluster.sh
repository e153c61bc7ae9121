#!/bin/bash
# A one-node SLURM cluster on this machine for the tests (root; Debian's packages). Its node
# declares 8 GPUs (GresTypes=gpu; gres.conf names 8 stand-in device files, character devices
# like /dev/null, since SLURM drops a GPU without a file): jobs that ask for GPUs
# (slurm/train.sbatch does) are scheduled, their request shows in the job's TRES and SLURM sets
# SLURM_GPUS_ON_NODE; no GPU is there (training runs on the CPU).
#   slurm/local_cluster.sh up <dir>     install slurm-wlm + munge if missing, start munged,
#                                       slurmctld and slurmd with <dir>/slurm.conf; prints
#                                       SLURM_CONF=<dir>/slurm.conf
#   slurm/local_cluster.sh down <dir>   stop the daemons it started
# Exit 3: SLURM cannot be had here (not root, or the packages do not install).
set -euo pipefail
action=${1:?usage: local_cluster.sh up|down <dir>} dir=${2:?usage: local_cluster.sh up|down <dir>}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
stop() {
    for name in slurmd slurmctld munged; do
        [[ -f "$dir/$name.pid" ]] && kill "$(cat "$dir/$name.pid")" 2>/dev/null || true
    done
    sleep 1
    for name in slurmd slurmctld munged; do
        [[ -f "$dir/$name.pid" ]] && kill -9 "$(cat "$dir/$name.pid")" 2>/dev/null || true
        rm -f "$dir/$name.pid"
    done
}
if [[ "$action" == down ]]; then
    stop
    exit 0
fi
[[ $(id -u) == 0 ]] || { echo "local_cluster: needs root" >&2; exit 3; }
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq slurm-wlm munge; } >"$dir/apt.log" 2>&1 \
        || { echo "local_cluster: apt-get install slurm-wlm munge failed ($dir/apt.log)" >&2; exit 3; }
fi
host=$(hostname -s)
cpus=$(nproc)
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
if [[ ! -f "$dir/munge/munge.key" ]]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "$dir/munge/munge.key"
fi
munged --force --key-file "$dir/munge/munge.key" --socket "$dir/munge/munge.socket" \
    --pid-file "$dir/munged.pid" --log-file "$dir/munged.log" --seed-file "$dir/munge/seed"
base=$(( 16000 + RANDOM % 20000 ))
cat >"$dir/slurm.conf" <<CONF
ClusterName=vlmtest
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldPort=$base
SlurmdPort=$(( base + 1 ))
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=60
MpiDefault=none
GresTypes=gpu
NodeName=$host CPUs=$cpus RealMemory=$mem Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
for i in 0 1 2 3 4 5 6 7; do [[ -e "$dir/gpu$i" ]] || mknod "$dir/gpu$i" c 1 3; done
echo "NodeName=$host Name=gpu File=$dir/gpu[0-7]" >"$dir/gres.conf"
export SLURM_CONF=$dir/slurm.conf
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
        echo "SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 1
done
echo "local_cluster: the node did not come up ($dir/slurmctld.log, $dir/slurmd.log)" >&2
stop
exit 3

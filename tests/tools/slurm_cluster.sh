# Sourced by the Slurm test scripts: a private Slurm cluster of this machine (its own munged,
# slurmctld and one slurmd per node, with their key, configuration, state and logs in a
# temporary folder), started by the script and ended on any exit.
#
# Sourcing it leaves $work (the folder) and $conf (its slurm.conf, exported as SLURM_CONF),
# fail, skip, numbers, checksum, same_run (from mpi_compare.sh), running and stop; it skips
# (77) where the Slurm or munge programs are missing. The script then sets
#   nodes=(NAME...) addrs=(ADDR...)  the nodes and the addresses slurmctld reaches them at
#   ctld_addr                       the address of slurmctld (the first node's, usually)
# and may set, after sourcing,
#   ctld_at=(PREFIX...)             the command prefix that runs a program where slurmctld
#                                   runs (sinfo, srun), each word exec'ing the next
#   node_at I                       a function that sets at=(PREFIX...), the same for node I's
#                                   slurmd
#   cluster_teardown                a function called on exit once the cluster's processes
#                                   have ended
# then calls start_munge and start_slurm. Every wait is bounded.
unset "${!SLURM_@}" "${!PMIX_@}" "${!PMI_@}" "${!OMPI_@}"
work=$(mktemp -d)
# munged wants the folder of its socket searchable by every user; its key folder stays private.
chmod 755 "$work"
conf=$work/slurm.conf
# Exported before any daemon starts: cleanup finds the cluster's processes by it.
export SLURM_CONF=$conf
# Whether any of the processes still runs (a zombie, ended but not yet reaped, does not).
running() {
  local p
  for p; do grep -qs '^State:[[:space:]]*[^Z[:space:]]' "/proc/$p/status" && return 0; done
  return 1
}
# SIGTERM, up to 3 s for the processes to end, then SIGKILL.
stop() {
  kill "$@" 2>/dev/null
  for _ in $(seq 30); do running "$@" || break; sleep 0.1; done
  kill -9 "$@" 2>/dev/null
}
cleanup() {
  # Whatever runs on behalf of this cluster carries its configuration's path in its
  # environment: munged and the daemons (started with it), the steps' slurmstepd (which
  # slurmd starts with its own environment) and their tasks (which inherit srun's, or the
  # batch script's). Nothing else does.
  local pids=() p
  for p in /proc/[0-9]*; do
    [ "${p#/proc/}" != $$ ] && grep -qszxF "SLURM_CONF=$conf" "$p/environ" && pids+=("${p#/proc/}")
  done
  ((${#pids[@]})) && stop "${pids[@]}"
  declare -F cluster_teardown >/dev/null && cluster_teardown
  rm -rf "$work"
}
trap cleanup EXIT
# Ended by a signal, still through the trap (ctest's TIMEOUT kills with SIGKILL instead, which
# nothing traps: the waits are bounded to stay well within it).
trap 'exit 143' TERM
trap 'exit 130' INT
# fail, skip, numbers, checksum, same_run
source "$(dirname "${BASH_SOURCE[0]}")/mpi_compare.sh"

for p in munged munge slurmctld slurmd srun sinfo scontrol; do
  command -v "$p" >/dev/null ||
    skip "$p is not installed (Debian: munge slurmctld slurmd slurm-client)"
done
# The daemons run as this user, root or not: slurmd then starts only this user's tasks.
user=$(id -un) || skip "uid $(id -u) has no user name, which Slurm needs"

# Every program on this machine as it is (one node); exec'ing prefixes keep a daemon's
# process id that of its background job.
ctld_at=()
node_at() { at=(); }

# A TCP port nothing on this machine uses now (from /proc/net/tcp*, in hex). Another cluster
# taking it first makes slurmctld or slurmd fail to start, and the start is tried again.
free_port() {
  local used port
  used=$(awk 'NR > 1 {split($2, a, ":"); print a[2]}' /proc/net/tcp /proc/net/tcp6 2>/dev/null)
  while :; do
    port=$((10000 + RANDOM % 22000))  # below the kernel's ephemeral ports
    grep -qx "$(printf '%04X' "$port")" <<<"$used" || break
  done
  echo "$port"
}

# munged with a key of its own, on its own socket ($munge_sock); a socket in the file system,
# which every network namespace reaches.
start_munge() {
  mkdir -m 700 "$work/munge"
  head -c 1024 /dev/urandom >"$work/munge/munge.key" && chmod 600 "$work/munge/munge.key"
  munge_sock=$work/munge.socket
  munged --key-file="$work/munge/munge.key" --socket="$munge_sock" \
    --pid-file="$work/munge/munged.pid" --seed-file="$work/munge/munged.seed" \
    --log-file="$work/munge/munged.log" >"$work/munge/out" 2>&1 ||
    skip "munged does not start here: $(cat "$work/munge/out")"
  for _ in $(seq 50); do
    timeout 2 munge -n -S "$munge_sock" 2>/dev/null |
      timeout 2 unmunge -S "$munge_sock" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  skip "munged does not answer on its socket: $(tail -3 "$work/munge/munged.log")"
}

# write_conf CTLD_PORT SLURMD_PORT: no cgroups, no accounting, every file in the work folder,
# each node's spool, pid file and log its own (%n: the node's name). A batch job is scheduled
# as soon as it is submitted: by default slurmctld may delay it up to 3 s (batch_sched_delay).
write_conf() {
  local i
  {
    cat <<EOF
ClusterName=conveyor
FirstJobId=$first_job
SlurmctldHost=$(hostname -s)($ctld_addr)
SlurmctldPort=$1
SlurmdPort=$2
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$munge_sock
SlurmUser=$user
SlurmdUser=$user
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool/%n
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.%n.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
SchedulerParameters=batch_sched_delay=0
MpiDefault=$mpi_default
ReturnToService=2
EOF
    for i in "${!nodes[@]}"; do
      echo "NodeName=${nodes[i]} NodeAddr=${addrs[i]} $node_hw State=UNKNOWN"
    done
    echo "PartitionName=conveyor Nodes=$(IFS=,; echo "${nodes[*]}") Default=YES MaxTime=10 State=UP"
  } >"$conf"
}

# Skips (77) where srun offers no pmix plugin or the daemons do not come up; returns when
# sinfo shows every node idle. MpiDefault=pmix.
start_slurm() {
  local i n p started="" deadline ctld slurmds
  # Each node as slurmd finds this machine (CPUs, sockets, cores, threads, memory).
  node_hw=$(slurmd -C 2>/dev/null | sed -n 's/^NodeName=[^ ]* //p')
  [ -n "$node_hw" ] || skip "slurmd -C does not describe this machine: $(slurmd -C 2>&1 | head -3)"
  mkdir -p "$work/state" "$work/log" "$work/pmix"
  for n in "${nodes[@]}"; do mkdir -p "$work/spool/$n"; done
  # Slurm's PMIx plugin makes each step's client folder, spmix_appdir_<uid>_<job>.<step>,
  # under /tmp unless told; every private cluster numbers its jobs from 1, so they would
  # meet there.
  echo "PMIxCliTmpDirBase=$work/pmix" >"$work/mpi.conf"
  # Job numbers of this run's own: OpenMPI names a step's shared-memory files after a hash
  # of its PMIx namespace, slurm.pmix.<job>.<step>, so two private clusters on one machine
  # must not both start at job 1. From this shell's process id, which no other running
  # process has, with room for 15 jobs (15 * the largest pid_max stays below MaxJobId).
  first_job=$(($$ * 15 + 1))

  # srun lists the plugins it has once it has a configuration to read.
  mpi_default=none
  write_conf 6817 6818  # ports unused: srun only reads the file
  timeout 10 srun --mpi=list 2>&1 | grep -qw pmix ||
    skip "srun offers no pmix plugin: $(timeout 10 srun --mpi=list 2>&1 | tr '\n' ' ')"
  mpi_default=pmix

  # The daemons in the foreground of background jobs, so that the trap finds them. A port
  # taken between choosing and binding ends a daemon: choose again.
  for _ in 1 2 3; do
    write_conf "$(free_port)" "$(free_port)"
    "${ctld_at[@]}" slurmctld -D -i -f "$conf" >"$work/log/slurmctld.out" 2>&1 &
    ctld=$!
    slurmds=()
    for i in "${!nodes[@]}"; do
      node_at "$i"
      "${at[@]}" slurmd -D -f "$conf" -N "${nodes[i]}" >"$work/log/slurmd.${nodes[i]}.out" 2>&1 &
      slurmds+=($!)
    done
    deadline=$((SECONDS + 15))
    while ((SECONDS < deadline)); do
      for p in "$ctld" "${slurmds[@]}"; do running "$p" || break 2; done
      [ "$("${ctld_at[@]}" timeout 3 sinfo -h -N -o %T 2>/dev/null | grep -cx idle)" = "${#nodes[@]}" ] &&
        { started=yes; break; }
      sleep 0.2
    done
    [ -n "$started" ] && return 0
    stop "$ctld" "${slurmds[@]}"
    wait "$ctld" "${slurmds[@]}" 2>/dev/null
  done
  skip "slurmctld and slurmd did not start here (last words:" \
    "$(tail -n 1 "$work/log/slurmctld.out")$(for n in "${nodes[@]}"; do
      echo " / $(tail -n 1 "$work/log/slurmd.$n.out")"; done))"
}

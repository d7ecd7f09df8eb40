#!/usr/bin/env bash
# `conveyor train` under a real srun: a private one-node Slurm cluster of this machine (its own
# munged, slurmctld and slurmd, with their key, ports, configuration, state and logs in a
# temporary folder), started here and ended on any exit.
#   slurm_srun.sh CONVEYOR   srun -n 4 --mpi=pmix with --stages 2 --dp 2, and srun -n 2 with the
#                            cluster's default plugin (pmix) and --stages 2: per-step losses
#                            and gradient norms (--log-json) and the final weights' checksum
#                            equal the one-process runs, bit for bit; srun -n 2 --mpi=none (and
#                            --mpi=pmi2) refused with exit status 2, once, naming --mpi=pmix
# Exit status 77 (skipped) with the reason where the Slurm or munge programs are missing, srun
# offers no pmix plugin, or the daemons cannot start here (a container that forbids them).
# Root is not needed. Every wait is bounded, all of them together within ctest's TIMEOUT
# (360 s); a run takes about 5 s.
set -uo pipefail
cli=$1
# A Slurm job or MPI launch around the test must not leak into its own cluster or runs.
unset "${!SLURM_@}" "${!PMIX_@}" "${!PMI_@}" "${!OMPI_@}"
work=$(mktemp -d)
# munged wants the folder of its socket searchable by every user; its key folder stays private.
chmod 755 "$work"
conf=$work/slurm.conf
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
  # environment: the daemons (started with it), the steps' slurmstepd (which slurmd starts
  # with its own environment) and their tasks (which inherit srun's). Nothing else does.
  local pids=() p
  for p in /proc/[0-9]*; do
    [ "${p#/proc/}" != $$ ] && grep -qszxF "SLURM_CONF=$conf" "$p/environ" && pids+=("${p#/proc/}")
  done
  ((${#pids[@]})) && stop "${pids[@]}"
  rm -rf "$work"
}
trap cleanup EXIT
# Ended by a signal, still through the trap (ctest's TIMEOUT kills with SIGKILL instead, which
# nothing traps: the waits below are bounded to stay well within it).
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

# munged with a key of its own, on its own socket.
mkdir -m 700 "$work/munge"
head -c 1024 /dev/urandom >"$work/munge/munge.key" && chmod 600 "$work/munge/munge.key"
munge_sock=$work/munge.socket
munged --key-file="$work/munge/munge.key" --socket="$munge_sock" \
  --pid-file="$work/munge/munged.pid" --seed-file="$work/munge/munged.seed" \
  --log-file="$work/munge/munged.log" >"$work/munge/out" 2>&1 ||
  skip "munged does not start here: $(cat "$work/munge/out")"
for _ in $(seq 50); do
  timeout 2 munge -n -S "$munge_sock" 2>/dev/null |
    timeout 2 unmunge -S "$munge_sock" >/dev/null 2>&1 && break
  sleep 0.1
done
timeout 2 munge -n -S "$munge_sock" | timeout 2 unmunge -S "$munge_sock" >/dev/null 2>&1 ||
  skip "munged does not answer on its socket: $(tail -3 "$work/munge/munged.log")"

host=$(hostname -s)
# The node as slurmd finds it (CPUs, sockets, cores, threads, memory), under this name.
node=$(slurmd -C 2>/dev/null | sed -n 's/^NodeName=[^ ]* //p')
[ -n "$node" ] || skip "slurmd -C does not describe this machine: $(slurmd -C 2>&1 | head -3)"
mkdir -p "$work/state" "$work/spool" "$work/log" "$work/pmix"
# Slurm's PMIx plugin makes each step's client folder, spmix_appdir_<uid>_<job>.<step>, under
# /tmp unless told; every private cluster numbers its jobs from 1, so they would meet there.
echo "PMIxCliTmpDirBase=$work/pmix" >"$work/mpi.conf"
# Job numbers of this run's own: OpenMPI names a step's shared-memory files after a hash
# of its PMIx namespace, slurm.pmix.<job>.<step>, so two private clusters on one machine must
# not both start at job 1. From this shell's process id, which no other running process
# has, with room for the 4 jobs below (15 * the largest pid_max stays below Slurm's MaxJobId).
first_job=$(($$ * 15 + 1))
# write_conf CTLD_PORT SLURMD_PORT: no cgroups, no accounting, every file in the work folder.
write_conf() {
  cat >"$conf" <<EOF
ClusterName=conveyor
FirstJobId=$first_job
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$1
SlurmdPort=$2
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$munge_sock
SlurmUser=$user
SlurmdUser=$user
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
MpiDefault=$mpi_default
ReturnToService=2
NodeName=$host NodeAddr=127.0.0.1 $node State=UNKNOWN
PartitionName=conveyor Nodes=$host Default=YES MaxTime=10 State=UP
EOF
}

# srun lists the plugins it has once it has a configuration to read.
mpi_default=none
write_conf 6817 6818  # ports unused: srun only reads the file
timeout 10 srun --mpi=list 2>&1 | grep -qw pmix ||
  skip "srun offers no pmix plugin: $(timeout 10 srun --mpi=list 2>&1 | tr '\n' ' ')"
mpi_default=pmix

# Both daemons in the foreground of a background job, so that the trap finds them; up when
# the node is idle. A port taken between choosing and binding ends a daemon: choose again.
started=""
for _ in 1 2 3; do
  write_conf "$(free_port)" "$(free_port)"
  slurmctld -D -i -f "$conf" >"$work/log/slurmctld.out" 2>&1 &
  ctld=$!
  slurmd -D -f "$conf" -N "$host" >"$work/log/slurmd.out" 2>&1 &
  slurmd=$!
  deadline=$((SECONDS + 15))
  while ((SECONDS < deadline)) && running "$ctld" && running "$slurmd"; do
    [ "$(timeout 3 sinfo -h -n "$host" -o %T 2>/dev/null)" = idle ] && { started=yes; break; }
    sleep 0.2
  done
  [ -n "$started" ] && break
  stop "$ctld" "$slurmd"
  wait "$ctld" "$slurmd" 2>/dev/null
done
[ -n "$started" ] || skip "slurmctld and slurmd did not start here (last words:" \
  "$(tail -n 1 "$work/log/slurmctld.out") / $(tail -n 1 "$work/log/slurmd.out"))"

common=(train --device cpu --layers 4 --microbatches 4 --batch-tokens 512 --steps 4 --seed 7
        --quiet --weights-checksum --timeout 20)
# Each task notes what srun told it, then becomes conveyor.
note='echo "$SLURM_PROCID ${PMIX_RANK-none} $$" >"$0/task.$SLURM_PROCID"; exec "$@"'
# -O: more tasks than the node has CPUs, when it has fewer than 4.
srun=(timeout 40 srun -O --job-name conveyor --time 2)

timeout 30 "$cli" "${common[@]}" --stages 2 --dp 2 --log-json "$work/one.jsonl" \
  >"$work/one.out" 2>&1 ||
  fail "one-process --stages 2 --dp 2 run failed: $(cat "$work/one.out")"
"${srun[@]}" -n 4 --mpi=pmix bash -c "$note" "$work" \
  "$cli" "${common[@]}" --stages 2 --dp 2 --log-json "$work/srun.jsonl" >"$work/srun.out" 2>&1 ||
  fail "srun -n 4 --mpi=pmix failed: $(cat "$work/srun.out")"
# Four processes of one step, each given its PMIx rank by srun's plugin.
task_pids=""
for r in 0 1 2 3; do
  read -r procid pmix pid <"$work/task.$r" 2>/dev/null || fail "task $r of srun did not run"
  [ "$procid" = "$r" ] && [ "$pmix" = "$r" ] ||
    fail "task $r of srun -n 4 --mpi=pmix: SLURM_PROCID $procid, PMIX_RANK $pmix"
  task_pids+=" $pid"
done
[ "$(tr ' ' '\n' <<<"$task_pids" | sort -u | grep -c .)" = 4 ] ||
  fail "not four processes:$task_pids"
grep -q "transport mpi" "$work/srun.out" || fail "the run did not use MPI: $(cat "$work/srun.out")"
[ "$(numbers "$work/srun.jsonl" | wc -l)" = 4 ] || fail "expected 4 steps in --log-json"
same_run "$work" one srun "of srun -n 4 --mpi=pmix"

# The cluster's default plugin (MpiDefault=pmix), as a plain `srun -n 2` gets it.
timeout 30 "$cli" "${common[@]}" --stages 2 --log-json "$work/one2.jsonl" >"$work/one2.out" 2>&1 ||
  fail "one-process --stages 2 run failed: $(cat "$work/one2.out")"
"${srun[@]}" -n 2 "$cli" "${common[@]}" --stages 2 --log-json "$work/default.jsonl" \
  >"$work/default.out" 2>&1 || fail "srun -n 2 (MpiDefault=pmix) failed: $(cat "$work/default.out")"
grep -q "transport mpi" "$work/default.out" ||
  fail "srun -n 2 did not use MPI: $(cat "$work/default.out")"
same_run "$work" one2 default "of srun -n 2 with the default plugin"

# A step MPI cannot see: refused before MPI_Init, once, by the task srun numbers 0.
refused=""
for plugin in none pmi2; do
  [ "$plugin" = none ] || timeout 10 srun --mpi=list 2>&1 | grep -qw "$plugin" || continue
  "${srun[@]}" -n 2 --mpi=$plugin "$cli" "${common[@]}" --stages 2 >"$work/$plugin.out" 2>&1
  status=$?
  [ "$status" = 2 ] ||
    fail "srun -n 2 --mpi=$plugin: status $status, not 2: $(cat "$work/$plugin.out")"
  said=$(grep -c "^conveyor: error: srun started this process .*give srun --mpi=pmix" \
         "$work/$plugin.out")
  [ "$said" = 1 ] ||
    fail "srun -n 2 --mpi=$plugin is not refused once, naming --mpi=pmix: $(cat "$work/$plugin.out")"
  grep -q "^step \|^done \|weights xxh3" "$work/$plugin.out" &&
    fail "a task of srun --mpi=$plugin trained"
  refused+=" --mpi=$plugin"
done
echo "srun --mpi=pmix (4 tasks, --dp 2) and MpiDefault=pmix (2 tasks): $(checksum "$work/srun.out") and every step equal to the one-process runs; refused:$refused: $(grep "^conveyor: error" "$work/none.out")"

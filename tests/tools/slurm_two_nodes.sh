#!/usr/bin/env bash
# `conveyor train` on a private Slurm cluster of two nodes made of namespaces of this machine:
# each node's slurmd in a network namespace of its own (10.78.0.1/24 and 10.78.0.2/24, joined
# by a veth pair), with a host name (UTS namespace) and a mount namespace of its own;
# slurmctld, and every srun, salloc and sbatch, in the first node's network namespace.
#   slurm_two_nodes.sh CONVEYOR   four jobs of 4 tasks, 2 on each node, each task in its
#                                 node's namespace, more than 512 KiB each way over the veth
#                                 pair; per-step losses and gradient norms (--log-json) and
#                                 the final weights' checksum equal the one-process runs,
#                                 bit for bit:
#     srun -N 2 -n 4 --mpi=pmix          --stages 2 --dp 2 (each replica on a node of its own)
#     salloc -N 2 -n 4 srun -m cyclic    --stages 4 (every pipeline link between the nodes)
#     sbatch -N 2 -n 4, its script srun -m cyclic
#                                        --stages 2 --dp 2 (the replicas' all-reduce within
#                                        each node, each pipeline link between them)
#     salloc -N 2 -n 4 mpirun            --stages 4 (OpenMPI's daemons started by srun)
# Exit status 77 (skipped) with the reason where namespaces cannot be made (not root, no
# CAP_SYS_ADMIN, a container that forbids them), the Slurm or munge programs are missing, srun
# offers no pmix plugin, or the daemons cannot start. Every wait is bounded, all of them
# together within ctest's TIMEOUT (360 s); a run takes about 7 s.
set -uo pipefail
cli=$1
# work, conf, fail, skip, numbers, checksum, same_run, start_munge, start_slurm; the cluster
# ends on any exit, then cluster_teardown removes the namespaces.
source "$(dirname "${BASH_SOURCE[0]}")/slurm_cluster.sh"

# Names of this run's own (a parallel run makes its own), veth names within 15 characters.
# A node's name is its namespace's and its host name.
tag=cvs$$
nodes=("${tag}n0" "${tag}n1") veth=("${tag}v0" "${tag}v1") addrs=(10.78.0.1 10.78.0.2)
ctld_addr=${addrs[0]}
made=()
cluster_teardown() {
  local n
  for n in "${made[@]}"; do ip netns del "$n" 2>/dev/null; done
}
for p in ip nsenter unshare mpirun jq; do
  command -v "$p" >/dev/null || skip "$p is not installed"
done
for i in 0 1; do
  ip netns add "${nodes[i]}" 2>"$work/err" ||
    skip "ip netns add is not permitted here: $(cat "$work/err")"
  made+=("${nodes[i]}")
done
join_namespaces "${nodes[@]}" "${veth[@]}" "${addrs[@]}"

# Programs enter a node's network namespace through nsenter, not `ip netns exec`, which
# mounts a sysfs of that namespace over /sys and so hides /sys/fs/cgroup, without which slurmd
# does not start. The namespaces share one file system, where the PMIx plugin of each node's
# slurmstepd makes the same step folder, spmix_appdir_<uid>_<job>.<step>, under
# PMIxCliTmpDirBase, and the second refuses the step ("File exists"): each node gets a folder
# of its own mounted over $work/pmix in its mount namespace. Each node has a host name of its
# own: OpenMPI names its shared-memory segments (/dev/shm/vader_segment.<host>.<job>.<rank on
# the node>) after it, and under one name the two nodes' ranks 0 met in one segment and
# crashed (SIGSEGV in mca_btl_vader_poll_handle_frag).
ctld_at=(nsenter --net="/var/run/netns/${nodes[0]}")
node_at() {
  at=(nsenter --net="/var/run/netns/${nodes[$1]}" unshare --uts --mount
      sh -c 'hostname "$0" && mount --bind "$1" "$2" && shift 2 && exec "$@"'
      "${nodes[$1]}" "$work/pmix.${nodes[$1]}" "$work/pmix")
}
netns=()
for i in 0 1; do
  mkdir -p "$work/pmix.${nodes[i]}" "$work/pmix"
  node_at "$i"
  "${at[@]}" sh -c 'readlink /proc/self/ns/net; uname -n' >"$work/node.$i" 2>"$work/err" ||
    skip "a node's UTS and mount namespaces cannot be made here: $(cat "$work/err")"
  netns+=("$(head -n 1 "$work/node.$i")")
  [ "$(tail -n 1 "$work/node.$i")" = "${nodes[i]}" ] || fail "node $i is not named ${nodes[i]}"
done

start_munge
start_slurm

common=(train --device cpu --layers 4 --microbatches 4 --batch-tokens 512 --steps 4 --seed 7
        --quiet --weights-checksum --timeout 20)
timeout 30 "$cli" "${common[@]}" --stages 2 --dp 2 --log-json "$work/dp.jsonl" \
  >"$work/dp.out" 2>&1 || fail "one-process --stages 2 --dp 2 run failed: $(cat "$work/dp.out")"
timeout 30 "$cli" "${common[@]}" --stages 4 --log-json "$work/pp.jsonl" \
  >"$work/pp.out" 2>&1 || fail "one-process --stages 4 run failed: $(cat "$work/pp.out")"

# Each task notes its rank (mpirun's, or else srun's), its node as Slurm numbers it, its host
# name and its network namespace, then becomes conveyor.
note='r=${OMPI_COMM_WORLD_RANK-$SLURM_PROCID}
echo "$SLURM_NODEID $(uname -n) $(readlink /proc/self/ns/net)" >"$0.$r"; exec "$@"'
# Bytes the first node's end of the pair has sent and received.
veth_bytes() {
  ip netns exec "${nodes[0]}" cat "/sys/class/net/${veth[0]}/statistics/tx_bytes" \
    "/sys/class/net/${veth[0]}/statistics/rx_bytes" | tr '\n' ' '
}
# Everything from the first node; -O: more tasks than a node has CPUs, when it has fewer
# than 2.
on0=("${ctld_at[@]}" timeout 40)
alloc=(-N 2 -n 4 -O --job-name conveyor --time 2)

# check_run NAME REF "NODE OF RANK 0..3" WHAT "TX RX BEFORE": the tasks of the run NAME ran
# on the nodes given, each in its node's namespaces; it crossed the veth pair; it equals REF.
check_run() {
  local name=$1 ref=$2 what=$4 placed r node host ns tx0 rx0 tx1 rx1 sent got
  read -ra placed <<<"$3"
  read -r tx0 rx0 <<<"$5"
  for r in 0 1 2 3; do
    read -r node host ns <"$work/$name.task.$r" 2>/dev/null || fail "task $r $what did not run"
    [[ $node =~ ^[01]$ ]] && [ "$node" = "${placed[r]}" ] && [ "$host" = "${nodes[node]}" ] &&
      [ "$ns" = "${netns[node]}" ] ||
      fail "task $r $what ran on node $node ($host, $ns), not on node ${placed[r]} (${nodes[placed[r]]}, ${netns[placed[r]]})"
  done
  read -r tx1 rx1 <<<"$(veth_bytes)"
  # At least one pipeline link, or the replicas' all-reduce, crosses the pair both ways:
  # 4 steps x 4 micro-batches of 128 tokens x 64 floats, 512 KiB, or more.
  sent=$((tx1 - tx0)) got=$((rx1 - rx0))
  [ "$sent" -gt 524288 ] && [ "$got" -gt 524288 ] ||
    fail "$sent bytes sent and $got received over the veth pair $what: the nodes did not talk over it"
  grep -q "transport mpi" "$work/$name.out" || fail "$what did not use MPI: $(cat "$work/$name.out")"
  [ "$(numbers "$work/$name.jsonl" | wc -l)" = 4 ] || fail "expected 4 steps in --log-json $what"
  same_run "$work" "$ref" "$name" "$what"
  summary+="$what: $sent bytes out, $got in; "
}
summary=""

bytes=$(veth_bytes)
"${on0[@]}" srun "${alloc[@]}" --mpi=pmix bash -c "$note" "$work/srun.task" \
  "$cli" "${common[@]}" --stages 2 --dp 2 --log-json "$work/srun.jsonl" >"$work/srun.out" 2>&1 ||
  fail "srun -N 2 -n 4 --mpi=pmix failed: $(cat "$work/srun.out")"
check_run srun dp "0 0 1 1" "of srun -N 2 -n 4 --mpi=pmix" "$bytes"

# An allocation, its step with the cluster's default plugin (MpiDefault=pmix).
bytes=$(veth_bytes)
"${on0[@]}" salloc "${alloc[@]}" srun -m cyclic bash -c "$note" "$work/salloc.task" \
  "$cli" "${common[@]}" --stages 4 --log-json "$work/salloc.jsonl" >"$work/salloc.out" 2>&1 ||
  fail "salloc -N 2 -n 4 srun -m cyclic failed: $(cat "$work/salloc.out")"
check_run salloc pp "0 1 0 1" "of salloc -N 2 -n 4 srun -m cyclic" "$bytes"

# A batch job: its script runs on the allocation's first node and starts the step.
cat >"$work/job.sh" <<'JOB'
#!/bin/bash
echo "$(uname -n) $(readlink /proc/self/ns/net)" >"$1"
shift
exec srun "$@"
JOB
bytes=$(veth_bytes)
"${on0[@]}" sbatch --parsable "${alloc[@]}" -o "$work/sbatch.out" "$work/job.sh" \
  "$work/sbatch.where" -m cyclic bash -c "$note" "$work/sbatch.task" \
  "$cli" "${common[@]}" --stages 2 --dp 2 --log-json "$work/sbatch.jsonl" \
  >"$work/sbatch.submit" 2>"$work/sbatch.err" ||
  fail "sbatch -N 2 -n 4 failed: $(cat "$work/sbatch.submit" "$work/sbatch.err")"
job=$(cut -d';' -f1 "$work/sbatch.submit")
# Its end, asked every 0.2 s: sbatch --wait asks after 2 s, then 8 s later, which made the job
# of about 2 s take 10 s one time in three.
state="" deadline=$((SECONDS + 40))
while ((SECONDS < deadline)); do
  state=$("${ctld_at[@]}" timeout 3 scontrol -o show job "$job" 2>/dev/null |
          grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
  case $state in
    COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | PREEMPTED | BOOT_FAIL | DEADLINE | \
      OUT_OF_MEMORY) break ;;
  esac
  sleep 0.2
done
[ "$state" = COMPLETED ] ||
  fail "batch job $job of sbatch -N 2 -n 4 ended ${state:-unseen}: $(cat "$work/sbatch.out")"
[ "$(cat "$work/sbatch.where" 2>/dev/null)" = "${nodes[0]} ${netns[0]}" ] ||
  fail "the batch script did not run on ${nodes[0]} (${netns[0]}): $(cat "$work/sbatch.where")"
check_run sbatch dp "0 1 0 1" "of sbatch -N 2 -n 4, srun -m cyclic" "$bytes"

# OpenMPI's own mpirun inside an allocation: it starts its daemon on each node through srun
# and the ranks through them. The daemon otherwise shares its hwloc topology through a segment
# mapped at a guessed hole of its address space, where OpenMPI 4.1.4's orted crashed in about
# one launch of six on namespaces of one machine (see mpi_netns.sh).
bytes=$(veth_bytes)
"${on0[@]}" salloc "${alloc[@]}" mpirun --allow-run-as-root --bind-to none \
  --mca rtc_hwloc_vmhole none bash -c "$note" "$work/mpirun.task" \
  "$cli" "${common[@]}" --stages 4 --log-json "$work/mpirun.jsonl" >"$work/mpirun.out" 2>&1 ||
  fail "salloc -N 2 -n 4 mpirun failed: $(cat "$work/mpirun.out")"
check_run mpirun pp "0 0 1 1" "of salloc -N 2 -n 4 mpirun" "$bytes"

echo "two nodes (${addrs[*]}), 2 tasks each, $(checksum "$work/srun.out") and $(checksum "$work/salloc.out") equal to the one-process runs; ${summary%; }"

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
# work, conf, fail, skip, numbers, checksum, same_run, start_munge, start_slurm; the cluster
# ends on any exit.
source "$(dirname "${BASH_SOURCE[0]}")/slurm_cluster.sh"

# One node, this machine under its own name, every daemon on the loopback address.
nodes=("$(hostname -s)") addrs=(127.0.0.1) ctld_addr=127.0.0.1
start_munge
start_slurm

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

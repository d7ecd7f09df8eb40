#!/usr/bin/env bash
# `conveyor train` as real MPI processes (OpenMPI's mpirun), against the one-process run.
#   mpi_train.sh CONVEYOR equal N      -np N with --stages N: per-step losses and gradient norms
#                                      (--log-json) and the final weights' checksum equal the
#                                      one-process runs with --stages N and --stages 1, bit for bit;
#                                      rank 0's --trace holds the run's steps and every rank's
#                                      timeline of the last step, gathered, and the bubble is reported,
#                                      the trace drawing the simulated step the bubble comes from
#   mpi_train.sh CONVEYOR mismatch     two ranks, one with another --seed: refused at start,
#                                      naming --seed, by rank 0 alone; so are another
#                                      --bucket-mb, and --stop-after, --save-dir, --log-json or
#                                      --trace on one rank
#   mpi_train.sh CONVEYOR files        an MPMD launch whose two working directories hold another
#                                      --schedule-file (or --data) at the same path: refused at
#                                      start, once, naming the flag; copies at two paths run
#   mpi_train.sh CONVEYOR launch       --transport inproc under -np 3 refused; it, a bad flag, a
#                                      bad partition, --eval-batches past the end of --data
#                                      (before the model is built), -np 3 for 4 ranks and a
#                                      diverging step said once, and a bad
#                                      flag of rank 1 alone said by rank 1; a process with srun --mpi=pmix's environment
#                                      but no PMIx server refused, and one with the environment
#                                      of srun --mpi=none's step (before MPI_Init, which would
#                                      end it); one inside an allocation runs
#   mpi_train.sh CONVEYOR kill         rank 1 killed with SIGKILL mid-run: the job ends non-zero
#                                      within the timeout, and the output names the lost rank
#   mpi_train.sh CONVEYOR term         SIGTERM to rank 1 alone (not from mpirun): both ranks stop
#                                      after the same step, the summary naming no sender
#   mpi_train.sh CONVEYOR stop         rank 1 stopped (SIGSTOP) mid-run, so mpirun sees nothing:
#                                      rank 0's own deadline ends the job, naming rank 1, and
#                                      prints its position marked in the rank x action grid
#   mpi_train.sh CONVEYOR stop_cont    rank 0 stopped (SIGSTOP) for longer than the timeout,
#                                      then continued: rank 1 names rank 0, and rank 0, whose
#                                      deadline passed while it was stopped, does not blame rank 1
#   mpi_train.sh CONVEYOR stop3        as stop with three ranks and rank 2 stopped: rank 1 gives
#                                      up waiting for it and reports its position to rank 0,
#                                      whose grid marks both survivors
#   mpi_train.sh CONVEYOR dp           -np 4 with --stages 2 --dp 2 (rank r: pipeline rank r mod 2
#                                      of replica r div 2): per-step losses, gradient norms and
#                                      final weights equal the one-process --stages 2 --dp 2 run,
#                                      bit for bit, with --shard-optimizer too (a reduce-scatter
#                                      of the gradients), and -np 3 --dp 3, with and without
#                                      --shard-optimizer, equals the one-process unsharded
#                                      --dp 3 run; ranks started
#                                      with another --dp are refused; rank 0's --trace draws
#                                      replica 0's simulated step, as its printed figures are
#   mpi_train.sh CONVEYOR eval         --eval-batches 2 --eval-every 1 under -np 2 --stages 2
#                                      (1f1b and interleaved) and -np 4 --stages 2 --dp 2: rank
#                                      0 alone prints the eval line, and it and the --log-json
#                                      records' hex values (one per step) equal the
#                                      one-process run's, bit for bit;
#                                      so does a run resumed at step 2 by -np 2
#   mpi_train.sh CONVEYOR stop_dp      as stop, for rank 3 of -np 4 --stages 2 --dp 2: the job
#                                      ends within the timeout and a survivor names rank 3
#   mpi_train.sh CONVEYOR eval_stop    rank 1 of -np 2 stops for good as its evaluation starts
#                                      (CONVEYOR_TEST_PAUSE_AT=evaluation): rank 0, inside the
#                                      evaluation, gives up at its deadline naming rank 1; and
#                                      the same with rank 0 stopped and rank 1 waiting
#   mpi_train.sh CONVEYOR eval_kill    as eval_stop, then rank 1 is killed with SIGKILL: the
#                                      job ends non-zero well within the timeout, naming rank 1
#   mpi_train.sh CONVEYOR eval_signal  SIGINT to rank 1 of -np 2 only, in a held-out evaluation
#                                      of hours: both processes stop after the same group of
#                                      batches, say so, and end with status 130, no eval line
#   mpi_train.sh CONVEYOR plan         --partition auto under -np 2 runs rank 0's plan, printed
#                                      once; --plan at a path that holds another plan for each
#                                      process is refused, naming both layouts; copies of one
#                                      plan at two paths run
#   mpi_train.sh CONVEYOR placement    --placement shared under -np 2, where each process holds one
#                                      rank: named in one note line (rank 0's) as doing nothing
#                                      there, and the run's losses, norms and weights those of
#                                      the run without it
#   mpi_train.sh CONVEYOR memory_cap   -np 2 with a --memory-cap that holds each rank but not
#                                      both: runs (each process's allocators hold one rank),
#                                      bit for bit as without the cap, where one process with
#                                      both ranks is refused; a cap below a rank is refused;
#                                      --partition auto plans each rank against that cap and
#                                      runs, where one process with both ranks finds no layout
#   mpi_train.sh CONVEYOR setup_stop   rank 1 of -np 2 stops for good before it makes its model,
#                                      data and transport: rank 0, making the MPI transport,
#                                      gives up at its deadline naming rank 1; rank 0 stopped
#                                      there: rank 1 gives up saying rank 0 did not answer; rank
#                                      1 stopped before the weights checksum, or at the end of
#                                      the run: rank 0 names it
# CI runs as root and with fewer cores than ranks: --allow-run-as-root --oversubscribe.
set -uo pipefail
cli=$1 mode=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
common=(train --device cpu --layers 4 --microbatches 4 --batch-tokens 512 --steps 4
        --quiet --weights-checksum --timeout 20)
# fail, numbers, checksum, same_run, eval_line
source "$(dirname "${BASH_SOURCE[0]}")/mpi_compare.sh"
# Checks a trace's simulated step against the printed figures (simulated_trace_check.py).
simulated_check="$(dirname "${BASH_SOURCE[0]}")/simulated_trace_check.py"

# Signals the last of N ranks ($3, default 2) with $1 two seconds into a run far longer than
# that (exec keeps its pid), with --timeout $2 and the layout flags $4 (default --stages N);
# the job must end non-zero, by itself, within 30 s. Output in $work/out.
signal_last_rank() {
  local start status took n=${3:-2} layout
  read -ra layout <<<"${4:---stages $n}"
  start=$(date +%s)
  timeout 60 "${mpirun[@]}" -np "$n" bash -c \
    'if [ "$OMPI_COMM_WORLD_RANK" = '"$((n - 1))"' ]; then (sleep 1; kill -'"$1"' $$) & fi; exec "$@"' _ \
    "$cli" train --device cpu "${layout[@]}" --microbatches 4 --batch-tokens 512 --steps 1000000 \
    --quiet --timeout "$2" >"$work/out" 2>&1
  status=$?
  took=$(( $(date +%s) - start ))
  [ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "status $status after ${took}s: $(cat "$work/out")"
  [ "$took" -le 30 ] || fail "took ${took}s, more than the $2 s timeout allows"
  ended="status $status after ${took}s"
}

# Rank $3 of two pauses for good at point $4 (default evaluation: as its evaluation starts,
# after two training steps; see CONVEYOR_TEST_PAUSE_AT in tools/training_run.cpp), with
# --timeout $1; with $2 = kill, it is then killed with SIGKILL. The job must end non-zero, by
# itself, within 30 s. Output in $work/out.
pause_rank_at() {
  local start status took pid= paused=$3 point=${4:-evaluation}
  start=$(date +%s)
  timeout 60 "${mpirun[@]}" -np 2 bash -c \
    'if [ "$OMPI_COMM_WORLD_RANK" = '"$paused"' ]; then echo $$ >"'"$work"'/paused.pid"; export CONVEYOR_TEST_PAUSE_AT='"$point"'; fi; exec "$@"' _ \
    "$cli" train --device cpu --stages 2 --layers 4 --microbatches 4 --batch-tokens 512 \
    --steps 2 --quiet --eval-batches 4 --weights-checksum --timeout "$1" \
    >"$work/out" 2>&1 &
  local job=$!
  if [ "$2" = kill ]; then
    for _ in $(seq 200); do
      grep -q "paused at $point" "$work/out" 2>/dev/null && break
      sleep 0.1
    done
    grep -q "paused at $point" "$work/out" || fail "rank $paused did not reach $point: $(cat "$work/out")"
    pid=$(cat "$work/paused.pid")
    kill -KILL "$pid"
  fi
  wait "$job"
  status=$?
  took=$(( $(date +%s) - start ))
  [ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "status $status after ${took}s: $(cat "$work/out")"
  [ "$took" -le 30 ] || fail "took ${took}s, more than the $1 s timeout allows"
  grep -q "paused at $point" "$work/out" || fail "rank $paused did not reach $point: $(cat "$work/out")"
  ended="status $status after ${took}s"
}

case $mode in
  equal)
    n=$3
    "$cli" "${common[@]}" --seed 7 --stages 1 --log-json "$work/one.jsonl" >"$work/one.out" 2>&1 ||
      fail "one-process --stages 1 run failed: $(cat "$work/one.out")"
    "$cli" "${common[@]}" --seed 7 --stages "$n" --transport inproc --log-json "$work/threads.jsonl" \
      >"$work/threads.out" 2>&1 || fail "one-process --stages $n run failed: $(cat "$work/threads.out")"
    timeout 60 "${mpirun[@]}" -np "$n" "$cli" "${common[@]}" --seed 7 --stages "$n" \
      --log-json "$work/mpi.jsonl" --trace "$work/mpi.trace.json" >"$work/mpi.out" 2>&1 ||
      fail "mpirun -np $n failed: $(cat "$work/mpi.out")"
    [ "$(jq '[.traceEvents[] | select(.ph == "X" and (.name | startswith("step ")))] | length' \
      "$work/mpi.trace.json")" = 4 ] || fail "rank 0's --trace does not hold the 4 steps"
    # The last step's forwards, 4 per rank, on every rank's compute row (pid = rank, tid 0).
    [ "$(jq "[.traceEvents[] | select(.ph == \"X\" and .tid == 0 and .pid < $n and
      (.name | startswith(\"F\")))] | length" "$work/mpi.trace.json")" = $((4 * n)) ] ||
      fail "rank 0's --trace does not hold every rank's forwards: $(jq -c '[.traceEvents[] | select(.ph == "X") | [.pid, .tid, .name]]' "$work/mpi.trace.json")"
    grep -q "bubble last step: measured" "$work/mpi.out" || fail "no bubble reported: $(cat "$work/mpi.out")"
    # The simulated step of the printed figures, drawn from the gathered timelines.
    "$simulated_check" --check "$work/mpi.trace.json" "$work/mpi.out" "$n" ||
      fail "rank 0's --trace does not hold the simulated step"
    grep -q "transport mpi" "$work/mpi.out" || fail "the MPI run did not use MPI: $(cat "$work/mpi.out")"
    # Rank 0 alone prints: one summary, not n.
    [ "$(grep -c '^done ' "$work/mpi.out")" = 1 ] || fail "ranks other than 0 printed: $(cat "$work/mpi.out")"
    [ "$(numbers "$work/mpi.jsonl" | wc -l)" = 4 ] || fail "expected 4 steps in --log-json"
    for ref in one threads; do same_run "$work" "$ref" mpi "of mpirun -np $n"; done
    # The step's allocator peak is the largest rank's, wherever that rank runs: each process
    # measures its own, and rank 0 reports them all. Within 10 % of the one-process run's
    # (when a message arrives moves a rank's peak by a buffer or two; rank 0's own peak alone,
    # as rank 0 reported it before, is a tenth of the largest).
    paste <(jq .peak_bytes "$work/threads.jsonl") <(jq .peak_bytes "$work/mpi.jsonl") |
      awk '{ if ($2 < 0.9 * $1 || $2 > 1.1 * $1) exit 1 }' ||
      fail "the steps' peak_bytes under mpirun are not those of the one-process --stages $n run: $(jq -c .peak_bytes "$work/mpi.jsonl" | tr '\n' ' ') against $(jq -c .peak_bytes "$work/threads.jsonl" | tr '\n' ' ')"
    echo "mpirun -np $n: $(numbers "$work/mpi.jsonl" | wc -l) steps and $(checksum "$work/mpi.out") equal to the one-process runs"
    ;;
  dp)
    "$cli" "${common[@]}" --seed 7 --stages 2 --dp 2 --transport inproc \
      --log-json "$work/threads.jsonl" >"$work/threads.out" 2>&1 ||
      fail "one-process --stages 2 --dp 2 run failed: $(cat "$work/threads.out")"
    timeout 60 "${mpirun[@]}" -np 4 "$cli" "${common[@]}" --seed 7 --stages 2 --dp 2 \
      --log-json "$work/mpi.jsonl" --trace "$work/mpi.trace.json" >"$work/mpi.out" 2>&1 ||
      fail "mpirun -np 4 --stages 2 --dp 2 failed: $(cat "$work/mpi.out")"
    # The gathered trace holds every rank of both replicas: the last step's forwards, 2 per
    # rank (each replica has 2 of the 4 micro-batches), on each compute row, the processes
    # named by replica.
    for pid in 0 1 2 3; do
      [ "$(jq "[.traceEvents[] | select(.ph == \"X\" and .tid == 0 and .pid == $pid and
        (.name | startswith(\"F\")))] | length" "$work/mpi.trace.json")" = 2 ] ||
        fail "rank 0's --trace lacks rank $pid's forwards: $(jq -c '[.traceEvents[] | select(.ph == "X") | [.pid, .tid, .name]]' "$work/mpi.trace.json")"
    done
    jq -e '[.traceEvents[] | select(.name == "process_name" and .pid == 2 and
      .args.name == "rank 2 (replica 1, pipeline rank 0)")] | length == 1' \
      "$work/mpi.trace.json" >/dev/null || fail "rank 2's process is not named by its replica"
    grep -q "transport mpi" "$work/mpi.out" || fail "the MPI run did not use MPI: $(cat "$work/mpi.out")"
    grep -q "2 replicas x 2 pipeline ranks" "$work/mpi.out" || fail "no replicas: $(cat "$work/mpi.out")"
    # Replica 0's simulated step, as the printed figures are replica 0's.
    "$simulated_check" --check "$work/mpi.trace.json" "$work/mpi.out" 2 ||
      fail "rank 0's --trace does not hold replica 0's simulated step"
    # Every replica's weights were compared with replica 0's over MPI before the checksum.
    grep -q "^replicas agree: all 2 hold replica 0's weights, bit for bit" "$work/mpi.out" ||
      fail "the replicas' weights were not compared: $(cat "$work/mpi.out")"
    grep -Eq "all-reduce last step: [0-9.]+ ms in all, hidden behind compute: measured" "$work/mpi.out" ||
      fail "no all-reduce report from the gathered timelines: $(cat "$work/mpi.out")"
    [ "$(grep -c '^done ' "$work/mpi.out")" = 1 ] || fail "ranks other than 0 printed: $(cat "$work/mpi.out")"
    [ "$(numbers "$work/mpi.jsonl" | wc -l)" = 4 ] || fail "expected 4 steps in --log-json"
    same_run "$work" threads mpi "of mpirun -np 4 --dp 2"
    # The same schedule with each stage's gradients all-reduced in 3 and 4 buckets: the same
    # bits, since every element is still summed over the replicas in replica order.
    timeout 60 "${mpirun[@]}" -np 4 "$cli" "${common[@]}" --seed 7 --dp 2 \
      --schedule-file "$(dirname "${BASH_SOURCE[0]}")/two_stage_1f1b_dp2_buckets.txt" \
      --log-json "$work/buckets.jsonl" >"$work/buckets.out" 2>&1 ||
      fail "mpirun -np 4 with bucketed all-reduces failed: $(cat "$work/buckets.out")"
    same_run "$work" threads buckets "with the gradients all-reduced in buckets"
    # Buckets from --bucket-mb, a count per stage from its gradient bytes: the same bits.
    timeout 60 "${mpirun[@]}" -np 4 "$cli" "${common[@]}" --seed 7 --stages 2 --dp 2 \
      --bucket-mb 0.01 --log-json "$work/bucket_mb.jsonl" >"$work/bucket_mb.out" 2>&1 ||
      fail "mpirun -np 4 --bucket-mb 0.01 failed: $(cat "$work/bucket_mb.out")"
    grep -Eq "over the replicas in ([2-9]|[1-9][0-9]+),([2-9]|[1-9][0-9]+) bucket" "$work/bucket_mb.out" ||
      fail "--bucket-mb 0.01 did not cut the stages into buckets: $(cat "$work/bucket_mb.out")"
    same_run "$work" threads bucket_mb "with --bucket-mb 0.01"
    # ZeRO-1: the optimizer state sharded over the replicas leaves every bit of the weights.
    timeout 60 "${mpirun[@]}" -np 4 "$cli" "${common[@]}" --seed 7 --stages 2 --dp 2 \
      --shard-optimizer --log-json "$work/shard.jsonl" >"$work/shard.out" 2>&1 ||
      fail "mpirun -np 4 --dp 2 --shard-optimizer failed: $(cat "$work/shard.out")"
    same_run "$work" threads shard "with --shard-optimizer"
    # Three replicas: pieces of uneven length, each rank summing only its own.
    dp3=(train --device cpu --layers 4 --microbatches 6 --batch-tokens 384 --steps 4 --quiet
         --weights-checksum --timeout 20 --seed 7 --stages 1 --dp 3)
    "$cli" "${dp3[@]}" --transport inproc --log-json "$work/threads3.jsonl" >"$work/threads3.out" 2>&1 ||
      fail "one-process --dp 3 run failed: $(cat "$work/threads3.out")"
    timeout 60 "${mpirun[@]}" -np 3 "$cli" "${dp3[@]}" --shard-optimizer \
      --log-json "$work/shard3.jsonl" >"$work/shard3.out" 2>&1 ||
      fail "mpirun -np 3 --dp 3 --shard-optimizer failed: $(cat "$work/shard3.out")"
    same_run "$work" threads3 shard3 "of mpirun -np 3 --dp 3 --shard-optimizer"
    # Unsharded, the MPI sum is a reduce-scatter and a gather of uneven ranges: the same bits.
    timeout 60 "${mpirun[@]}" -np 3 "$cli" "${dp3[@]}" \
      --log-json "$work/mpi3.jsonl" >"$work/mpi3.out" 2>&1 ||
      fail "mpirun -np 3 --dp 3 failed: $(cat "$work/mpi3.out")"
    same_run "$work" threads3 mpi3 "of mpirun -np 3 --dp 3"
    # The configuration hash covers --dp: a launch whose ranks disagree on it stops at start.
    timeout 60 "${mpirun[@]}" -np 2 "$cli" "${common[@]}" --stages 1 --dp 2 : \
      -np 2 "$cli" "${common[@]}" --stages 1 --dp 4 >"$work/mismatch.out" 2>&1
    status=$?
    [ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "status $status: $(cat "$work/mismatch.out")"
    grep -q "disagree on --dp: rank 0 has '2'" "$work/mismatch.out" ||
      fail "the refusal does not name --dp: $(cat "$work/mismatch.out")"
    echo "mpirun -np 4 --stages 2 --dp 2: $(numbers "$work/mpi.jsonl" | wc -l) steps and $(checksum "$work/mpi.out") equal to the one-process run"
    ;;
  eval)
    for layout in "--stages 2" "--stages 2 --schedule interleaved" "--stages 2 --dp 2"; do
      read -ra flags <<<"$layout"
      np=2
      [[ $layout == *"--dp 2"* ]] && np=4
      "$cli" "${common[@]}" --seed 7 "${flags[@]}" --transport inproc --eval-batches 2 \
        --eval-every 1 --log-json "$work/one.jsonl" >"$work/one.out" 2>&1 ||
        fail "one-process $layout run failed: $(cat "$work/one.out")"
      timeout 60 "${mpirun[@]}" -np "$np" "$cli" "${common[@]}" --seed 7 "${flags[@]}" \
        --eval-batches 2 --eval-every 1 --log-json "$work/mpi.jsonl" >"$work/mpi.out" 2>&1 ||
        fail "mpirun -np $np $layout failed: $(cat "$work/mpi.out")"
      grep -q "transport mpi" "$work/mpi.out" || fail "the MPI run did not use MPI: $(cat "$work/mpi.out")"
      want=$(eval_line "$work" one) got=$(eval_line "$work" mpi) || exit 1
      [[ $want == *"over 2 batch(es) (1024 tokens), exactly 0x"* ]] || fail "unexpected eval line: $want"
      [ "$got" = "$want" ] || fail "mpirun -np $np $layout: '$got', one process: '$want'"
      hex() { jq -r 'select(.eval_loss_hex) | .eval_loss_hex' "$1"; }
      [ -n "$(hex "$work/one.jsonl")" ] || fail "no eval record in --log-json"
      [ "$(hex "$work/mpi.jsonl")" = "$(hex "$work/one.jsonl")" ] ||
        fail "--log-json eval records differ for -np $np $layout"
      [ "$(hex "$work/one.jsonl" | wc -l)" -gt 1 ] || fail "no --eval-every records in --log-json"
      same_run "$work" one mpi "of mpirun -np $np $layout"
      echo "mpirun -np $np $layout: $got"
    done
    # A run stopped after step 2 and resumed by mpirun evaluates the tokens the uninterrupted
    # run does, to the bit.
    "$cli" "${common[@]}" --seed 7 --stages 2 --transport inproc --eval-batches 2 \
      >"$work/one.out" 2>&1 || fail "one-process run failed: $(cat "$work/one.out")"
    "$cli" "${common[@]}" --seed 7 --stages 1 --stop-after 2 --save-dir "$work/ckpt" \
      >"$work/first.out" 2>&1 || fail "run to step 2 failed: $(cat "$work/first.out")"
    timeout 60 "${mpirun[@]}" -np 2 "$cli" "${common[@]}" --seed 7 --stages 2 --eval-batches 2 \
      --resume "$work/ckpt" >"$work/resumed.out" 2>&1 ||
      fail "mpirun -np 2 resume failed: $(cat "$work/resumed.out")"
    [ "$(eval_line "$work" resumed)" = "$(eval_line "$work" one)" ] ||
      fail "resumed: '$(eval_line "$work" resumed)', uninterrupted: '$(eval_line "$work" one)'"
    echo "resumed at step 2 under mpirun -np 2: $(eval_line "$work" resumed)"
    ;;
  mismatch)
    timeout 60 "${mpirun[@]}" -np 1 "$cli" "${common[@]}" --stages 2 --seed 7 : \
      -np 1 "$cli" "${common[@]}" --stages 2 --seed 8 >"$work/out" 2>&1
    status=$?
    [ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "status $status: $(cat "$work/out")"
    grep -q "disagree on --seed: rank 0 has '7', rank 1 has '8'" "$work/out" ||
      fail "the refusal does not name --seed: $(cat "$work/out")"
    grep -q "^step \|^done " "$work/out" && fail "a rank trained despite the mismatch"
    # Every rank reaches the refusal; rank 0 alone prints it.
    [ "$(grep -c "conveyor: error" "$work/out")" = 1 ] ||
      fail "the refusal is not printed once: $(cat "$work/out")"
    echo "mismatched --seed refused at start, status $status"
    # Other bucket sizes would give the ranks other all-reduce lists, which never match up.
    # Each size is shown as written, not as %.17g's 0.0010001000000000001.
    timeout 60 "${mpirun[@]}" -np 1 "$cli" "${common[@]}" --stages 1 --dp 2 --bucket-mb 0.0010001 : \
      -np 1 "$cli" "${common[@]}" --stages 1 --dp 2 --bucket-mb 2 >"$work/out" 2>&1
    status=$?
    [ "$status" = 2 ] || fail "--bucket-mb mismatch: status $status: $(cat "$work/out")"
    grep -q "disagree on --bucket-mb: rank 0 has '0.0010001', rank 1 has '2'" "$work/out" ||
      fail "the refusal does not name --bucket-mb: $(cat "$work/out")"
    echo "mismatched --bucket-mb refused at start"
    # Flags that decide which meetings a rank goes to after the last step or around its saves:
    # given to rank 1 alone, it would wait in one that rank 0 never starts. Outputs that rank
    # 0's process alone writes: given to rank 1 alone, no file would be written.
    for extra in "--stop-after 2" "--save-dir $work/saves" "--log-json $work/one.jsonl" \
                 "--trace $work/one.trace"; do
      flag=${extra%% *}
      # shellcheck disable=SC2086
      timeout 60 "${mpirun[@]}" -np 1 "$cli" "${common[@]}" --stages 2 : \
        -np 1 "$cli" "${common[@]}" --stages 2 $extra >"$work/out" 2>&1
      status=$?
      [ "$status" = 2 ] || fail "$flag on rank 1 alone: status $status: $(cat "$work/out")"
      grep -q "conveyor: error: the ranks disagree on $flag: rank 0 has '\(0\|not given\)', rank 1 has '${extra#* }'" \
        "$work/out" || fail "$flag on rank 1 alone is not refused by name: $(cat "$work/out")"
      [ -e "$work/one.jsonl" ] || [ -e "$work/one.trace" ] && fail "$flag of rank 1 alone wrote a file"
    done
    echo "--stop-after, --save-dir, --log-json and --trace of one rank refused at start"
    ;;
  files)
    # One relative path, another file behind it in each process's working directory (an MPMD
    # launch with two --wdir): schedules that would deadlock each other, then two data files.
    mkdir -p "$work/a" "$work/b" "$work/c"
    "$cli" schedule --kind 1f1b -p 2 -m 4 --dump "$work/a/sched.txt" >/dev/null &&
      "$cli" schedule --kind gpipe -p 2 -m 4 --dump "$work/b/sched.txt" >/dev/null ||
      fail "cannot write the schedule files"
    head -c 100000 /dev/urandom >"$work/a/data.bin"
    head -c 100000 /dev/urandom >"$work/b/data.bin"
    for flag in "--schedule-file sched.txt" "--data data.bin"; do
      start=$(date +%s)
      # shellcheck disable=SC2086  # $flag is a flag and its value
      timeout 60 "${mpirun[@]}" -np 1 --wdir "$work/a" "$cli" "${common[@]}" --stages 2 $flag : \
        -np 1 --wdir "$work/b" "$cli" "${common[@]}" --stages 2 $flag >"$work/out" 2>&1
      status=$? took=$(( $(date +%s) - start ))
      [ "$status" = 2 ] || fail "$flag: status $status after ${took}s: $(cat "$work/out")"
      [ "$took" -le 15 ] || fail "$flag: refused only after ${took}s (--timeout 20)"
      grep -Eq "disagree on ${flag%% *}: rank 0 has '[a-z.]+, contents XXH3 [0-9a-f]{16}', rank 1 has '[a-z.]+, contents XXH3 [0-9a-f]{16}'" \
        "$work/out" || fail "the refusal does not name ${flag%% *}: $(cat "$work/out")"
      [ "$(grep -c "conveyor: error" "$work/out")" = 1 ] ||
        fail "the refusal is not printed once: $(cat "$work/out")"
    done
    # Copies of one file at different paths agree: the contents are compared, not the paths.
    cp "$work/a/sched.txt" "$work/c/copy.txt"
    timeout 60 "${mpirun[@]}" -np 1 --wdir "$work/a" "$cli" "${common[@]}" --stages 2 \
      --schedule-file sched.txt : -np 1 --wdir "$work/c" "$cli" "${common[@]}" --stages 2 \
      --schedule-file copy.txt >"$work/out" 2>&1 ||
      fail "copies of one schedule file at two paths were refused: $(cat "$work/out")"
    # A device as the data file: the check must not read it forever, the data source refuses it.
    timeout 60 "${mpirun[@]}" -np 2 "$cli" "${common[@]}" --stages 2 --data /dev/zero \
      >"$work/out" 2>&1
    status=$?
    [ "$status" = 2 ] || fail "--data /dev/zero under -np 2: status $status: $(cat "$work/out")"
    grep -q "data file '/dev/zero' is a character device, not a regular file" "$work/out" ||
      fail "--data /dev/zero under -np 2 not refused by name: $(cat "$work/out")"
    echo "another schedule file or data file at the same path refused at start; copies run"
    ;;
  launch)
    # Threads of one process under a launcher of several: every process would run the job.
    # Each refuses alike, and the refusal is said once.
    timeout 60 "${mpirun[@]}" -np 3 "$cli" "${common[@]}" --stages 3 --transport inproc \
      >"$work/out" 2>&1
    status=$?
    [ "$status" = 2 ] || fail "--transport inproc under -np 3: status $status: $(cat "$work/out")"
    grep -q "transport inproc runs every rank as a thread of one process, but the launcher started 3 processes (OMPI_COMM_WORLD_SIZE=3)" \
      "$work/out" || fail "--transport inproc under -np 3 not refused: $(cat "$work/out")"
    grep -q "^step \|^done " "$work/out" && fail "a rank trained with --transport inproc"
    [ "$(grep -c "conveyor: error" "$work/out")" = 1 ] ||
      fail "--transport inproc's refusal is not said exactly once: $(cat "$work/out")"
    # Usage errors that every process meets alike, before MPI (a flag's value) and after it
    # (a partition the model cannot take), are said once too.
    for bad in "--schedule nope" "--partition 9,9"; do
      # shellcheck disable=SC2086
      timeout 60 "${mpirun[@]}" -np 2 "$cli" "${common[@]}" --stages 2 $bad >"$work/out" 2>&1
      status=$?
      [ "$status" = 2 ] || fail "$bad under -np 2: status $status: $(cat "$work/out")"
      [ "$(grep -c "conveyor: error" "$work/out")" = 1 ] ||
        fail "$bad under -np 2 is not refused exactly once: $(cat "$work/out")"
    done
    # Held-out batches past the end of --data (3000 bytes; 4 steps and 2 held-out batches of 512
    # tokens need 3073): every process, agreeing on the file, meets the refusal alike, and
    # before its model is built (which --memory-cap refuses).
    head -c 3000 /dev/urandom >"$work/data.bin"
    timeout 60 "${mpirun[@]}" -np 2 "$cli" "${common[@]}" --stages 2 --data "$work/data.bin" \
      --eval-batches 2 --memory-cap 10KiB >"$work/out" 2>&1
    status=$?
    [ "$status" = 2 ] || fail "--eval-batches past --data under -np 2: status $status: $(cat "$work/out")"
    grep -q "^conveyor: error: --eval-batches 2 needs 3073 bytes of --data" "$work/out" ||
      fail "--eval-batches past --data under -np 2 not refused first: $(cat "$work/out")"
    [ "$(grep -c "conveyor: error" "$work/out")" = 1 ] ||
      fail "--eval-batches past --data under -np 2 is not refused exactly once: $(cat "$work/out")"
    # A step that diverges does so on every process (its loss and norm are all-reduced).
    timeout 60 "${mpirun[@]}" -np 2 "$cli" "${common[@]}" --stages 2 --lr 1e30 --warmup 0 \
      --clip 0 >"$work/out" 2>&1
    status=$?
    [ "$status" = 1 ] || fail "a diverging run under -np 2: status $status: $(cat "$work/out")"
    [ "$(grep -c "conveyor: error: loss became nan" "$work/out")" = 1 ] ||
      fail "the divergence is not said exactly once: $(cat "$work/out")"
    # A usage error of rank 1 alone (an MPMD launch) is said by rank 1, while rank 0 waits.
    timeout 60 "${mpirun[@]}" -np 1 "$cli" "${common[@]}" --stages 2 : \
      -np 1 "$cli" "${common[@]}" --stages 2 --schedule nope >"$work/out" 2>&1
    status=$?
    [ "$status" = 2 ] || fail "a bad flag of rank 1 alone: status $status: $(cat "$work/out")"
    grep -q "^conveyor: error: .*nope" "$work/out" ||
      fail "a bad flag of rank 1 alone is not said: $(cat "$work/out")"
    # A process count that every rank finds wrong is said once, by rank 0.
    timeout 60 "${mpirun[@]}" -np 3 "$cli" "${common[@]}" --stages 2 --dp 2 >"$work/out" 2>&1
    status=$?
    [ "$status" = 2 ] || fail "-np 3 --stages 2 --dp 2: status $status: $(cat "$work/out")"
    [ "$(grep -c "the run has 4 ranks (2 pipeline ranks x 2 data-parallel replicas) but MPI started 3 processes" "$work/out")" = 1 ] ||
      fail "the wrong process count is not said exactly once: $(cat "$work/out")"
    [ "$(grep -c "conveyor: error" "$work/out")" = 1 ] ||
      fail "other errors beside the refusal: $(cat "$work/out")"
    # srun --mpi=pmix's task variables (Slurm's PMIx plugin sets no PMI_SIZE) with no PMIx
    # server behind them and no srun step around (no SLURM_STEP_ID): OpenMPI starts alone, and
    # the process must refuse rather than train the whole job by itself.
    timeout 60 env PMIX_RANK=1 PMIX_NAMESPACE=slurm.pmix.42.0 SLURM_PROCID=1 SLURM_LOCALID=1 \
      SLURM_NTASKS=2 "$cli" "${common[@]}" --stages 2 >"$work/out" 2>&1
    status=$?
    [ "$status" = 2 ] || fail "a lone srun task: status $status: $(cat "$work/out")"
    grep -q "one of 2 (SLURM_NTASKS=2 with PMIX_RANK=1) but MPI sees 1.*--mpi=pmix" "$work/out" ||
      fail "a lone srun task is not refused: $(cat "$work/out")"
    # A task of an srun step without PMIx (srun --mpi=none; tests/tools/slurm_srun.sh runs the
    # real one): OpenMPI's MPI_Init would end it with status 1 and a text blaming its build, so
    # it is refused before, by the task srun numbers 0; the others end silently.
    step=(SLURM_NODELIST=node1 SLURM_STEP_ID=0 SLURM_STEP_NUM_TASKS=2 SLURM_NTASKS=2 SLURM_LOCALID=0)
    timeout 60 env "${step[@]}" SLURM_PROCID=0 "$cli" "${common[@]}" --stages 2 >"$work/out" 2>&1
    status=$?
    [ "$status" = 2 ] || fail "a task of srun --mpi=none: status $status: $(cat "$work/out")"
    grep -q "^conveyor: error: srun started this process as one of 2 (SLURM_STEP_NUM_TASKS=2) without an MPI plugin (--mpi=none).*give srun --mpi=pmix" \
      "$work/out" || fail "a task of srun --mpi=none is not refused: $(cat "$work/out")"
    timeout 60 env "${step[@]}" SLURM_PROCID=1 "$cli" "${common[@]}" --stages 2 >"$work/out" 2>&1
    status=$?
    [ "$status" = 2 ] && [ ! -s "$work/out" ] ||
      fail "task 1 of srun --mpi=none: status $status, not 2 in silence: $(cat "$work/out")"
    # A plain process inside an sbatch --ntasks 4 allocation is one process of its own.
    timeout 60 env SLURM_NTASKS=4 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_JOB_ID=42 \
      "$cli" "${common[@]}" --stages 2 >"$work/out" 2>&1 ||
      fail "a plain process in an allocation did not run by itself: $(cat "$work/out")"
    echo "--transport inproc under mpirun refused; it, a bad flag, a bad partition, held-out batches past --data and a wrong -np said once; one rank's bad flag said; a lone srun task and a task of srun --mpi=none refused"
    ;;
  kill)
    signal_last_rank KILL 10
    # OpenMPI's mpirun notices the death and ends the other ranks itself, naming the rank.
    grep -Eq "rank 1 .*(signal 9|Killed)|process rank 1" "$work/out" ||
      fail "the lost rank is not named: $(cat "$work/out")"
    # The SIGTERM mpirun sends the survivors is said as the launcher's, not as the user's.
    ! grep -Eq "interrupted (by|at step [0-9]+ of [0-9]+ by) SIGTERM" "$work/out" ||
      fail "a survivor reads as interrupted by the user: $(cat "$work/out")"
    echo "rank 1 killed: job ended with $ended"; cat "$work/out"
    ;;
  term)
    # SIGTERM to rank 1 alone, by this script, not by mpirun: both ranks stop after the same
    # step (status 143), and the summary names the signal and no sender, which the process
    # cannot know (mpirun, a scheduler and kill send the same SIGTERM).
    signal_last_rank TERM 20
    grep -Eq "^stopped at step [0-9]+ of 1000000 by SIGTERM; " "$work/out" ||
      fail "no 'stopped at step N of 1000000 by SIGTERM;': $(cat "$work/out")"
    grep -Eq "Exit code: +143" "$work/out" || fail "no rank ended with 143: $(cat "$work/out")"
    ! grep -q "launcher" "$work/out" || fail "the stop is said as the launcher's: $(cat "$work/out")"
    echo "SIGTERM to rank 1: $(grep '^stopped at step' "$work/out"), job ended with $ended"
    ;;
  stop)
    signal_last_rank STOP 1
    # Stopped in a transfer or before the step's all-reduce, whichever rank 0 waits for.
    grep -Eq "conveyor: error: rank 0.*(nothing arrived from rank 1 within|all-reduce waited 1000 ms for rank\(s\) 1 )" "$work/out" ||
      fail "rank 0 did not name rank 1: $(cat "$work/out")"
    # Under the error, the survivor's position: its row of the grid marked, what it waits on,
    # and the rank it cannot see.
    grep -Eq "^r0: .*>>[A-Z]+[0-9.]+[<>]?[0-9]*<<" "$work/out" ||
      fail "rank 0's position is not marked in the grid: $(cat "$work/out")"
    grep -Eq "^rank 0: (at action [0-9]+ \(R[AG]0\.[0-9]+<1\), waiting for a message from rank 1|past its last action)" \
      "$work/out" || fail "rank 0 does not say what it waits on: $(cat "$work/out")"
    grep -q "^rank(s) 1: held by other processes" "$work/out" ||
      fail "rank 1 is not named as unknown here: $(cat "$work/out")"
    echo "rank 1 stopped: rank 0 gave up, job ended with $ended"
    sed -n '/^conveyor: error: rank 0/,/^rank(s) /p' "$work/out"
    ;;
  stop_cont)
    # Rank 0 stopped (SIGSTOP) for longer than the timeout, then continued: rank 1 gives up
    # naming rank 0, and rank 0, whose own deadline passed while it was stopped, does not
    # blame rank 1 (it says rank 1's error, as aborted). mpirun's kill sequence, once rank 1
    # has ended, continues rank 0 first; the test continues it after 8 s too, should the job
    # still run. Three runs, since rank 0 stops wherever it is: in a transfer (its payload
    # half come), a receive, compute.
    for try in 1 2 3; do
      rm -f "$work/log.jsonl"
      timeout 60 "${mpirun[@]}" -np 2 bash -c \
        'echo $$ >"'"$work"'/rank$OMPI_COMM_WORLD_RANK.pid"; exec "$@"' _ \
        "$cli" train --device cpu --stages 2 --layers 4 --microbatches 4 --batch-tokens 512 \
        --steps 1000000 --quiet --timeout 1 --log-json "$work/log.jsonl" >"$work/out" 2>&1 &
      job=$!
      for _ in $(seq 300); do [ -s "$work/log.jsonl" ] && break; sleep 0.1; done
      [ -s "$work/log.jsonl" ] || fail "no step was logged: $(cat "$work/out")"
      sleep "0.$((RANDOM % 10))"
      kill -STOP "$(cat "$work/rank0.pid")"
      for _ in $(seq 80); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
      kill -CONT "$(cat "$work/rank0.pid")" 2>/dev/null
      wait "$job"
      status=$?
      [ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "run $try: status $status: $(cat "$work/out")"
      grep -Eq "conveyor: error: rank 1[,:].*(nothing arrived from rank 0 |a message from rank 0 |the all-reduce waited 1000 ms for rank\(s\) 0 )" \
        "$work/out" || fail "run $try: rank 1 does not name rank 0: $(cat "$work/out")"
      ! grep -Eq "rank 0: (nothing arrived from rank 1 |a message from rank 1 |[^:]* waited [0-9]+ ms for rank\(s\) 1[ ,]|rank\(s\) 1 did not reach)" \
        "$work/out" || fail "run $try: rank 0, the one stopped, blames rank 1: $(cat "$work/out")"
      echo "run $try: $(grep 'conveyor: error' "$work/out" | tr '\n' ' ')"
    done
    ;;
  stop3)
    signal_last_rank STOP 1 3
    # Rank 1 waits for the stopped rank 2 and gives up, rank 0 is stopped by its abort; rank 1
    # reports its position to rank 0's process, whose grid then marks both survivors.
    block=$(sed -n '/^conveyor: error: rank 0/,/^rank(s) /p' "$work/out")
    [ -n "$block" ] || fail "no error from rank 0: $(cat "$work/out")"
    grep -Eq "^r0: .*>>[A-Z]+[0-9.]+[<>]?[0-9]*<<" <<<"$block" || fail "rank 0's row is not marked: $block"
    grep -Eq "^r1: .*>>[A-Z]+[0-9.]+[<>]?[0-9]*<<" <<<"$block" ||
      fail "rank 1's position did not reach rank 0's grid: $block"
    grep -Eq "^rank 1: .*(waiting for a message from rank 2|past its last action)" <<<"$block" ||
      fail "rank 0's report does not say what rank 1 waits on: $block"
    grep -q "^rank(s) 2: held by other processes" <<<"$block" ||
      fail "the stopped rank 2 is not named as unknown: $block"
    echo "rank 2 stopped: rank 0's error marks rank 0 and rank 1, job ended with $ended"
    echo "$block"
    ;;
  stop_dp)
    signal_last_rank STOP 1 4 "--stages 2 --dp 2"
    # Rank 3 stops wherever it is (a transfer, a gradient sum, the step's all-reduce). A wait
    # names the ranks whose part has not come: rank 3, or a live rank held up by it (rank 2
    # waiting for rank 3's gradient is late to its own gradient sum with rank 0), never all
    # the others by default as a collective's wait did.
    grep -Eq "(for |from )rank(\(s\))? ([0-9], )*3\b" "$work/out" ||
      fail "no survivor named the stopped rank 3: $(cat "$work/out")"
    echo "rank 3 of (2, 2) stopped: job ended with $ended"
    grep "conveyor: error" "$work/out"
    ;;
  eval_stop)
    # Rank 0, the first stage, has sent its activations and waits in the closing sum.
    pause_rank_at 1 stop 1
    grep -Eq "conveyor: error: rank 0: .*rank\(s\) 1 " "$work/out" ||
      fail "rank 0 did not name rank 1: $(cat "$work/out")"
    echo "rank 1 paused at evaluation: rank 0 gave up, job ended with $ended"
    grep "conveyor: error" "$work/out"
    # Rank 1, the last stage, waits for the first activation.
    pause_rank_at 1 stop 0
    grep -Eq "conveyor: error: rank 1: .*from rank 0" "$work/out" ||
      fail "rank 1 did not name rank 0: $(cat "$work/out")"
    echo "rank 0 paused at evaluation: rank 1 gave up, job ended with $ended"
    grep "conveyor: error" "$work/out"
    ;;
  eval_signal)
    start=$(date +%s)
    timeout 60 "${mpirun[@]}" -np 2 bash -c \
      'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then echo $$ >"'"$work"'/rank1.pid"; fi; exec "$@"' _ \
      "$cli" train --device cpu --stages 2 --d-model 8 --hidden 8 --vocab 16 --layers 2 \
      --batch-tokens 64 --microbatches 2 --steps 2 --eval-batches 1000000 --timeout 20 \
      --log-json "$work/eval.jsonl" >"$work/out" 2>&1 &
    job=$!
    # Rank 0 logs step 2 before the evaluation starts.
    for _ in $(seq 300); do
      [ -f "$work/eval.jsonl" ] && [ "$(wc -l <"$work/eval.jsonl")" -ge 2 ] && break
      sleep 0.1
    done
    [ "$(wc -l <"$work/eval.jsonl" 2>/dev/null)" = 2 ] || fail "step 2 was not logged: $(cat "$work/out")"
    sleep 1
    kill -INT "$(cat "$work/rank1.pid")"
    wait "$job"
    status=$?
    took=$(( $(date +%s) - start ))
    [ "$status" -eq 130 ] || fail "status $status after ${took}s, expected 130: $(cat "$work/out")"
    [ "$took" -le 40 ] || fail "took ${took}s"
    grep -q "^interrupted at step 2 of 2 by SIGINT" "$work/out" ||
      fail "no 'interrupted at step 2 of 2': $(cat "$work/out")"
    grep -q "^eval   1000000 held-out batch(es) of 64 tokens, with the weights of step 2$" "$work/out" ||
      fail "the evaluation did not say it started: $(cat "$work/out")"
    ! grep -q "^eval   loss" "$work/out" || fail "an interrupted evaluation printed its loss: $(cat "$work/out")"
    [ "$(wc -l <"$work/eval.jsonl")" = 2 ] || fail "the log holds more than the two steps"
    echo "SIGINT to rank 1 in the evaluation: both stopped, status 130 after ${took}s"
    ;;
  eval_kill)
    pause_rank_at 20 kill 1
    grep -Eq "rank 1 .*(signal 9|Killed)|process rank 1" "$work/out" ||
      fail "the lost rank is not named: $(cat "$work/out")"
    echo "rank 1 killed in evaluation: job ended with $ended"
    ;;
  setup_stop)
    # Rank 0 waits at the making of the MPI transport (MPI_Comm_dup waits for every process).
    pause_rank_at 1 stop 1 setup
    grep -q "conveyor: error: rank 0: rank(s) 1 did not reach the MPI transport's set-up within 1000 ms" \
      "$work/out" || fail "rank 0 did not name rank 1: $(cat "$work/out")"
    echo "rank 1 paused before its set-up: rank 0 gave up, job ended with $ended"
    grep "conveyor: error" "$work/out"
    pause_rank_at 1 stop 0 setup
    grep -q "conveyor: error: rank 1: no word from rank 0 at the MPI transport's set-up within 2000 ms" \
      "$work/out" || fail "rank 1 did not name rank 0: $(cat "$work/out")"
    echo "rank 0 paused before its set-up: rank 1 gave up, job ended with $ended"
    grep "conveyor: error" "$work/out"
    # After training and evaluation, the weights' checksum gathers from every process.
    pause_rank_at 1 stop 1 checksum
    grep -q "conveyor: error: rank 0: rank(s) 1 did not reach the weights checksum within 1000 ms" \
      "$work/out" || fail "rank 0 did not name rank 1: $(cat "$work/out")"
    echo "rank 1 paused before the weights checksum: rank 0 gave up, job ended with $ended"
    # Then both meet once more before MPI_Finalize, which would wait for a hung process.
    pause_rank_at 1 stop 1 end
    grep -q "conveyor: error: rank 0: rank(s) 1 did not reach the end of the run within 1000 ms" \
      "$work/out" || fail "rank 0 did not name rank 1: $(cat "$work/out")"
    echo "rank 1 paused at the end: rank 0 gave up, job ended with $ended"
    ;;
  plan)
    # --partition auto: every process profiles, all run rank 0's plan, which rank 0 prints.
    timeout 60 "${mpirun[@]}" -np 2 "$cli" train --device cpu --stages 2 --partition auto \
      --batch-tokens 1024 --steps 2 --timeout 20 >"$work/auto.out" 2>&1 ||
      fail "mpirun -np 2 --partition auto failed: $(cat "$work/auto.out")"
    [ "$(grep -c '^plan ' "$work/auto.out")" = 1 ] || fail "not one plan line: $(cat "$work/auto.out")"
    [ "$(grep -c '^done ' "$work/auto.out")" = 1 ] || fail "the run did not end once: $(cat "$work/auto.out")"
    echo "mpirun -np 2 --partition auto: $(grep '^plan ' "$work/auto.out")"
    # --plan FILE at one path that holds another plan in each process's folder: refused,
    # naming both layouts.
    mkdir -p "$work/a" "$work/b"
    plan='{"stages": 2, "schedule": "zbh1", "chunks": 1, "microbatches": M, "partition": [1, 1]}'
    echo "${plan/M/4}" >"$work/a/plan.json"
    echo "${plan/M/8}" >"$work/b/plan.json"
    here=$(cd "$(dirname "$cli")" && pwd)/$(basename "$cli")  # --wdir moves relative paths
    timeout 60 "${mpirun[@]}" -np 1 --wdir "$work/a" "$here" train --device cpu --plan plan.json \
      --steps 1 --timeout 20 : -np 1 --wdir "$work/b" "$here" train --device cpu --plan plan.json \
      --steps 1 --timeout 20 >"$work/out" 2>&1
    status=$?
    [ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "status $status: $(cat "$work/out")"
    grep -q "disagree on the layout of --plan (each process reads the file): rank 0 has 'stages=2 schedule=zbh1 chunks=1 microbatches=4 partition=1,1 recompute=none', rank 1 has '.*microbatches=8" \
      "$work/out" || fail "the differing plans are not named: $(cat "$work/out")"
    grep -q "^step \|^done " "$work/out" && fail "a rank trained despite the differing plans"
    echo "differing plan files refused at start, status $status"
    # Copies of one plan at two paths: the same layout, so the run goes on.
    cp "$work/a/plan.json" "$work/b/copy.json"
    timeout 60 "${mpirun[@]}" -np 1 --wdir "$work/a" "$here" train --device cpu --plan plan.json \
      --steps 1 --timeout 20 : -np 1 --wdir "$work/b" "$here" train --device cpu --plan copy.json \
      --steps 1 --timeout 20 >"$work/copies.out" 2>&1 ||
      fail "copies of one plan at two paths were refused: $(cat "$work/copies.out")"
    [ "$(grep -c '^done ' "$work/copies.out")" = 1 ] || fail "the run did not end once: $(cat "$work/copies.out")"
    echo "copies of one plan at two paths: the run ends"
    ;;
  placement)
    for run in plain shared; do
      flags=()
      [ "$run" = shared ] && flags=(--placement shared)
      timeout 60 "${mpirun[@]}" -np 2 "$cli" "${common[@]}" --stages 2 "${flags[@]}" \
        --log-json "$work/$run.jsonl" >"$work/$run.out" 2>&1 ||
        fail "mpirun -np 2 ${flags[*]} failed: $(cat "$work/$run.out")"
    done
    note='note   --placement shared puts the ranks of a process on one GPU and does nothing when each process holds one rank (under mpirun or srun)'
    [ "$(grep -cxF -- "$note" "$work/shared.out")" = 1 ] ||
      fail "--placement shared under mpirun is not named once as doing nothing: $(cat "$work/shared.out")"
    [ "$(grep -c -- '--placement' "$work/shared.out")" = 1 ] ||
      fail "another line names --placement: $(cat "$work/shared.out")"
    grep -q -- '--placement' "$work/plain.out" && fail "a run without --placement names it"
    same_run "$work" plain shared "with --placement shared"
    echo "mpirun -np 2 --placement shared: one note, the run without it bit for bit"
    ;;
  memory_cap)
    # These two ranks need about 2.6 MiB each, 5.2 MiB together.
    timeout 60 "$cli" "${common[@]}" --stages 2 --memory-cap 4MiB >"$work/one.out" 2>&1
    status=$?
    [ "$status" = 2 ] && grep -q "on cpu (2 rank(s); .* but the memory limit is 4.0 MiB" "$work/one.out" ||
      fail "one process with both ranks under a 4 MiB cap: status $status: $(cat "$work/one.out")"
    for run in plain capped; do
      flags=()
      [ "$run" = capped ] && flags=(--memory-cap 4MiB)
      timeout 60 "${mpirun[@]}" -np 2 "$cli" "${common[@]}" --stages 2 "${flags[@]}" \
        --log-json "$work/$run.jsonl" >"$work/$run.out" 2>&1 ||
        fail "mpirun -np 2 ${flags[*]} failed: $(cat "$work/$run.out")"
    done
    same_run "$work" plain capped "with --memory-cap 4MiB"
    timeout 60 "${mpirun[@]}" -np 2 "$cli" "${common[@]}" --stages 2 --memory-cap 1MiB \
      >"$work/out" 2>&1
    status=$?
    [ "$status" = 2 ] && grep -q "on cpu (1 rank(s); rank 0: .* but the memory limit is 1.0 MiB" "$work/out" ||
      fail "mpirun -np 2 under a 1 MiB cap: status $status: $(cat "$work/out")"
    echo "mpirun -np 2 --memory-cap 4MiB: each process holds its rank to the cap"
    # --partition auto plans each rank against the whole cap, as the check holds it: under
    # 4 MiB shared by both ranks (2 MiB each) no layout of this model fits, in one process.
    auto=(train --device cpu --stages 2 --memory-cap 4MiB --partition auto --batch-tokens 4096
          --steps 2 --timeout 20)
    timeout 60 "$cli" "${auto[@]}" >"$work/out" 2>&1
    status=$?
    [ "$status" = 2 ] && grep -q "fits 2.0 MiB per rank" "$work/out" ||
      fail "--partition auto with both ranks in one process under 4 MiB: status $status: $(cat "$work/out")"
    timeout 60 "${mpirun[@]}" -np 2 "$cli" "${auto[@]}" >"$work/out" 2>&1 ||
      fail "mpirun -np 2 --partition auto --memory-cap 4MiB failed: $(cat "$work/out")"
    grep -q "^memory cap per rank: 4.0 MiB (the memory limit given, which each process holds for its own rank)$" \
      "$work/out" || fail "the plan's cap is not each process's: $(cat "$work/out")"
    [ "$(grep -c '^done ' "$work/out")" = 1 ] || fail "the run did not end once: $(cat "$work/out")"
    echo "mpirun -np 2 --partition auto --memory-cap 4MiB: $(grep '^plan ' "$work/out")"
    ;;
  *) fail "unknown mode $mode" ;;
esac

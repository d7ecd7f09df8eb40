#!/usr/bin/env bash
# Checkpoints of `conveyor train` run as MPI processes (OpenMPI's mpirun), against the
# one-process run:
#   mpi_checkpoint.sh CONVEYOR save     -np 2 --stages 2 saving every 2 steps, synchronously
#                                       and with --async-save, and -np 4 --stages 2 --dp 2
#                                       --shard-optimizer: every file of every checkpoint is
#                                       byte for byte the one-process run's, and verifies
#   mpi_checkpoint.sh CONVEYOR resume   a checkpoint saved by -np 2 --stages 2 resumes in one
#                                       process at --stages 1, and one saved in one process
#                                       resumes under -np 4 --stages 4: per-step numbers and
#                                       final weights those of the uninterrupted run, bit for bit;
#                                       a flag left out on one process only is refused
#   mpi_checkpoint.sh CONVEYOR interrupt
#                                       SIGINT to rank 1 alone mid-run: both ranks stop after
#                                       the same step, save it, and exit with 130; the
#                                       checkpoint is complete and `latest` names that step;
#                                       so with SIGUSR1 to mpirun itself (status 138)
#   mpi_checkpoint.sh CONVEYOR unshared rank 1 sees another --save-dir than rank 0 (what a
#                                       folder the nodes do not share looks like): both ranks
#                                       end at the first save, non-zero, well within the
#                                       timeout, rank 1 saying why and rank 0 naming rank 1
#   mpi_checkpoint.sh CONVEYOR save_stop
#                                       rank 1 stops for good writing its shard, before the
#                                       shards' sizes are gathered or before an --async-save's
#                                       "every shard written?", or rank 0 committing: the other
#                                       gives up at its deadline, naming the save's exchange it
#                                       waited in
#   mpi_checkpoint.sh CONVEYOR resume_stop
#                                       so for a rank that stops for good in the resume's
#                                       exchanges: the checkpoints compared, their paths
#                                       gathered, the tensors counted
#   mpi_checkpoint.sh CONVEYOR copies   each process resumes from its own copy at one path (what
#                                       each node's own disk looks like): copies of one
#                                       checkpoint resume as the shared folder does, bit for
#                                       bit; a copy of another run's checkpoint at the same step,
#                                       or of another step, is refused once, naming both;
#                                       two steps at two paths are refused naming each path
#   mpi_checkpoint.sh CONVEYOR absent   rank 1's own --resume path names nothing: refused before
#                                       the model is built or the run described
#   mpi_checkpoint.sh CONVEYOR corrupt  a byte of rank 1's shard flipped: under -np 2 only
#                                       rank 1's process reads (and names) that tensor, rank 0
#                                       names rank 1; one process checks every byte itself
set -uo pipefail
cli=$(realpath "$1") mode=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
common=(train --device cpu --layers 4 --microbatches 4 --batch-tokens 512 --seed 7 --quiet
        --weights-checksum --timeout 20)
# fail, numbers, checksum, same_run
source "$(dirname "${BASH_SOURCE[0]}")/mpi_compare.sh"

# same_checkpoints REF GOT: the folders hold the same checkpoints, every file equal.
same_checkpoints() {
  local ref=$1 got=$2 step file
  [ "$(ls "$ref")" = "$(ls "$got")" ] || fail "$got holds $(ls "$got" | tr '\n' ' '), $ref $(ls "$ref" | tr '\n' ' ')"
  for step in "$ref"/step_*; do
    [ "$(ls "$step")" = "$(ls "$got/${step##*/}")" ] || fail "${step##*/} holds other files in $got"
    for file in "$step"/*; do
      cmp -s "$file" "$got/${step##*/}/${file##*/}" || fail "$got/${step##*/}/${file##*/} differs from the one-process run's"
    done
  done
  "$cli" ckpt verify "$got" >"$work/verify.out" 2>&1 || fail "ckpt verify $got: $(cat "$work/verify.out")"
}

# run NAME [mpirun -np N] -- FLAGS: one run into NAME.jsonl and NAME.out.
run() {
  local name=$1; shift
  local launcher=()
  while [ "$1" != "--" ]; do launcher+=("$1"); shift; done
  shift
  timeout 60 "${launcher[@]}" "$cli" "${common[@]}" --steps 4 "$@" --log-json "$work/$name.jsonl" \
    >"$work/$name.out" 2>&1 || fail "run $name failed: $(cat "$work/$name.out")"
}

# waited_in save|resume RANK POINT WHAT START: the run just ended ($status, into $work/out,
# begun at START) had rank RANK stop for good at POINT of a save or resume; it must end with
# an error within 30 s, and the other rank's must say it waited in the exchange WHAT.
waited_in() {
  local kind=$1 rank=$2 point=$3 what=$4 took=$(( $(date +%s) - $5 ))
  [ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "rank $rank paused at $point: status $status: $(cat "$work/out")"
  [ "$took" -le 30 ] || fail "rank $rank paused at $point: took ${took}s"
  grep -q "paused in $kind at $point" "$work/out" || fail "rank $rank did not reach $point: $(cat "$work/out")"
  grep -Fq "rank $((1 - rank)): the all-reduce waited 1500 ms for rank(s) $rank (did rank $rank stop?), in which $what" \
    "$work/out" || fail "rank $((1 - rank)) does not say what it waited in: $(cat "$work/out")"
  echo "rank $rank paused in $kind at $point: $(grep 'conveyor: error' "$work/out")"
}

case $mode in
  save)
    run one -- --stages 2 --save-dir "$work/one" --save-every 2 --transport inproc
    run mpi "${mpirun[@]}" -np 2 -- --stages 2 --save-dir "$work/mpi" --save-every 2
    grep -q "transport mpi" "$work/mpi.out" || fail "the MPI run did not use MPI: $(cat "$work/mpi.out")"
    same_checkpoints "$work/one" "$work/mpi"
    run async "${mpirun[@]}" -np 2 -- --stages 2 --save-dir "$work/async" --save-every 2 --async-save
    same_checkpoints "$work/one" "$work/async"
    run one_dp -- --stages 2 --dp 2 --shard-optimizer --save-dir "$work/one_dp" --save-every 2 \
      --transport inproc
    run mpi_dp "${mpirun[@]}" -np 4 -- --stages 2 --dp 2 --shard-optimizer \
      --save-dir "$work/mpi_dp" --save-every 2
    same_checkpoints "$work/one_dp" "$work/mpi_dp"
    [ "$(ls "$work/mpi_dp/step_4")" = "$(printf '%s\n' manifest.json rank_{0..3}.safetensors)" ] ||
      fail "the sharded checkpoint does not hold a shard per rank: $(ls "$work/mpi_dp/step_4")"
    echo "mpirun saves (sync, async, --dp 2 --shard-optimizer) equal the one-process saves file for file"
    ;;
  resume)
    run full -- --stages 1
    run saved "${mpirun[@]}" -np 2 -- --stages 2 --stop-after 2 --save-dir "$work/by_mpi"
    run resumed -- --stages 1 --resume "$work/by_mpi"
    grep -q "^resume .*step_2 at step 2 (saved with 2 stage(s)" "$work/resumed.out" ||
      fail "no resume line: $(cat "$work/resumed.out")"
    cat "$work/saved.jsonl" "$work/resumed.jsonl" >"$work/joined.jsonl"
    cp "$work/resumed.out" "$work/joined.out"
    same_run "$work" full joined "saved by mpirun -np 2, resumed in one process"
    # --resume alone: every process takes the saved run's settings from its checkpoint.
    timeout 60 "${mpirun[@]}" -np 2 "$cli" train --device cpu --stages 2 --quiet --weights-checksum \
      --timeout 20 --resume "$work/by_mpi" >"$work/inherited.out" 2>&1 ||
      fail "mpirun -np 2 with --resume alone failed: $(cat "$work/inherited.out")"
    [ "$(grep '^weights xxh3' "$work/inherited.out")" = "$(grep '^weights xxh3' "$work/full.out")" ] ||
      fail "mpirun -np 2 with --resume alone: other weights than the uninterrupted run's: $(cat "$work/inherited.out")"
    # A flag left out on one process and given on another, even as the flag's default: that
    # process would take the checkpoint's value (here --lr 0.005) and the other its own.
    run saved_lr -- --stages 1 --stop-after 2 --lr 0.005 --save-dir "$work/by_lr"
    timeout 60 "${mpirun[@]}" -np 2 bash -c \
      'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then exec "$@" --lr 0.003; else exec "$@"; fi' _ \
      "$cli" train --device cpu --stages 2 --quiet --timeout 20 --resume "$work/by_lr" \
      >"$work/left_out.out" 2>&1 && fail "--lr left out on rank 0 only was not refused"
    grep -Fq "the ranks disagree on --lr: rank 0 has 'not given, so --resume takes the checkpoint's', rank 1 has '0.003'" \
      "$work/left_out.out" || fail "--lr left out on rank 0 only: $(cat "$work/left_out.out")"
    run saved1 -- --stages 1 --stop-after 2 --save-dir "$work/by_one"
    run resumed4 "${mpirun[@]}" -np 4 -- --stages 4 --resume "$work/by_one"
    grep -q "^resume .*step_2 at step 2 (saved with 1 stage(s)" "$work/resumed4.out" ||
      fail "no resume line from rank 0: $(cat "$work/resumed4.out")"
    cat "$work/saved1.jsonl" "$work/resumed4.jsonl" >"$work/joined4.jsonl"
    cp "$work/resumed4.out" "$work/joined4.out"
    same_run "$work" full joined4 "saved in one process, resumed by mpirun -np 4"
    echo "resumed across mpirun and one process, 2 -> 1 and 1 -> 4 stages: bitwise the uninterrupted run"
    ;;
  interrupt)
    start=$(date +%s)
    timeout 60 "${mpirun[@]}" -np 2 bash -c \
      'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then (sleep 2; kill -INT $$) & fi; exec "$@"' _ \
      "$cli" "${common[@]}" --stages 2 --steps 1000000 --save-dir "$work/ckpt" \
      --log-json "$work/log.jsonl" >"$work/out" 2>&1
    status=$? took=$(( $(date +%s) - start ))
    [ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "status $status after ${took}s: $(cat "$work/out")"
    [ "$took" -le 20 ] || fail "took ${took}s after one rank was interrupted"
    step=$(sed -n 's/^interrupted at step \([0-9]*\) .* by SIGINT;.*/\1/p' "$work/out")
    [ -n "$step" ] || fail "rank 0 did not stop for rank 1's SIGINT: $(cat "$work/out")"
    [ "$(wc -l <"$work/log.jsonl")" = "$step" ] || fail "the log does not hold the $step finished steps"
    [ "$(cat "$work/ckpt/latest")" = "step_$step" ] ||
      fail "latest names $(cat "$work/ckpt/latest" 2>&1), not step_$step: $(cat "$work/out")"
    "$cli" ckpt verify "$work/ckpt" >"$work/verify.out" 2>&1 || fail "ckpt verify: $(cat "$work/verify.out")"
    grep -Eq "Exit code: +130" "$work/out" || fail "no rank ended with 130 (128 + SIGINT): $(cat "$work/out")"
    echo "SIGINT to rank 1: both ranks stopped after step $step and saved it, status $status in ${took}s"
    # SIGUSR1 to mpirun itself, which passes it on to every process at once (SIGINT, SIGTERM
    # and SIGHUP it turns into an abort that kills the processes a second later).
    rm -rf "$work/ckpt" "$work/log.jsonl"
    "${mpirun[@]}" -np 2 "$cli" "${common[@]}" --stages 2 --steps 1000000 --save-dir "$work/ckpt" \
      --log-json "$work/log.jsonl" >"$work/out" 2>&1 &
    launcher=$!
    for _ in $(seq 1 300); do [ -s "$work/log.jsonl" ] && break; sleep 0.1; done
    kill -USR1 "$launcher"
    wait "$launcher"
    status=$?
    [ "$status" = 138 ] || fail "SIGUSR1 to mpirun: status $status, not 138: $(cat "$work/out")"
    step=$(sed -n 's/^interrupted at step \([0-9]*\) .* by SIGUSR1;.*/\1/p' "$work/out")
    [ -n "$step" ] || fail "the ranks did not stop for SIGUSR1: $(cat "$work/out")"
    [ "$(cat "$work/ckpt/latest")" = "step_$step" ] ||
      fail "latest names $(cat "$work/ckpt/latest" 2>&1), not step_$step: $(cat "$work/out")"
    "$cli" ckpt verify "$work/ckpt" >"$work/verify.out" 2>&1 || fail "ckpt verify: $(cat "$work/verify.out")"
    echo "SIGUSR1 to mpirun: both ranks stopped after step $step and saved it, status 138"
    ;;
  unshared)
    start=$(date +%s)
    timeout 60 "${mpirun[@]}" -np 1 "$cli" "${common[@]}" --steps 4 --stages 2 --save-dir "$work/a" : \
      -np 1 "$cli" "${common[@]}" --steps 4 --stages 2 --save-dir "$work/b" >"$work/out" 2>&1
    status=$? took=$(( $(date +%s) - start ))
    [ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "status $status: $(cat "$work/out")"
    [ "$took" -le 15 ] || fail "took ${took}s: the ranks did not agree on the failure"
    grep -q "is not there; every process must see the same --save-dir" "$work/out" ||
      fail "rank 1 does not say why: $(cat "$work/out")"
    grep -q "the save of step 4 failed in the process of rank 1" "$work/out" ||
      fail "rank 0 does not name rank 1: $(cat "$work/out")"
    [ ! -e "$work/a/latest" ] || fail "a checkpoint was published without rank 1's shard"
    echo "unshared --save-dir: both ranks ended in ${took}s, status $status"
    grep "conveyor: error" "$work/out"
    ;;
  save_stop)
    # A rank that stops for good inside a save: the waiting rank gives up at its deadline and
    # says which exchange of the save it waited in, not only that an all-reduce did. Each case:
    # the rank paused, where, extra flags, and what the other's error says it waited in.
    cases=(
      "1|shard||the processes agree whether writing the shards of step 2 succeeded"
      "0|commit||the processes agree whether the commit of step 2 succeeded"
      "1|sizes||the processes gather the sizes and checksums of the shards of step 2 for the manifest"
      "1|written|--async-save|the processes ask whether every shard of step 2 is written, its save being in the background"
    )
    for case in "${cases[@]}"; do
      IFS='|' read -r rank point flags what <<<"$case"
      rm -rf "$work/ckpt"
      start=$(date +%s)
      # shellcheck disable=SC2086 # $flags: none or one flag
      timeout 60 "${mpirun[@]}" -np 2 bash -c \
        'if [ "$OMPI_COMM_WORLD_RANK" = '"$rank"' ]; then export CONVEYOR_TEST_PAUSE_IN_SAVE='"$point"'; fi; exec "$@"' _ \
        "$cli" train --device cpu --layers 4 --microbatches 4 --batch-tokens 512 --quiet --steps 4 \
        --stages 2 --save-dir "$work/ckpt" --save-every 2 --timeout 1.5 $flags >"$work/out" 2>&1
      status=$?
      waited_in save "$rank" "$point" "$what" "$start"
    done
    ;;
  resume_stop)
    # The same for a rank that stops for good inside a resume, in each of its exchanges: the
    # checkpoints compared, their paths gathered (two steps at two paths differ), the tensors
    # counted. Each case: the rank paused, where, each rank's step to resume, what the other's
    # error says it waited in.
    run saved -- --stages 2 --stop-after 2 --save-dir "$work/ckpt" --save-every 1 --transport inproc
    cases=(
      "1|compare|2 2|the processes compare the checkpoints they opened to resume from (their steps and manifest checksums)"
      "0|compare|2 2|the processes compare the checkpoints they opened to resume from (their steps and manifest checksums)"
      "1|paths|2 1|the processes gather the paths of the checkpoints they opened to resume from, which differ"
      "1|count|2 2|the processes add up the tensors they load from the checkpoint, to compare with the count it holds"
    )
    for case in "${cases[@]}"; do
      IFS='|' read -r rank point steps what <<<"$case"
      start=$(date +%s)
      timeout 60 "${mpirun[@]}" -np 2 bash -c \
        'steps=($1); if [ "$OMPI_COMM_WORLD_RANK" = '"$rank"' ]; then export CONVEYOR_TEST_PAUSE_IN_RESUME='"$point"'; fi
         exec "${@:2}" --resume "$0/step_${steps[$OMPI_COMM_WORLD_RANK]}"' "$work/ckpt" "$steps" \
        "$cli" train --device cpu --layers 4 --microbatches 4 --batch-tokens 512 --quiet --steps 4 \
        --stages 2 --seed 7 --timeout 1.5 >"$work/out" 2>&1
      status=$?
      waited_in resume "$rank" "$point" "$what" "$start"
    done
    ;;
  copies)
    run full "${mpirun[@]}" -np 2 -- --stages 2
    run saved "${mpirun[@]}" -np 2 -- --stages 2 --stop-after 2 --save-dir "$work/ckpt" --save-every 1
    run other "${mpirun[@]}" -np 2 -- --stages 2 --stop-after 2 --save-dir "$work/other" --lr 0.001
    # Each process in a folder of its own, where `ckpt` is its copy.
    in_own_folder=(bash -c 'cd "$0/rank$OMPI_COMM_WORLD_RANK" && exec "$@"' "$work")
    copies() {
      rm -rf "$work/rank0" "$work/rank1" && mkdir "$work/rank0" "$work/rank1"
      cp -a "$1" "$work/rank0/ckpt" && cp -a "$2" "$work/rank1/ckpt"
    }
    copies "$work/ckpt" "$work/ckpt"
    run resumed "${mpirun[@]}" -np 2 "${in_own_folder[@]}" -- --stages 2 --resume ckpt
    cat "$work/saved.jsonl" "$work/resumed.jsonl" >"$work/joined.jsonl"
    cp "$work/resumed.out" "$work/joined.out"
    same_run "$work" full joined "resumed by each process from its own copy"
    for case in "another run's checkpoint at the same step" "another step"; do
      if [ "$case" = "another step" ]; then
        copies "$work/ckpt" "$work/ckpt"
        echo step_1 >"$work/rank1/ckpt/latest"
      else
        copies "$work/ckpt" "$work/other"
      fi
      timeout 60 "${mpirun[@]}" -np 2 "${in_own_folder[@]}" "$cli" "${common[@]}" --steps 4 \
        --stages 2 --resume ckpt >"$work/out" 2>&1
      status=$?
      [ "$status" = 2 ] || fail "$case: status $status: $(cat "$work/out")"
      [ "$(grep -c "conveyor: error: the processes opened different checkpoints at 'ckpt': the process of rank 0 one of step 2 (manifest checksum [0-9a-f]*), that of rank 1 one of step [12] " "$work/out")" = 1 ] ||
        fail "$case is not refused once, naming both: $(cat "$work/out")"
      grep -q "^weights xxh3 " "$work/out" && fail "$case: the run trained on: $(cat "$work/out")"
    done
    # Two steps of one run at two paths: the refusal names each process's path.
    timeout 60 "${mpirun[@]}" -np 2 bash -c \
      'exec "$@" --resume "$0/ckpt/step_$((2 - OMPI_COMM_WORLD_RANK))"' "$work" \
      "$cli" "${common[@]}" --steps 4 --stages 2 >"$work/out" 2>&1
    status=$?
    [ "$status" = 2 ] || fail "two steps at two paths: status $status: $(cat "$work/out")"
    [ "$(grep -c "conveyor: error: the processes opened different checkpoints: the process of rank 0 one of step 2 (manifest checksum [0-9a-f]*) at '$work/ckpt/step_2', that of rank 1 one of step 1 (manifest checksum [0-9a-f]*) at '$work/ckpt/step_1'; " "$work/out")" = 1 ] ||
      fail "two steps at two paths are not refused once, naming each path: $(cat "$work/out")"
    echo "own copies of one checkpoint resume bitwise; copies of two, or two paths, are refused once"
    ;;
  corrupt)
    run saved -- --stages 2 --stop-after 2 --save-dir "$work/ckpt" --transport inproc
    shard="$work/ckpt/step_2/rank_1.safetensors"
    # The last byte of the file: data of the last tensor of stage 1, which rank 1 alone loads.
    python3 -c 'import sys; f = open(sys.argv[1], "r+b"); f.seek(-1, 2); b = f.read(1)[0]; f.seek(-1, 2); f.write(bytes([b ^ 1]))' "$shard" ||
      fail "cannot flip a byte of $shard"
    start=$(date +%s)
    timeout 60 "${mpirun[@]}" -np 2 "$cli" "${common[@]}" --steps 4 --stages 2 --resume "$work/ckpt" \
      >"$work/out" 2>&1
    status=$? took=$(( $(date +%s) - start ))
    [ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "status $status: $(cat "$work/out")"
    [ "$took" -le 20 ] || fail "took ${took}s: the ranks did not agree on the failure"
    grep -q "rank_1.safetensors': checksum mismatch in tensor '" "$work/out" ||
      fail "rank 1 does not name the corrupt tensor: $(cat "$work/out")"
    # Had rank 0 read rank 1's tensors, it would name the tensor too.
    [ "$(grep -c "checksum mismatch" "$work/out")" = 1 ] ||
      fail "a process checked bytes it does not load: $(cat "$work/out")"
    grep -q "opening checkpoint '$work/ckpt' failed in the process of rank 1" "$work/out" ||
      fail "rank 0 does not name rank 1: $(cat "$work/out")"
    # --weights-checksum (in common) prints after the last step: no process got that far.
    grep -q "^weights xxh3 " "$work/out" && fail "the run went on after the failed resume: $(cat "$work/out")"
    timeout 60 "$cli" "${common[@]}" --steps 4 --stages 2 --resume "$work/ckpt" --transport inproc \
      >"$work/one.out" 2>&1 && fail "one process resumed from the corrupt checkpoint"
    grep -q "rank_1.safetensors': checksum mismatch in tensor '" "$work/one.out" ||
      fail "one process does not name the corrupt tensor: $(cat "$work/one.out")"
    echo "a corrupt tensor of rank 1: named by rank 1's process alone under mpirun (rank 0 names rank 1, ${took}s), and by one process"
    grep "conveyor: error" "$work/out"
    ;;
  absent)
    # Rank 1's own --resume names nothing (no copy on its node): it refuses before any process
    # builds its model or describes the run, naming its path.
    run saved -- --stages 2 --stop-after 2 --save-dir "$work/ckpt" --transport inproc
    rm -rf "$work/rank0" "$work/rank1" && mkdir "$work/rank0" "$work/rank1"
    cp -a "$work/ckpt" "$work/rank0/ckpt"
    timeout 60 "${mpirun[@]}" -np 2 bash -c 'cd "$0/rank$OMPI_COMM_WORLD_RANK" && exec "$@"' "$work" \
      "$cli" "${common[@]}" --steps 4 --stages 2 --resume ckpt >"$work/out" 2>&1
    status=$?
    [ "$status" = 2 ] || fail "status $status: $(cat "$work/out")"
    grep -q "^conveyor: error: no checkpoint at 'ckpt': it does not exist; give DIR, DIR/latest or DIR/step_<N>$" \
      "$work/out" || fail "rank 1 does not name its path: $(cat "$work/out")"
    grep -q "^model " "$work/out" && fail "the run was described before the refusal: $(cat "$work/out")"
    echo "rank 1's absent --resume: refused before the run was described"
    grep "conveyor: error" "$work/out"
    ;;
  *) fail "unknown mode $mode" ;;
esac

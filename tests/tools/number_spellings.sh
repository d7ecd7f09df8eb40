#!/usr/bin/env bash
# Every integer and size flag of one subcommand takes plain decimal digits only: each spelling
# of the table below (a sign, spaces, an exponent, hex, a point, a digit group) is refused with
# exit status 2 and the flag's own sentence. Each command line also carries a flag that its
# command refuses once parsing is over, so that a spelling wrongly taken ends there, with
# another sentence, instead of running the command.
# Usage: number_spellings.sh CONVEYOR COMMAND   (COMMAND: train, schedule, plan or ckpt)
set -u
conveyor=$1
command=$2
failures=0

# check PATTERN ARGS...: `conveyor ARGS...` exits 2 and its output matches PATTERN.
check() {
  local pattern=$1
  shift
  local output status
  output=$(timeout 60 "$conveyor" "$@" 2>&1)
  status=$?
  if [ "$status" -ne 2 ] || ! grep -Eq -- "$pattern" <<<"$output"; then
    echo "FAIL: conveyor $* (exit $status, expected 2 and /$pattern/):" >&2
    echo "$output" | tail -3 >&2
    failures=$((failures + 1))
  fi
}

bad_integers=("+1" "+0" "-0" " 1" "1 " "1e3" "0x10" "1.0" "1,000" "1_000" "")

# integers FLAGS... -- TAIL...: every bad spelling for every flag, followed by TAIL. A flag
# written ALIAS=NAME is given as ALIAS, and the error names it NAME.
integers() {
  local flags=() tail=()
  while [ "$1" != "--" ]; do
    flags+=("$1")
    shift
  done
  shift
  tail=("$@")
  for flag in "${flags[@]}"; do
    for value in "${bad_integers[@]}"; do
      check "^conveyor: error: ${flag#*=} expects a whole number in \\[" \
        $command_words "${flag%%=*}" "$value" "${tail[@]}"
    done
  done
}

# The model, batch and memory flags train and plan share (tools/run_flags.cpp).
run_flags=(--d-model --layers --vocab --hidden --batch-tokens --threads)
# Sizes and lists whose numbers are read the same way.
sizes_and_lists() {
  for value in "+1GiB" " 1GiB" "1e3KiB" "0x10" "-0" "1.0.0MiB" "MiB"; do
    check "^conveyor: error: --memory-cap expects a number of bytes" \
      $command_words --memory-cap "$value" "$@"
  done
  for value in "units:+1" "units:1e0" "units: 1" "units:0x1" "units:-0"; do
    check "^conveyor: error: --recompute expects none, stage or units:LIST" \
      $command_words --recompute "$value" "$@"
  done
  for value in "cuda:+0" "cuda:-0" "cuda: 0" "cuda:0x0"; do
    check "^conveyor: error: --device must be auto, cpu, cuda or cuda:N" \
      $command_words --device "$value" "$@"
  done
}

case $command in
  train)
    command_words=train
    integers --steps --microbatches --warmup --seed --log-every --stages --chunks \
      --eval-batches --dp --save-every --keep --stop-after "${run_flags[@]}" \
      -- --transport carrier-pigeon
    sizes_and_lists --transport carrier-pigeon
    for value in "+1,1" "1,+1" "1e0,1" "0x1,1" "1, 1" "1.0,1" "-0,1"; do
      check "^conveyor: error: --partition must be uniform, params, auto or block counts" \
        train --stages 2 --partition "$value" --transport carrier-pigeon
    done
    ;;
  schedule)
    command_words=schedule
    integers --stages -p=--stages --microbatches -m=--microbatches --chunks -v=--chunks --dp \
      -- --kind fastest
    ;;
  plan)
    command_words=plan
    integers --stages --seed --repetitions "${run_flags[@]}" -- --out /nonexistent/plan.json
    sizes_and_lists --out /nonexistent/plan.json
    ;;
  ckpt)
    command_words="ckpt inspect"
    integers --values -- /nonexistent/ckpt
    # demo writes into DIR: a file there refuses it.
    not_a_folder=$(mktemp)
    trap 'rm -f "$not_a_folder"' EXIT
    command_words="ckpt demo"
    integers --step --ranks --seed --keep -- "$not_a_folder"
    ;;
  *)
    echo "unknown command $command" >&2
    exit 1
    ;;
esac

if [ "$failures" -ne 0 ]; then
  echo "number_spellings $command: $failures command line(s) not refused as expected" >&2
  exit 1
fi
echo "number_spellings $command: every spelling refused"

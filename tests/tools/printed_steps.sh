#!/usr/bin/env bash
# Runs `conveyor train` and checks which steps its progress lines ("step     N/TOTAL | ...")
# show: exactly the steps listed, in order.
# Usage: printed_steps.sh "STEP STEP ..." COMMAND [ARGS...]
set -u
want=$1
shift
output=$("$@" 2>&1)
status=$?
echo "$output"
if [ "$status" -ne 0 ]; then
  echo "printed_steps: exit status $status" >&2
  exit 1
fi
got=$(sed -nE 's#^step +([0-9]+)/[0-9]+ \|.*#\1#p' <<<"$output" | paste -sd' ' -)
if [ "$got" != "$want" ]; then
  echo "printed_steps: the progress lines show steps '$got', expected '$want'" >&2
  exit 1
fi
echo "printed_steps: steps $got"

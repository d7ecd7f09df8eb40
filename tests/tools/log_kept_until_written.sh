#!/usr/bin/env bash
# A --log-json file is the run's once the run writes to it: a run refused or interrupted while
# it sets up leaves an old log as it was, and removes one it made.
# Usage: log_kept_until_written.sh CLI WORKDIR
set -u
cli=$1 work=$2
rm -rf "$work" && mkdir -p "$work" || exit 1
fail() { echo "log_kept_until_written: $*" >&2; exit 1; }
old='{"step":7,"loss":1.5}'
refused=(train --device cpu --steps 2 --batch-tokens 64 --microbatches 1 --memory-cap 10KiB)

# Refused after the log was opened (the memory estimate comes with the model).
echo "$old" >"$work/old.jsonl"
"$cli" "${refused[@]}" --log-json "$work/old.jsonl" 2>"$work/err"
status=$?
[ "$status" -eq 2 ] || fail "the refused run exited $status, expected 2: $(cat "$work/err")"
[ "$(cat "$work/old.jsonl")" = "$old" ] || fail "the refused run emptied the old log"
"$cli" "${refused[@]}" --log-json "$work/new.jsonl" 2>/dev/null
[ ! -e "$work/new.jsonl" ] || fail "the refused run left the log it made"
echo "refused: the old log kept, the new one removed"

# Interrupted while it sets up.
for name in old new; do
  [ "$name" = old ] && echo "$old" >"$work/old.jsonl"
  CONVEYOR_TEST_PAUSE_AT=setup "$cli" train --device cpu --steps 2 --batch-tokens 64 \
    --microbatches 1 --log-json "$work/$name.jsonl" >/dev/null 2>"$work/err" &
  run=$!
  for _ in $(seq 1 300); do
    grep -q "paused at setup" "$work/err" && break
    sleep 0.1
  done
  grep -q "paused at setup" "$work/err" || { kill -KILL $run; fail "the run never paused"; }
  kill -INT $run
  wait $run
  status=$?
  [ "$status" -eq 130 ] || fail "the interrupted run exited $status, expected 130"
  if [ "$name" = old ]; then
    [ "$(cat "$work/old.jsonl")" = "$old" ] || fail "the interrupted run emptied the old log"
  else
    [ ! -e "$work/new.jsonl" ] || fail "the interrupted run left the log it made"
  fi
done
echo "interrupted while setting up: the old log kept, the new one removed"

# A run that trains writes its own lines over the old ones.
echo "$old" >"$work/old.jsonl"
"$cli" train --device cpu --steps 2 --batch-tokens 64 --microbatches 1 --quiet \
  --log-json "$work/old.jsonl" >/dev/null 2>&1 || fail "the run failed"
[ "$(wc -l <"$work/old.jsonl")" -eq 2 ] && ! grep -q '"step":7' "$work/old.jsonl" ||
  fail "the run's log is not its two steps: $(cat "$work/old.jsonl")"
echo "trained: the log holds the run's two steps"

#!/usr/bin/env bash
# Sends SIGNAL to a training run once its JSON log has LINES lines, then checks that it ended
# within a few seconds with STATUS, printed "interrupted at step N" and, unless --quiet, the
# progress line of step N once, and that the log holds exactly the N finished steps, each line
# valid JSON. With SAVED_IN=DIR in the environment
# (the run's --save-dir, wiped first), also that DIR/latest names step N and verifies; with
# STOPPED_AT=S, that N is S.
# Usage: interrupt_run.sh SIGNAL STATUS LINES LOGFILE COMMAND [ARGS...]
set -u
signal=$1
want_status=$2
lines=$3
log=$4
shift 4
rm -f "$log"
[ -n "${SAVED_IN:-}" ] && rm -rf "$SAVED_IN"
out=$(mktemp)
"$@" >"$out" 2>&1 &
pid=$!
for _ in $(seq 1 600); do
  [ -f "$log" ] && [ "$(wc -l <"$log")" -ge "$lines" ] && break
  sleep 0.1
done
start=$(date +%s)
kill -s "$signal" "$pid"
wait "$pid"
status=$?
elapsed=$(($(date +%s) - start))
cat "$out"
fail() { echo "interrupt_run: $*" >&2; rm -f "$out"; exit 1; }
[ "$status" -eq "$want_status" ] || fail "exit status $status, expected $want_status"
[ "$elapsed" -le 10 ] || fail "took ${elapsed}s after the signal"
step=$(sed -n 's/^interrupted at step \([0-9]*\) .*/\1/p' "$out")
[ -n "$step" ] || fail "no 'interrupted at step N' line"
[ -z "${STOPPED_AT:-}" ] || [ "$step" = "$STOPPED_AT" ] ||
  fail "interrupted at step $step, expected step $STOPPED_AT"
grep -q '^done ' "$out" || fail "no summary"
# The step the run stopped at shows its loss, whatever --log-every says.
if [[ " $* " != *" --quiet "* ]]; then
  [ "$(grep -c "^step *$step/" "$out")" -eq 1 ] ||
    fail "the progress line of step $step is not printed once"
fi
n=$(wc -l <"$log")
[ "$n" -eq "$step" ] || fail "log has $n lines, interrupted at step $step"
python3 -c '
import json, sys
for i, line in enumerate(open(sys.argv[1]), 1):
    row = json.loads(line)
    assert row["step"] == i, (i, row)
' "$log" || fail "log lines are not complete JSON rows of steps 1..$step"
if [ -n "${SAVED_IN:-}" ]; then
  [ "$(cat "$SAVED_IN/latest" 2>/dev/null)" = "step_$step" ] ||
    fail "latest is '$(cat "$SAVED_IN/latest" 2>/dev/null)', expected step_$step"
  "$1" ckpt verify "$SAVED_IN" >/dev/null || fail "the checkpoint of step $step does not verify"
fi
rm -f "$out"

#!/usr/bin/env bash
# A run started under nohup (SIGHUP ignored) outlives a SIGHUP: sent once the JSON log has 2
# lines, the run goes on (the log grows by 3 more), and SIGTERM then stops it as usual, 143.
# Usage: hangup_ignored.sh CONVEYOR LOGFILE
set -u
cli=$1
log=$2
rm -f "$log"
out=$(mktemp)
nohup "$cli" train --device cpu --steps 100000 --batch-tokens 64 --microbatches 1 \
  --log-json "$log" >"$out" 2>&1 &
pid=$!
fail() { cat "$out"; echo "hangup_ignored: $*" >&2; kill -KILL "$pid" 2>/dev/null; rm -f "$out"; exit 1; }
lines() { if [ -f "$log" ]; then wc -l <"$log"; else echo 0; fi; }
for _ in $(seq 1 600); do
  [ "$(lines)" -ge 2 ] && break
  sleep 0.1
done
[ "$(lines)" -ge 2 ] || fail "the log has no 2 lines after 60 s"
kill -HUP "$pid"
at_hangup=$(lines)
for _ in $(seq 1 600); do
  [ "$(lines)" -ge $((at_hangup + 3)) ] && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
[ "$(lines)" -ge $((at_hangup + 3)) ] || fail "the run did not go on after SIGHUP"
kill -TERM "$pid"
wait "$pid"
status=$?
[ "$status" -eq 143 ] || fail "exit status $status after SIGTERM, expected 143"
grep -q '^interrupted at step [0-9]* of 100000 by SIGTERM' "$out" || fail "no interrupted line"
rm -f "$out"

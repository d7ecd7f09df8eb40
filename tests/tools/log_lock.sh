#!/usr/bin/env bash
# Two runs writing the same JSON log: while the first runs, the second must refuse with exit
# status 2 and a message saying the file is in use, and leave the first run's log intact.
# Usage: log_lock.sh LOGFILE CLI
set -u
log=$1
cli=$2
rm -f "$log"
"$cli" train --steps 100000 --quiet --log-json "$log" >/dev/null 2>&1 &
first=$!
for _ in $(seq 1 600); do
  [ -s "$log" ] && break
  sleep 0.1
done
second=$("$cli" train --steps 2 --quiet --log-json "$log" 2>&1)
status=$?
lines=$(wc -l <"$log")
kill -s TERM "$first"
wait "$first"
echo "$second"
[ "$status" -eq 2 ] || { echo "log_lock: second run exited $status, expected 2" >&2; exit 1; }
grep -q "being written by another run" <<<"$second" ||
  { echo "log_lock: second run did not name the lock" >&2; exit 1; }
[ "$lines" -ge 1 ] || { echo "log_lock: the first run's log was emptied" >&2; exit 1; }

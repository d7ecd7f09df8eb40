#!/usr/bin/env bash
# SIGNAL to a command while it writes an output file by way of a temporary beside it (`plan
# --out`, `schedule --trace`): sent once the temporary is there, it ends the command within a
# few seconds with STATUS (128 + signal) and one line saying so; the temporary is gone and the
# file holds what it held before (here "old").
# Usage: interrupt_output.sh SIGNAL STATUS DIR FILE COMMAND [ARGS...]   (COMMAND writes DIR/FILE)
set -u
signal=$1
want_status=$2
dir=$3
file=$4
shift 4
rm -rf "$dir" && mkdir -p "$dir" || exit 1
echo old >"$dir/$file"
fail() { echo "interrupt_output: $*" >&2; exit 1; }
"$@" >"$dir/stdout" 2>"$dir/stderr" &
pid=$!
for _ in $(seq 1 600); do
  compgen -G "$dir/$file.tmp.*" >/dev/null && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.05
done
compgen -G "$dir/$file.tmp.*" >/dev/null || fail "no temporary $file.tmp.* was made"
start=$(date +%s)
kill -s "$signal" "$pid"
wait "$pid"
status=$?
elapsed=$(($(date +%s) - start))
cat "$dir/stderr"
[ "$status" -eq "$want_status" ] || fail "exit status $status, expected $want_status"
[ "$elapsed" -le 10 ] || fail "took ${elapsed}s after the signal"
grep -q "^conveyor: interrupted by SIG$signal; the unfinished output files were removed" \
  "$dir/stderr" || fail "no line saying the run was interrupted"
left=$(cd "$dir" && ls | grep -v -x -e "$file" -e stdout -e stderr)
[ -z "$left" ] || fail "left behind: $left"
[ "$(cat "$dir/$file")" = old ] || fail "$file was changed"
echo "interrupt_output: SIG$signal, status $status, $file as it was, no temporary"

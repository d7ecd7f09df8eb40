#!/usr/bin/env bash
# `plan --out FILE` for a file the user may write in a folder where no new file may be made:
# the plan replaces FILE by a new file made next to it, so the refusal (exit 2, before any
# profiling) names the folder as the reason, not the file ("Permission denied" alone pointed
# at a file that was writable). Root may write anywhere, so as root the command runs as the
# user nobody (setpriv); skipped (77) where that cannot be done.
# Usage: plan_out_folder_closed.sh CLI DIR
set -u
cli=$1
dir=$2
fail() { echo "plan_out_folder_closed: $*" >&2; exit 1; }
rm -rf "$dir" && mkdir -p "$dir/closed" || exit 1
: >"$dir/closed/plan.json"
chmod 666 "$dir/closed/plan.json" && chmod 555 "$dir/closed" && chmod 755 "$dir" || exit 1
run=("$cli")
if [ "$(id -u)" -eq 0 ]; then
  command -v setpriv >/dev/null || { echo "skipped: running as root without setpriv"; exit 77; }
  setpriv --reuid=65534 --regid=65534 --clear-groups true 2>/dev/null ||
    { echo "skipped: this root may not become the user nobody"; exit 77; }
  [ -x "$cli" ] && setpriv --reuid=65534 --regid=65534 --clear-groups test -x "$cli" ||
    { echo "skipped: the user nobody cannot run $cli"; exit 77; }
  run=(setpriv --reuid=65534 --regid=65534 --clear-groups "$cli")
fi
output=$("${run[@]}" plan --device cpu --stages 1 --batch-tokens 64 --repetitions 1 \
  --out "$dir/closed/plan.json" 2>&1)
status=$?
echo "$output"
chmod 755 "$dir/closed"
[ "$status" -eq 2 ] || fail "exit status $status, expected 2"
want="conveyor: error: cannot open --out file '$dir/closed/plan.json' for writing: no new file can be made in its folder '$dir/closed' (Permission denied), and the file is replaced by one made there"
[ "$output" = "$want" ] || fail "expected the one line: $want"
[ ! -s "$dir/closed/plan.json" ] || fail "the file was written"
echo "plan_out_folder_closed: ok"

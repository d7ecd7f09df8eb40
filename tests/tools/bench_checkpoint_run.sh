#!/usr/bin/env bash
# bench_checkpoint writes as many bytes with dd as the state it saved (the tiny preset's fits
# in 1 MiB), checks first that DIR has room for the run, and leaves nothing behind: a DIR it
# made goes with the folders it made above it, a DIR of the user's stays, empty.
# Usage: bench_checkpoint_run.sh BENCH_CHECKPOINT WORK
set -u
bench=$1
work=$2
fail() {
  echo "bench_checkpoint_run: $*" >&2
  exit 1
}
rm -rf "$work"
mkdir -p "$work/empty"

output=$("$bench" tiny "$work/new/dir" 2>&1) || fail "a run into a new DIR failed: $output"
echo "$output"
grep -Eq '^dd +[0-9.]+ s +[0-9.]+ GB/s \(1 MiB of zeros in 1 MiB writes, then one fsync' \
  <<<"$output" || fail "dd did not write the state's size, 1 MiB"
[[ ! -e "$work/new" ]] || fail "the run left $work/new, which it made: $(ls -A "$work/new")"

output=$("$bench" tiny "$work/empty" 1 --dd-mib=2 2>&1) || fail "a run into an empty DIR failed: $output"
echo "$output"
grep -Eq '\(2 MiB of zeros' <<<"$output" || fail "dd did not write the 2 MiB of --dd-mib=2"
[[ -d "$work/empty" ]] || fail "the run removed the user's empty DIR $work/empty"
[[ -z "$(ls -A "$work/empty")" ]] || fail "the run left files in $work/empty: $(ls -A "$work/empty")"

output=$("$bench" tiny "$work/new/dir" --dd-mib=1073741824 2>&1)
status=$?
echo "$output"
((status == 1)) || fail "a run without room for its dd file ended with status $status, expected 1"
grep -Eq "^bench_checkpoint: DIR '.*/new/dir' has [0-9.]+ GB free, and the run needs about [0-9.]+ GB there \(the larger of 3 saves of the [0-9.]+ GB state and 1125899.907 GB of dd, and 64 MiB to spare\)$" \
  <<<"$output" || fail "no sentence saying DIR has no room for the run"
grep -q '^sync save' <<<"$output" && fail "the run saved before it checked for room"
[[ ! -e "$work/new" ]] || fail "the refused run left $work/new, which it made"
rm -rf "$work"

#!/usr/bin/env bash
# A --log-json write that fails mid-run (past the file size limit, as on a full disk) ends the
# run as a signal does: the last finished step is saved, said, and the run fails with the
# write error, exit 1; the log holds whole lines only. When that save fails too, both errors
# are said and the checkpoint before stays `latest`.
# Usage: log_write_fails.sh CONVEYOR DIR
set -u
cli=$1
dir=$2
rm -rf "$dir" && mkdir -p "$dir" || exit 1
fail() { echo "log_write_fails: $*" >&2; exit 1; }
small=(--device cpu --batch-tokens 64 --microbatches 1 --vocab 16 --layers 1)

# Every whole line is a step's record, steps FIRST.. in order; prints how many.
whole_lines() {
  python3 -c '
import json, sys
first = int(sys.argv[2])
text = open(sys.argv[1]).read()
assert text.endswith("\n"), "the log ends in a cut line"
lines = text.splitlines()
for i, line in enumerate(lines):
    assert json.loads(line)["step"] == first + i, (i, line)
print(len(lines))
' "$1" "$2"
}

# 24 KiB: the log's lines pass it after about 160 steps, a shard of --d-model 8 (15 KB) fits.
(ulimit -f 24 && exec "$cli" train "${small[@]}" --d-model 8 --steps 400 --quiet \
  --log-json "$dir/log.jsonl" --save-dir "$dir/ck" --save-every 100) >"$dir/out" 2>&1
status=$?
cat "$dir/out"
[ "$status" -eq 1 ] || fail "exit status $status, expected 1"
step=$(sed -n "s/^saved  step \([0-9]*\) into .*/\1/p" "$dir/out")
[ -n "$step" ] || fail "no 'saved  step N into' line"
[ "$step" -gt 100 ] && [ "$step" -lt 400 ] || fail "saved step $step, not one past the log's failure"
grep -qx "conveyor: error: cannot write --log-json file '.*/log.jsonl': File too large; the run stopped after step $step" "$dir/out" ||
  fail "no error line naming the log and the step the run stopped after"
[ "$(cat "$dir/ck/latest")" = "step_$step" ] || fail "latest is not step_$step"
"$cli" ckpt verify "$dir/ck" >/dev/null || fail "the checkpoint of step $step does not verify"
lines=$(whole_lines "$dir/log.jsonl" 1) || fail "the log does not hold whole lines of steps 1.."
# The step whose line failed is the one saved.
[ "$lines" -eq $((step - 1)) ] || fail "the log holds $lines steps, the run stopped after $step"

# The same with a shard past the limit: the closing save fails too, step 50 stays `latest`.
"$cli" train "${small[@]}" --d-model 32 --steps 400 --stop-after 50 --quiet \
  --save-dir "$dir/ck2" >/dev/null || fail "the first run of the second case failed"
(ulimit -f 24 && exec "$cli" train "${small[@]}" --d-model 32 --steps 400 --quiet \
  --log-json "$dir/log2.jsonl" --save-dir "$dir/ck2" --resume latest) >"$dir/out2" 2>&1
status=$?
cat "$dir/out2"
[ "$status" -eq 1 ] || fail "exit status $status, expected 1 when the save fails too"
grep -qx "conveyor: error: cannot write --log-json file '.*/log2.jsonl': File too large; the run stopped after step [0-9]*, whose save failed too (.*File too large.*); --save-dir '.*/ck2' keeps the checkpoints it held" "$dir/out2" ||
  fail "no error line with both failures"
[ "$(cat "$dir/ck2/latest")" = "step_50" ] || fail "latest is no longer step_50"
"$cli" ckpt verify "$dir/ck2" >/dev/null || fail "step 50 does not verify"
whole_lines "$dir/log2.jsonl" 51 >/dev/null || fail "the resumed log does not hold whole lines"
echo "log_write_fails: ok"

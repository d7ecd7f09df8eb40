#!/usr/bin/env bash
# A data or schedule file, a checkpoint folder or an output file whose name holds a line break
# is named escaped, on one line, in errors and in what a run prints: the engine's readers and
# checkpoints name the file themselves.
# Usage: odd_file_names.sh CLI DIR
set -u
cli=$1
dir=$2
rm -rf "$dir" && mkdir -p "$dir" || exit 1
expect=$(dirname "$0")/expect_exit.sh
name="$dir/two"$'\n'"lines"
one_line() {  # PATTERN COMMAND...: exit status 2, one line of output, matching PATTERN
  local pattern=$1
  shift
  local output
  output=$("$expect" 2 "$pattern" "$@") || exit 1
  [ "$(printf '%s\n' "$output" | wc -l)" -eq 1 ] || {
    echo "odd_file_names: more than one line: $output" >&2
    exit 1
  }
}
printf 'a' >"$name"
one_line "^conveyor: error: data file '.*/two\\\\nlines' has 1 byte;" \
  "$cli" train --device cpu --steps 1 --data "$name"
printf 'r0: F0.99999999\n' >"$name"
one_line "^conveyor: error: schedule file '.*/two\\\\nlines': an action names micro-batch" \
  "$cli" schedule --load "$name"
rm "$name"
one_line "^conveyor: error: cannot read data file '.*/two\\\\nlines': no such file" \
  "$cli" train --device cpu --steps 1 --data "$name"
one_line "^conveyor: error: cannot read schedule file '.*/two\\\\nlines': no such file" \
  "$cli" train --device cpu --steps 1 --schedule-file "$name"

# Checkpoints: saved into, resumed from, refused and inspected under such a name.
run=("$cli" train --device cpu --steps 3 --batch-tokens 64 --quiet)
out=$("${run[@]}" --stop-after 2 --save-dir "$name") || {
  echo "odd_file_names: the save failed: $out" >&2
  exit 1
}
grep -q "^saved  step 2 into .*/two\\\\nlines$" <<<"$out" || {
  echo "odd_file_names: the save is not named on one line: $out" >&2
  exit 1
}
out=$("${run[@]}" --resume "$name") || {
  echo "odd_file_names: the resume failed: $out" >&2
  exit 1
}
grep -q "^resume .*/two\\\\nlines/step_2 at step 2 " <<<"$out" || {
  echo "odd_file_names: the resume is not named on one line: $out" >&2
  exit 1
}
# A run prints its setup before it refuses: the error must be all of the last line.
error_last() {  # PATTERN COMMAND...: exit status 2, the last line matching PATTERN
  local pattern=$1
  shift
  local output
  output=$("$expect" 2 "$pattern" "$@") || exit 1
  printf '%s\n' "$output" | tail -n 1 | grep -Eq -- "$pattern" || {
    echo "odd_file_names: the error is not the whole last line: $output" >&2
    exit 1
  }
}
error_last "^conveyor: error: --save-dir '.*/two\\\\nlines' would refuse a save of this run: cannot save step 2: '.*/two\\\\nlines/step_2' exists already" \
  "${run[@]}" --stop-after 2 --save-dir "$name"
one_line "^conveyor: error: '.*/two\\\\nlines/step_2/manifest.json' is a file of the checkpoint folder '.*/two\\\\nlines/step_2'" \
  "$cli" ckpt verify "$name/step_2/manifest.json"
"$cli" ckpt verify "$name" | grep -q "^ok: .*/two\\\\nlines/step_2, step 2" || {
  echo "odd_file_names: ckpt verify does not name the checkpoint on one line" >&2
  exit 1
}
rm "$name/step_2/rank_0.safetensors"
output=$("$expect" 1 "^conveyor: error: '.*/two\\\\nlines/step_2/rank_0.safetensors' is listed in '.*/two\\\\nlines/step_2/manifest.json' but missing" \
  "$cli" ckpt verify "$name") || exit 1
[ "$(printf '%s\n' "$output" | wc -l)" -eq 1 ] || {
  echo "odd_file_names: more than one line: $output" >&2
  exit 1
}
rm -r "$name"
error_last "^conveyor: error: no checkpoint at '.*/two\\\\nlines': it does not exist" \
  "${run[@]}" --resume "$name"
printf 'a' >"$name"
error_last "^conveyor: error: cannot create checkpoint folder '.*/two\\\\nlines/ckpt': '.*/two\\\\nlines' is a file, not a folder" \
  "${run[@]}" --save-dir "$name/ckpt"
one_line "^conveyor: error: cannot open --log-json file '.*/two\\\\nlines/log.jsonl' for writing" \
  "${run[@]}" --log-json "$name/log.jsonl"
rm "$name"
# JSON holds only UTF-8: a folder named with other bytes is inspected as JSON all the same.
latin1="$dir/caf"$'\xe9'
"$cli" ckpt demo "$latin1" >/dev/null || exit 1
"$cli" ckpt inspect --json "$latin1" | python3 -c 'import json, sys; json.load(sys.stdin)' || {
  echo "odd_file_names: ckpt inspect --json of a folder named in Latin-1 is not JSON" >&2
  exit 1
}

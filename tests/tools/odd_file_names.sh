#!/usr/bin/env bash
# A data or schedule file whose name holds a line break is refused in one line, the name
# escaped: the engine's readers name the file themselves.
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
one_line "^conveyor: error: data file '.*/two\\\\nlines' has 1 bytes" \
  "$cli" train --device cpu --steps 1 --data "$name"
printf 'r0: F0.99999999\n' >"$name"
one_line "^conveyor: error: schedule file '.*/two\\\\nlines': an action names micro-batch" \
  "$cli" schedule --load "$name"
rm "$name"
one_line "^conveyor: error: cannot read data file '.*/two\\\\nlines': no such file" \
  "$cli" train --device cpu --steps 1 --data "$name"
one_line "^conveyor: error: cannot read schedule file '.*/two\\\\nlines': no such file" \
  "$cli" train --device cpu --steps 1 --schedule-file "$name"

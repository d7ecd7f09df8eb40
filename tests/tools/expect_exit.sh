#!/usr/bin/env bash
# Runs a command and checks its exit status and that its output matches a pattern.
# Usage: expect_exit.sh STATUS PATTERN COMMAND [ARGS...]
set -u
want_status=$1
pattern=$2
shift 2
output=$("$@" 2>&1)
status=$?
echo "$output"
if [ "$status" -ne "$want_status" ]; then
  echo "expect_exit: exit status $status, expected $want_status" >&2
  exit 1
fi
if ! grep -Eq -- "$pattern" <<<"$output"; then
  echo "expect_exit: output does not match /$pattern/" >&2
  exit 1
fi

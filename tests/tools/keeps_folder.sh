#!/usr/bin/env bash
# A command that removes its output folder at the end refuses a folder of the user's: exit
# status 2, a message matching PATTERN, and the folder's file still there.
# Usage: keeps_folder.sh WORK PATTERN COMMAND [ARGS...]; each argument @DIR@ stands for
# WORK/mine, a folder holding one file of the user's.
set -u
work=$1
pattern=$2
shift 2
rm -rf "$work"
mkdir -p "$work/mine"
echo "the user's" >"$work/mine/keep.txt"
args=()
for a in "$@"; do args+=("${a//@DIR@/$work/mine}"); done
output=$("${args[@]}" 2>&1)
status=$?
echo "$output"
if [[ ! -f "$work/mine/keep.txt" ]]; then
  echo "keeps_folder: $work/mine/keep.txt was removed" >&2
  exit 1
fi
if [[ $status -ne 2 ]]; then
  echo "keeps_folder: exit status $status, expected 2" >&2
  exit 1
fi
if ! grep -Eq -- "$pattern" <<<"$output"; then
  echo "keeps_folder: output does not match /$pattern/" >&2
  exit 1
fi
rm -rf "$work"

#!/usr/bin/env bash
# Runs a command that must succeed and write FILE, then checks that at least COUNT lines of
# FILE match each PATTERN.
# Usage: expect_file.sh FILE COUNT PATTERN[,PATTERN...] COMMAND [ARGS...]
set -u
file=$1
count=$2
patterns=$3
shift 3
rm -f "$file"
if ! "$@"; then
  echo "expect_file: the command failed" >&2
  exit 1
fi
[ -s "$file" ] || { echo "expect_file: $file was not written" >&2; exit 1; }
IFS=',' read -ra list <<<"$patterns"
for p in "${list[@]}"; do
  n=$(grep -Ec -- "$p" "$file")
  if [ "$n" -lt "$count" ]; then
    echo "expect_file: $n lines of $file match /$p/, expected at least $count" >&2
    exit 1
  fi
done

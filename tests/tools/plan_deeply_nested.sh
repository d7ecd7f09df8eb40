#!/usr/bin/env bash
# A plan file of deeply nested JSON is refused in one sentence, not by overflowing the stack
# while an error message prints it.
# Usage: plan_deeply_nested.sh CLI DIR
set -u
cli=$1
dir=$2
rm -rf "$dir" && mkdir -p "$dir" || exit 1
expect=$(dirname "$0")/expect_exit.sh
depth=500000
brackets() { head -c "$depth" /dev/zero | tr '\0' "$1"; }
{ brackets '['; brackets ']'; } >"$dir/list.json"
{ printf '{"schedule":'; brackets '['; brackets ']'; printf '}'; } >"$dir/schedule.json"
for plan in list schedule; do
  "$expect" 2 "^conveyor: error: plan file '.*$plan.json' nests JSON deeper than 16 levels" \
    "$cli" train --device cpu --steps 1 --plan "$dir/$plan.json" || exit 1
done

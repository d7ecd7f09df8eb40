#!/usr/bin/env bash
# A `train --trace FILE` run that fails leaves FILE as it was (or absent), and no temporary
# beside it; one that finishes puts the whole trace in its place.
# Usage: trace_kept.sh CLI DIR
set -u
cli=$1
dir=$2
rm -rf "$dir" && mkdir -p "$dir" || exit 1
fail() { echo "trace_kept: $*" >&2; exit 1; }
# Diverges at once: no finite step to report.
diverging=(train --device cpu --layers 2 --batch-tokens 256 --steps 20 --lr 1e30 --warmup 0
           --clip 0 --quiet)
echo "an earlier trace" >"$dir/kept.json"
"$cli" "${diverging[@]}" --trace "$dir/kept.json" >"$dir/out" 2>&1
[ $? -eq 1 ] || fail "a diverging run did not exit 1: $(cat "$dir/out")"
[ "$(cat "$dir/kept.json")" = "an earlier trace" ] || fail "a failed run changed the trace file"
"$cli" "${diverging[@]}" --trace "$dir/new.json" >"$dir/out" 2>&1
[ $? -eq 1 ] || fail "a diverging run did not exit 1: $(cat "$dir/out")"
[ ! -e "$dir/new.json" ] || fail "a failed run left a trace file behind"
"$cli" train --device cpu --layers 2 --batch-tokens 256 --steps 2 --quiet \
  --trace "$dir/kept.json" >"$dir/out" 2>&1 || fail "a good run failed: $(cat "$dir/out")"
python3 -c 'import json, sys; assert json.load(open(sys.argv[1]))["traceEvents"]' \
  "$dir/kept.json" || fail "the finished run's trace is not a whole trace"
left=$(ls "$dir" | grep -v -x -e kept.json -e out)
[ -z "$left" ] || fail "temporary files left behind: $left"
echo "trace_kept: ok"

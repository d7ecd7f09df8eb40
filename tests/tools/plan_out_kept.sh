#!/usr/bin/env bash
# A `plan --out FILE` that fails leaves FILE as it was (or absent), and no temporary beside it;
# through a link the plan goes to the file the link names.
# Usage: plan_out_kept.sh CLI DIR
set -u
cli=$1
dir=$2
rm -rf "$dir" && mkdir -p "$dir" || exit 1
small=(--device cpu --d-model 16 --layers 2 --vocab 64 --batch-tokens 64 --repetitions 1)
fail() { echo "plan_out_kept: $*" >&2; exit 1; }
"$cli" plan "${small[@]}" --stages 2 --out "$dir/plan.json" || fail "the first plan failed"
cp "$dir/plan.json" "$dir/kept.json"
"$cli" plan "${small[@]}" --stages 2 --memory-cap 40KiB --out "$dir/plan.json"
[ $? -eq 2 ] || fail "a plan under a 40 KiB cap did not exit 2"
cmp "$dir/plan.json" "$dir/kept.json" || fail "a failed plan changed the existing plan file"
"$cli" plan "${small[@]}" --stages 8 --out "$dir/eight.json"
[ $? -eq 2 ] || fail "a plan of 8 stages for 4 units with --out did not exit 2"
[ ! -e "$dir/eight.json" ] || fail "a failed plan left a file behind"
# Through a link: the file it names gets the plan, the link stays a link.
mkdir -p "$dir/real" && ln -s real/named.json "$dir/link.json" || exit 1
"$cli" plan "${small[@]}" --stages 2 --out "$dir/link.json" || fail "a plan through a link failed"
[ -L "$dir/link.json" ] || fail "the link was replaced by a file"
cmp -s "$dir/real/named.json" "$dir/kept.json" || [ -s "$dir/real/named.json" ] ||
  fail "the file the link names did not get the plan"
left=$(ls "$dir" | grep -v -x -e plan.json -e kept.json -e link.json -e real)
[ -z "$left" ] || fail "temporary files left behind: $left"
echo "plan_out_kept: ok"

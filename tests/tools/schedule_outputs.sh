#!/usr/bin/env bash
# `conveyor schedule`'s output files: one that cannot be written is refused before any work
# (the error alone, no schedule printed), a schedule that fails to load leaves an existing
# output as it was, and --dump over the --load file replaces it by the whole dump, which loads
# and dumps to itself; --svg or --trace over the --load file is refused, the file kept.
# Usage: schedule_outputs.sh CLI DIR SCHEDULE_FILE
set -u
cli=$1
dir=$2
schedule_file=$3
rm -rf "$dir" && mkdir -p "$dir/folder" || exit 1
fail() { echo "schedule_outputs: $*" >&2; exit 1; }
for flag in --dump --svg --trace; do
  out=$("$cli" schedule --kind 1f1b -p 2 -m 4 "$flag" "$dir/folder" 2>&1)
  [ $? -eq 2 ] || fail "$flag naming a folder did not exit 2: $out"
  grep -q "it is a directory" <<<"$out" || fail "$flag naming a folder: $out"
  ! grep -q makespan <<<"$out" || fail "$flag naming a folder was refused only after the work"
done
echo "kept" >"$dir/kept.txt"
printf 'r0: F0.0 X\n' >"$dir/bad.txt"
"$cli" schedule --load "$dir/bad.txt" --dump "$dir/kept.txt" >/dev/null 2>&1
[ $? -eq 2 ] || fail "a schedule file that does not parse did not exit 2"
[ "$(cat "$dir/kept.txt")" = kept ] || fail "a failed run changed the --dump file"
cp "$schedule_file" "$dir/same.txt" || exit 1
"$cli" schedule --load "$dir/same.txt" --dump "$dir/same.txt" >/dev/null ||
  fail "--dump over the --load file failed"
"$cli" schedule --load "$dir/same.txt" --dump "$dir/again.txt" >/dev/null ||
  fail "the dump written over the --load file does not load"
cmp -s "$dir/same.txt" "$dir/again.txt" || fail "the dump does not dump to itself"
ln -s same.txt "$dir/same_link.txt" || exit 1
for flag in --svg --trace; do
  for name in same.txt same_link.txt; do
    out=$("$cli" schedule --load "$dir/same.txt" "$flag" "$dir/$name" 2>&1)
    [ $? -eq 2 ] || fail "$flag over the --load file ($name) did not exit 2: $out"
    grep -q "^conveyor: error: $flag file '.*/$name' is the file --load reads" <<<"$out" ||
      fail "$flag over the --load file ($name): $out"
    cmp -s "$dir/same.txt" "$dir/again.txt" || fail "$flag over the --load file changed it"
  done
done
# Two outputs, one through a link to a file not made yet: the same file, refused.
ln -s fresh.svg "$dir/fresh_link.svg" || exit 1
out=$("$cli" schedule -p 2 -m 2 --svg "$dir/fresh_link.svg" --trace "$dir/fresh.svg" 2>&1)
[ $? -eq 2 ] || fail "--svg through a link to the --trace file did not exit 2: $out"
grep -q "^conveyor: error: --svg and --trace both name '.*/fresh.svg'" <<<"$out" ||
  fail "--svg through a link to the --trace file: $out"
left=$(ls "$dir" | grep -v -x -e folder -e kept.txt -e bad.txt -e same.txt -e again.txt \
  -e same_link.txt -e fresh_link.svg)
[ -z "$left" ] || fail "files left behind: $left"
echo "schedule_outputs: ok"

#!/usr/bin/env bash
# Every C++ and CUDA source of the repository as .clang-format lays it out: a file that
# clang-format would change fails the check, with the lines it would change. Skipped (77)
# without clang-format or outside a git checkout, where the tracked files cannot be listed.
# Usage: format_check.sh SOURCE_DIR
set -u
root=${1:?usage: format_check.sh SOURCE_DIR}
command -v clang-format >/dev/null || { echo "skipped: no clang-format"; exit 77; }
files=$(git -C "$root" ls-files '*.cpp' '*.h' '*.cu' '*.cuh' 2>/dev/null) ||
  { echo "skipped: $root is not a git checkout"; exit 77; }
clang-format --version
cd "$root" || exit 1
changed=0
diffs=$(mktemp) || exit 1
trap 'rm -f "$diffs"' EXIT
while IFS= read -r f; do
  [[ -f "$f" ]] || continue  # deleted in the work tree, not yet in the index
  if ! diff -u "$f" <(clang-format --style=file "$f") >"$diffs" 2>&1; then
    cat "$diffs"
    changed=$((changed + 1))
  fi
done <<<"$files"
if ((changed > 0)); then
  echo "format_check: clang-format would change ${changed} file(s) (diffs above); run clang-format -i on them" >&2
  exit 1
fi
echo "format_check: $(wc -l <<<"$files") files as .clang-format lays them out"

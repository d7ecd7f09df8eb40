#!/usr/bin/env bash
# tools/bootstrap.sh with a build folder that is a file: one line saying so, exit status 2,
# before any package is looked for. With a configure that fails (a stand-in cmake): CMake's
# own error, then one line saying the folder's cache keeps the -D settings given, exit 1.
# Usage: bootstrap_build_folder.sh BOOTSTRAP WORK
set -u
bootstrap=$1
work=$2
rm -rf "$work"
mkdir -p "$work/bin"
for tool in bash dirname grep; do ln -s "$(command -v "$tool")" "$work/bin/$tool"; done
# Every package installed, and a cmake that refuses its arguments as CMake does.
printf '#!%s\necho "install ok installed"\n' "$(command -v bash)" >"$work/bin/dpkg-query"
printf '#!%s\necho "CMake Error: a stand-in" >&2\nexit 1\n' "$(command -v bash)" >"$work/bin/cmake"
chmod +x "$work/bin/dpkg-query" "$work/bin/cmake"
fail() { echo "bootstrap_build_folder: $*" >&2; exit 1; }
run() {  # CONVEYOR_BUILD_DIR, CONVEYOR_CMAKE_ARGS
  env -i PATH="$work/bin" CONVEYOR_BUILD_DIR="$1" CONVEYOR_CMAKE_ARGS="$2" \
    "$(command -v bash)" "$bootstrap" 2>&1
}

touch "$work/file"
output=$(run "$work/file" "")
status=$?
echo "$output"
[ "$status" -eq 2 ] || fail "a file as the build folder: exit status $status, expected 2"
[ "$output" = "bootstrap: the build folder '$work/file' is not a folder; give a folder (made if missing), or move that file away" ] ||
  fail "a file as the build folder: not the one line expected"

output=$(run "$work/build" "-DCONVEYOR_BUILD_TESTS=OFF -DCONVEYOR_BUILD_BENCH=OFF -DWRONG=1")
status=$?
echo "$output"
[ "$status" -eq 1 ] || fail "a failed configure: exit status $status, expected 1"
grep -q "^CMake Error: a stand-in$" <<<"$output" || fail "CMake's own error is not shown"
grep -q "^bootstrap: configuring '$work/build' failed (CMake said why, above); its CMakeCache.txt keeps the -D settings of this and earlier runs (CONVEYOR_CMAKE_ARGS='.*-DWRONG=1'), so correct them there or remove '$work/build' to start anew$" <<<"$output" ||
  fail "a failed configure: the line naming the cache is missing"
echo "bootstrap_build_folder: both refused as expected"

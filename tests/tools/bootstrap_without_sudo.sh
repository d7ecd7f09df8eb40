#!/usr/bin/env bash
# tools/bootstrap.sh for a user who is not root and has no sudo, on a Debian system missing
# every package: one line that names the packages and what to run as root, exit status 2,
# nothing configured. What tools/train.sh asks for (no tests, no benchmarks) names only the
# packages the library and the command line need.
# Usage: bootstrap_without_sudo.sh BOOTSTRAP WORK
set -u
bootstrap=$1
work=$2
rm -rf "$work"
mkdir -p "$work/bin"
# A PATH of this folder alone: the shell and the tools the script runs before it installs,
# an id that says a plain user, a dpkg-query that finds nothing, and no sudo, apt-get or cmake.
for tool in bash dirname grep; do ln -s "$(command -v "$tool")" "$work/bin/$tool"; done
printf '#!%s\n[ "$1" = -u ] && echo 1000 || echo tester\n' "$(command -v bash)" >"$work/bin/id"
printf '#!%s\nexit 1\n' "$(command -v bash)" >"$work/bin/dpkg-query"
chmod +x "$work/bin/id" "$work/bin/dpkg-query"

fail=0
# Runs bootstrap with CONVEYOR_CMAKE_ARGS=$1; the message must match $2 and not $3.
check() {
  local output status
  output=$(env -i PATH="$work/bin" CONVEYOR_CMAKE_ARGS="$1" CONVEYOR_BUILD_DIR="$work/build" \
           "$(command -v bash)" "$bootstrap" 2>&1)
  status=$?
  echo "$output"
  if [[ $status -ne 2 ]]; then
    echo "bootstrap_without_sudo: exit status $status, expected 2" >&2
    fail=1
  fi
  if ! grep -Eq -- "$2" <<<"$output"; then
    echo "bootstrap_without_sudo: output does not match /$2/" >&2
    fail=1
  fi
  if [[ -n $3 ]] && grep -Eq -- "$3" <<<"$output"; then
    echo "bootstrap_without_sudo: output matches /$3/, which it should not" >&2
    fail=1
  fi
}
check "" "^bootstrap: the packages cmake .*libgtest-dev.* are missing and installing them needs root, but tester is not root and has no sudo: run 'apt-get install cmake " ""
check "-DCONVEYOR_BUILD_TESTS=OFF -DCONVEYOR_BUILD_BENCH=OFF" \
      "^bootstrap: the packages cmake .*libcli11-dev.* are missing" \
      "libgtest-dev|libbenchmark-dev|clang-format|slurm|jq"
if [[ -e $work/build ]]; then
  echo "bootstrap_without_sudo: it configured $work/build nonetheless" >&2
  fail=1
fi
((fail)) && exit 1
rm -rf "$work"

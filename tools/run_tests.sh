#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what is missing, builds, runs ctest.
# GPU tests (label `gpu`) are reported as skipped when no CUDA device is present.
# Extra arguments go to ctest (`-R cli_` runs a subset), which runs the tests labelled `serial`
# last and alone; the sanitizer run follows.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Asked for help, it says what it does rather than passing --help to ctest after building
# everything, then building and running the sanitizer run anyway.
for arg in "$@"; do
  if [[ $arg == -h || $arg == --help ]]; then
    echo "usage: tools/run_tests.sh [CTEST ARGS...]: installs what is missing, builds into build/"
    echo "(\$CONVEYOR_BUILD_DIR), runs ctest there with CTEST ARGS (the tests labelled serial last,"
    echo "alone), then the checkpoint tests under AddressSanitizer and UndefinedBehaviorSanitizer"
    echo "from build-asan/ (\$CONVEYOR_ASAN_BUILD_DIR), built while the serial tests run"
    exit 0
  fi
done
# Tests, benchmarks and examples on, ahead of the caller's flags: a build folder that
# tools/train.sh configured has them off in its cache, and ctest would find no test there and
# pass.
export CONVEYOR_CMAKE_ARGS="-DCONVEYOR_BUILD_TESTS=ON -DCONVEYOR_BUILD_BENCH=ON \
-DCONVEYOR_BUILD_EXAMPLES=ON${CONVEYOR_CMAKE_ARGS:+ $CONVEYOR_CMAKE_ARGS}"
"$root/tools/bootstrap.sh"
build=${CONVEYOR_BUILD_DIR:-$root/build}
ctest --test-dir "$build" --output-on-failure -j"$(nproc)" -LE serial "$@"

# The checkpoint tests once more under AddressSanitizer and UndefinedBehaviorSanitizer: a
# CPU-only build of their binary alone (and the layers it links), in build-asan/, at -O1 as
# the sanitizers' documentation advises, with line tables (-g1) for the reports. The
# checkpoint code and what it stands on are instrumented (CONVEYOR_SANITIZE, CMakeLists.txt),
# the layers between them compiled plainly.
# It compiles while the tests labelled `serial` run: those have the machine to themselves
# because their ranks would miss 1 s deadlines beside other tests' ranks, yet they mostly wait
# (on deadlines, on mpirun), so the build takes the idle cores at the lowest priority (nice
# 19), which gives a waking rank its core back at once. It runs in a session of its own so
# that a failed test or an interrupt can end the whole build, its compilers included.
asan=${CONVEYOR_ASAN_BUILD_DIR:-$root/build-asan}
mkdir -p "$asan"
setsid nice -n 19 bash -c '
  cmake -S "$1" -B "$2" -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" \
    -DCONVEYOR_CUDA=OFF -DCONVEYOR_BUILD_BENCH=OFF -DCONVEYOR_BUILD_EXAMPLES=OFF \
    -DCONVEYOR_SANITIZE=address,undefined &&
  cmake --build "$2" --target checkpoint_tests -j"$3"' _ "$root" "$asan" "$(nproc)" \
  >"$asan/build.log" 2>&1 &
asan_build=$!
trap 'kill -- -"$asan_build" 2>/dev/null || true' EXIT
ctest --test-dir "$build" --output-on-failure -L serial "$@"
if ! wait "$asan_build"; then
  tail -n 60 "$asan/build.log" >&2
  echo "run_tests: the sanitizer build failed; its whole log is $asan/build.log" >&2
  exit 1
fi
echo "run_tests: sanitizer build done ($asan/build.log)"
"$asan/tests/checkpoint_tests"

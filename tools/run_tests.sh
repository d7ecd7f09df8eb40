#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what is missing, builds, runs ctest.
# GPU tests (label `gpu`) are reported as skipped when no CUDA device is present.
# Extra arguments go to the first ctest (`-R cli_` runs a subset); the sanitizer run follows.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Asked for help, it says what it does rather than passing --help to ctest after building
# everything, then building and running the sanitizer run anyway.
for arg in "$@"; do
  if [[ $arg == -h || $arg == --help ]]; then
    echo "usage: tools/run_tests.sh [CTEST ARGS...]: installs what is missing, builds into build/"
    echo "(\$CONVEYOR_BUILD_DIR), runs ctest there with CTEST ARGS, then the checkpoint tests under"
    echo "AddressSanitizer and UndefinedBehaviorSanitizer from build-asan/ (\$CONVEYOR_ASAN_BUILD_DIR)"
    exit 0
  fi
done
"$root/tools/bootstrap.sh"
ctest --test-dir "${CONVEYOR_BUILD_DIR:-$root/build}" --output-on-failure -j"$(nproc)" "$@"

# The checkpoint tests once more under AddressSanitizer and UndefinedBehaviorSanitizer: a
# CPU-only build of their binary alone (and the layers it links), in build-asan/, at -O1 as
# the sanitizers' documentation advises, with line tables (-g1) for the reports. The
# checkpoint code and what it stands on are instrumented (CONVEYOR_SANITIZE, CMakeLists.txt),
# the layers between them compiled plainly.
asan=${CONVEYOR_ASAN_BUILD_DIR:-$root/build-asan}
cmake -S "$root" -B "$asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" \
  -DCONVEYOR_CUDA=OFF \
  -DCONVEYOR_BUILD_BENCH=OFF -DCONVEYOR_BUILD_EXAMPLES=OFF \
  -DCONVEYOR_SANITIZE=address,undefined
cmake --build "$asan" --target checkpoint_tests -j"$(nproc)"
"$asan/tests/checkpoint_tests"

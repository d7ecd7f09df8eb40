#!/usr/bin/env bash
# The main job on a fresh machine: installs what is missing, builds only what training needs
# (the library and the `conveyor` command line; no tests, benchmarks or examples) into
# build-train/ (or $CONVEYOR_TRAIN_BUILD_DIR), then runs `conveyor train` with any extra
# arguments (defaults: the tiny preset on the Markov source, GPU if present). The test
# command, tools/run_tests.sh, builds everything into build/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${CONVEYOR_TRAIN_BUILD_DIR:-$root/build-train}
CONVEYOR_BUILD_DIR=$build \
  CONVEYOR_CMAKE_ARGS="-DCONVEYOR_BUILD_TESTS=OFF -DCONVEYOR_BUILD_BENCH=OFF -DCONVEYOR_BUILD_EXAMPLES=OFF ${CONVEYOR_CMAKE_ARGS:-}" \
  "$root/tools/bootstrap.sh"
exec "$build/tools/conveyor" train "$@"

#!/usr/bin/env bash
# The main job on a fresh machine: installs what is missing, builds only what training needs
# (the library and the `conveyor` command line; no tests, benchmarks or examples) into
# build-train/ (or $CONVEYOR_TRAIN_BUILD_DIR), then runs `conveyor train` with any extra
# arguments (defaults: the tiny preset on the Markov source, GPU if present). The test
# command, tools/run_tests.sh, builds everything into build/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${CONVEYOR_TRAIN_BUILD_DIR:-$root/build-train}
# Without a GPU to run on, compiling the CUDA kernels only makes the first run slower (most of
# the build): build the CPU backend alone unless the caller chose otherwise.
cuda_args=""
if [[ "${CONVEYOR_CMAKE_ARGS:-}" != *CONVEYOR_CUDA=* ]] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "train.sh: no NVIDIA GPU found (nvidia-smi); building the CPU backend only" >&2
  cuda_args="-DCONVEYOR_CUDA=OFF"
fi
CONVEYOR_BUILD_DIR=$build \
  CONVEYOR_CMAKE_ARGS="-DCONVEYOR_BUILD_TESTS=OFF -DCONVEYOR_BUILD_BENCH=OFF -DCONVEYOR_BUILD_EXAMPLES=OFF $cuda_args ${CONVEYOR_CMAKE_ARGS:-}" \
  "$root/tools/bootstrap.sh"
exec "$build/tools/conveyor" train "$@"

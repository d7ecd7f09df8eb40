#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what is missing, builds, runs ctest.
# GPU tests (label `gpu`) are reported as skipped when no CUDA device is present.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/tools/bootstrap.sh"
ctest --test-dir "${CONVEYOR_BUILD_DIR:-$root/build}" --output-on-failure -j"$(nproc)" "$@"

#!/usr/bin/env bash
# Installs a built Conveyor into a scratch prefix, then builds and runs the example program
# against it through find_package(conveyor), as an application would.
# Usage: tools/check_install.sh BUILD_DIR WORK_DIR
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$1
work=$2
rm -rf "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$root/examples/minimal_train" -B "$work/example" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/example" -j2 >/dev/null
"$work/example/minimal_train"

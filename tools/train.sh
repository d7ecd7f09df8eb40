#!/usr/bin/env bash
# The main job on a fresh machine: installs what is missing, builds, runs `conveyor train`
# with any extra arguments (defaults: the tiny preset on the Markov source, GPU if present).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/tools/bootstrap.sh"
exec "${CONVEYOR_BUILD_DIR:-$root/build}/tools/conveyor" train "$@"

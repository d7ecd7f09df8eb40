#!/usr/bin/env bash
# Installs the Debian packages Conveyor needs (only those missing), then configures and
# builds into build/ (or $CONVEYOR_BUILD_DIR). Extra CMake flags: $CONVEYOR_CMAKE_ARGS.
# The CUDA backend is built when a CUDA toolkit is installed (CONVEYOR_CUDA=AUTO).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${CONVEYOR_BUILD_DIR:-$root/build}

packages=(cmake make g++ libeigen3-dev libgtest-dev libgmock-dev libbenchmark-dev
          libcli11-dev nlohmann-json3-dev libxxhash-dev openmpi-bin libopenmpi-dev jq)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "bootstrap: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# nvcc lives outside PATH on a default toolkit install.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release ${CONVEYOR_CMAKE_ARGS:-}
cmake --build "$build" -j"$(nproc)"

#!/usr/bin/env bash
# Installs the Debian packages Conveyor needs (only those missing), then configures and
# builds into build/ (or $CONVEYOR_BUILD_DIR). Extra CMake flags: $CONVEYOR_CMAKE_ARGS.
# The CUDA backend is built when a CUDA toolkit and NCCL are found (CONVEYOR_CUDA=AUTO).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${CONVEYOR_BUILD_DIR:-$root/build}

packages=(cmake make g++ libeigen3-dev libgtest-dev libgmock-dev libbenchmark-dev
          libcli11-dev nlohmann-json3-dev libxxhash-dev openmpi-bin libopenmpi-dev jq iproute2)
# For the tests (not for tools/train.sh, which builds none): the programs of the private
# one-node Slurm cluster that ctest mpi_train_slurm_srun starts, to run conveyor under a real
# srun --mpi=pmix. The test starts daemons of its own, with their own key, ports and folders,
# and uses none of the packages' services (slurmd and slurmctld do not start without an
# /etc/slurm/slurm.conf).
if [[ "${CONVEYOR_CMAKE_ARGS:-}" != *CONVEYOR_BUILD_TESTS=OFF* ]]; then
  packages+=(slurmctld slurmd slurm-client munge)
  # ctest format_check lays every source out with it and compares.
  packages+=(clang-format)
fi
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

# The checkpoint interop test reads shards with Python's safetensors and numpy (from PyPI;
# Debian has no safetensors), for the python3 on PATH, unless they import already.
if ! python3 -c 'import safetensors, numpy' 2>/dev/null; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "bootstrap: installing python3-pip"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      python3 python3-pip
  fi
  echo "bootstrap: installing the Python packages safetensors and numpy"
  pip_args=(--quiet)
  # Outside a virtual environment, into the user's site-packages.
  python3 -c 'import sys; sys.exit(sys.prefix != sys.base_prefix)' && pip_args+=(--user)
  # Debian's own python3 refuses pip installs (PEP 668) unless told.
  python3 -m pip install "${pip_args[@]}" safetensors numpy 2>/dev/null ||
    python3 -m pip install "${pip_args[@]}" --break-system-packages safetensors numpy
fi

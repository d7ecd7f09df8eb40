#!/usr/bin/env bash
# Installs the Debian packages Conveyor needs (only those missing), then configures and
# builds into build/ (or $CONVEYOR_BUILD_DIR). Extra CMake flags: $CONVEYOR_CMAKE_ARGS, split
# at white space as the shell splits words (no quoting inside it).
# The CUDA backend is built when a CUDA toolkit and NCCL are found (CONVEYOR_CUDA=AUTO).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${CONVEYOR_BUILD_DIR:-$root/build}
# Before any package is installed: CMake would only say it cannot make the folder.
if [ -e "$build" ] && [ ! -d "$build" ]; then
  echo "bootstrap: the build folder '$build' is not a folder; give a folder" \
       "(made if missing), or move that file away" >&2
  exit 2
fi

# What the library and the command line need; tools/train.sh builds no more.
packages=(cmake make g++ libeigen3-dev libcli11-dev nlohmann-json3-dev libxxhash-dev openmpi-bin
          libopenmpi-dev)
tests=1
[[ "${CONVEYOR_CMAKE_ARGS:-}" == *CONVEYOR_BUILD_TESTS=OFF* ]] && tests=0
if ((tests)); then
  packages+=(libgtest-dev libgmock-dev jq iproute2)
  # The programs of the private one-node Slurm cluster that ctest mpi_train_slurm_srun starts,
  # to run conveyor under a real srun --mpi=pmix. The test starts daemons of its own, with
  # their own key, ports and folders, and uses none of the packages' services (slurmd and
  # slurmctld do not start without an /etc/slurm/slurm.conf).
  packages+=(slurmctld slurmd slurm-client munge)
  # ctest format_check lays every source out with it and compares.
  packages+=(clang-format)
fi
[[ "${CONVEYOR_CMAKE_ARGS:-}" == *CONVEYOR_BUILD_BENCH=OFF* ]] || packages+=(libbenchmark-dev)

# Installs Debian packages: as root directly, as another user through sudo, and for a user
# without sudo not at all, saying what to run instead of failing on "sudo: command not found".
install_packages() {
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null; then
      echo "bootstrap: the packages $* are missing and installing them needs root, but" \
           "$(id -un) is not root and has no sudo: run 'apt-get install $*' as root, then this" \
           "command again" >&2
      exit 2
    fi
    sudo=(sudo)
  fi
  echo "bootstrap: installing $*"
  "${sudo[@]}" apt-get update -qq
  # Through env, since sudo does not pass the caller's environment on.
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends "$@"
}

missing=()
if command -v dpkg-query >/dev/null; then
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
      missing+=("$p")
  done
else
  echo "bootstrap: not a Debian or Ubuntu system (no dpkg-query): installing nothing; CMake" \
       "says what it cannot find" >&2
fi
((${#missing[@]} == 0)) || install_packages "${missing[@]}"

# nvcc lives outside PATH on a default toolkit install.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

# shellcheck disable=SC2086
if ! cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release ${CONVEYOR_CMAKE_ARGS:-}; then
  # CMake keeps every -D given in the folder's cache, a wrong one too, for the next configure.
  echo "bootstrap: configuring '$build' failed (CMake said why, above); its CMakeCache.txt" \
       "keeps the -D settings of this and earlier runs (CONVEYOR_CMAKE_ARGS='${CONVEYOR_CMAKE_ARGS:-}')," \
       "so correct them there or remove '$build' to start anew" >&2
  exit 1
fi
cmake --build "$build" -j"$(nproc)"

# The checkpoint interop test reads shards with Python's safetensors and numpy (from PyPI;
# Debian has no safetensors), for the python3 on PATH, unless they import already.
if ((tests)) && ! python3 -c 'import safetensors, numpy' 2>/dev/null; then
  if ! python3 -m pip --version >/dev/null 2>&1; then
    install_packages python3 python3-pip
  fi
  echo "bootstrap: installing the Python packages safetensors and numpy"
  pip_args=(--quiet)
  # Outside a virtual environment, into the user's site-packages.
  python3 -c 'import sys; sys.exit(sys.prefix != sys.base_prefix)' && pip_args+=(--user)
  # Debian's own python3 refuses pip installs (PEP 668) unless told.
  python3 -m pip install "${pip_args[@]}" safetensors numpy 2>/dev/null ||
    python3 -m pip install "${pip_args[@]}" --break-system-packages safetensors numpy
fi

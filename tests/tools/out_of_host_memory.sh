#!/usr/bin/env bash
# Runs COMMAND under the smallest address-space limit, in steps of 256 MiB from 512 MiB, at
# which the program itself loads (a CUDA build maps cuBLASLt and the CUDA runtime, several
# hundred MiB, before main runs), and expects there the out-of-memory sentence and exit 2: at
# that limit the command's work has less than 256 MiB left, far less than it asks for.
# --expect REGEX expects that line instead of the out-of-memory sentence of the host.
# Usage: out_of_host_memory.sh [--expect REGEX] COMMAND [ARGS...]
set -u
sentence='^conveyor: error: out of memory on the host: an allocation of its memory failed; use smaller sizes or free some memory$'
if [ "${1:-}" = --expect ]; then
  sentence=$2
  shift 2
fi
for ((mib = 512; mib <= 8192; mib += 256)); do
  output=$(ulimit -v $((mib * 1024)) && "$@" 2>&1 >/dev/null)
  status=$?
  # 127: the loader could not map a shared library; anything else came from the program.
  if ((status == 127)) && grep -q 'error while loading shared libraries' <<<"$output"; then
    continue
  fi
  echo "limit ${mib} MiB: exit ${status}"
  echo "$output"
  if ((status != 2)); then
    echo "out_of_host_memory: exit status ${status}, expected 2" >&2
    exit 1
  fi
  if ! grep -Eq -- "$sentence" <<<"$output"; then
    echo "out_of_host_memory: the output does not match /$sentence/" >&2
    exit 1
  fi
  exit 0
done
echo "out_of_host_memory: the program did not load under 8 GiB of address space" >&2
exit 1

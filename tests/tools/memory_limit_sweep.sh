#!/usr/bin/env bash
# Runs a training command under address-space limits (ulimit -v) from 256 MiB up, in steps of
# 16 MiB, until it succeeds, and checks that every limit it fails at ends it with one line that
# says what ran out of memory: building the model (exit 2), a save (`cannot save step N: ...`,
# `cannot write '<shard>': ...`, exit 1) or a training step (exit 1). Once a step has run, the
# sentence of a host allocation that failed somewhere (exit 2), a system error's bare text or
# a crash is a failure of this check. Limits at which the program does not load are skipped.
# Usage: memory_limit_sweep.sh COMMAND [ARGS...]
set -u
named='^conveyor: error: (out of memory while building the model|cannot save step [0-9]+: |cannot write .*: out of memory|out of memory in training step|rank [0-9]+, action [^:]*: out of memory)'
before_training='^conveyor: error: out of memory on the host: an allocation of its memory failed; use smaller sizes or free some memory$'
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for ((mib = 256; mib <= 8192; mib += 16)); do
  error=$(ulimit -v $((mib * 1024)) && "$@" 2>&1 >"$out")
  status=$?
  if ((status == 127)) && grep -q 'error while loading shared libraries' <<<"$error"; then
    continue
  fi
  if ((status == 0)); then
    echo "memory_limit_sweep: succeeds from ${mib} MiB"
    exit 0
  fi
  last=$(tail -n 1 <<<"$error")
  echo "limit ${mib} MiB: exit ${status}: ${last}"
  if grep -Eq -- "$named" <<<"$last" && ((status == 1 || status == 2)); then
    continue
  fi
  if ! grep -q '^step ' "$out" && grep -Eq -- "$before_training" <<<"$last" && ((status == 2)); then
    continue
  fi
  echo "memory_limit_sweep: at ${mib} MiB the run ended with status ${status} without saying what ran out of memory" >&2
  exit 1
done
echo "memory_limit_sweep: the command did not succeed under 8 GiB of address space" >&2
exit 1

#!/usr/bin/env bash
# Under --on-save-error continue, an async save whose host copy of the weights does not fit
# is a failed save like any other: a warning, and training goes on to its last step (which,
# unsaved, ends the run with status 1). Address-space limits from 512 MiB up are tried until
# one fails the snapshot; none may end the run with that failure as its error.
# Usage: snapshot_out_of_memory_continue.sh CONVEYOR WORKDIR
set -u
cli=$1 work=$2
snapshot='cannot save step [0-9]+: the host copy of its weights'
for ((mib = 512; mib <= 1024; mib += 32)); do
  rm -rf "$work" && mkdir -p "$work" || exit 1
  (ulimit -v $((mib * 1024)) &&
    exec "$cli" train --device cpu --steps 3 --d-model 512 --layers 8 --batch-tokens 256 \
      --microbatches 1 --save-dir "$work/ck" --save-every 1 --async-save \
      --on-save-error continue >"$work/out" 2>"$work/err")
  status=$?
  echo "limit ${mib} MiB: exit ${status}: $(tail -n 1 "$work/err")"
  if grep -Eq "^conveyor: error: $snapshot" "$work/err"; then
    echo "snapshot_out_of_memory_continue: at ${mib} MiB the snapshot's failure ended the run" >&2
    exit 1
  fi
  grep -Eq "^conveyor: warning: checkpoint not saved; the run does not stop for it: $snapshot" \
    "$work/err" || continue
  if ! grep -q '^step     3/3 ' "$work/out" || ((status != 0 && status != 1)); then
    echo "snapshot_out_of_memory_continue: at ${mib} MiB the run did not train on to step 3" \
         "after the warning (exit ${status})" >&2
    exit 1
  fi
  echo "snapshot_out_of_memory_continue: at ${mib} MiB the snapshot failed, was warned of, and" \
       "the run trained on (exit ${status})"
  exit 0
done
echo "snapshot_out_of_memory_continue: no limit up to 1024 MiB failed the snapshot alone" >&2
exit 77

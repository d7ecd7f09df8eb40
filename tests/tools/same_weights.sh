#!/usr/bin/env bash
# Runs a command once as given and once per variant (extra flags appended), and checks that
# every run prints the same "weights xxh3" checksum line.
# Usage: same_weights.sh CLI "VARIANT FLAGS" ... -- ARGS...
set -u
cli=$1
shift
source "$(dirname "${BASH_SOURCE[0]}")/variant_flags.sh"
split_variants "$@"
checksum() {
  "$cli" "$@" 2>&1 | grep -E '^weights xxh3 [0-9a-f]+$'
}
want=$(checksum "${args[@]}")
if [ -z "$want" ]; then
  echo "same_weights: the run printed no checksum" >&2
  exit 1
fi
echo "reference: $want"
for v in "${variants[@]}"; do
  # shellcheck disable=SC2086  # the variant is a list of flags
  got=$(checksum "${args[@]}" $v)
  echo "$v: $got"
  if [ "$got" != "$want" ]; then
    echo "same_weights: $v gives '$got', expected '$want'" >&2
    exit 1
  fi
done

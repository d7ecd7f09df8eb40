#!/usr/bin/env bash
# A flag that should save memory reaches the run: the run's allocator peak (the "peak_bytes"
# of its --log-json lines, each rank's allocator on the CPU, so the same every run) is lower
# with each variant's flags than without. Used for --recompute and --shard-optimizer, whose
# weights other tests show to be the same.
# Usage: lower_peak.sh CLI WORK_DIR "VARIANT FLAGS" ... -- ARGS...
set -u
cli=$1 work=$2
shift 2
source "$(dirname "${BASH_SOURCE[0]}")/variant_flags.sh"
split_variants "$@"
mkdir -p "$work"
peak() {  # the last step's peak_bytes of a run with the flags given
  local log=$work/steps.jsonl
  rm -f "$log"
  "$cli" "$@" --log-json "$log" >/dev/null 2>&1 || return 1
  tail -n 1 "$log" | grep -oE '"peak_bytes":[0-9]+' | grep -oE '[0-9]+$'
}
plain=$(peak "${args[@]}") || plain=
if [ -z "$plain" ]; then
  echo "lower_peak: the run without the variants failed or logged no peak_bytes" >&2
  exit 1
fi
echo "without: $plain bytes"
for v in "${variants[@]}"; do
  # shellcheck disable=SC2086  # the variant is a list of flags
  got=$(peak "${args[@]}" $v) || got=
  echo "$v: ${got:-no peak} bytes"
  if [ -z "$got" ] || [ "$got" -ge "$plain" ]; then
    echo "lower_peak: $v peaks at '${got}' bytes, not below the $plain bytes without it" >&2
    exit 1
  fi
done

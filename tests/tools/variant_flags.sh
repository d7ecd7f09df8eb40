# shellcheck shell=bash
# Sourced by the scripts that run one command with and without variants of its flags
# (same_weights.sh, lower_peak.sh, close_steps.sh, departs_at.sh): their arguments
# "VARIANT FLAGS" ... -- ARGS...
# split_variants "$@" sets `variants` to the variants and `args` to the arguments after --.
split_variants() {
  variants=()
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
    variants+=("$1")
    shift
  done
  if [ "$#" -eq 0 ]; then
    echo "$(basename "$0"): no -- between the variants and the command's arguments" >&2
    exit 2
  fi
  shift  # the --
  # shellcheck disable=SC2034  # read by the script that sources this
  args=("$@")
}

# run_logged NAME FLAGS...: runs "$cli" FLAGS... --log-json into "$work" (both set by the
# sourcing script); NAME.steps then holds "step loss grad_norm" per step, NAME.out the output.
# On failure it prints the output and returns 1.
run_logged() {
  local name=$1
  shift
  rm -f "$work/$name.jsonl"
  "$cli" "$@" --log-json "$work/$name.jsonl" >"$work/$name.out" 2>&1 || {
    cat "$work/$name.out"
    return 1
  }
  jq -r 'select(.step) | "\(.step) \(.loss) \(.grad_norm)"' "$work/$name.jsonl" >"$work/$name.steps"
}
# logged_checksum NAME: the "weights xxh3" line of run NAME's output (--weights-checksum).
logged_checksum() { grep -E '^weights xxh3 [0-9a-f]+$' "$work/$1.out"; }

# run_reference: runs the command's arguments alone as run "reference" (run_logged); ends the
# script if it fails.
run_reference() {
  run_logged reference "${args[@]}" || {
    echo "$(basename "$0" .sh): the run without the variants failed" >&2
    exit 1
  }
}

# run_variant NAME FLAGS: runs the command's arguments with the variant's FLAGS appended as run
# NAME (run_logged), ends the script if it fails, and shows its logged steps under FLAGS.
run_variant() {
  local name=$1 flags=$2
  # shellcheck disable=SC2086  # the variant is a list of flags
  run_logged "$name" "${args[@]}" $flags || {
    echo "$(basename "$0" .sh): $flags: the run failed" >&2
    exit 1
  }
  echo "$flags:"
  cat "$work/$name.steps"
}

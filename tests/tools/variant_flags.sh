# shellcheck shell=bash
# Sourced by the scripts that run one command with and without variants of its flags
# (same_weights.sh, lower_peak.sh, close_steps.sh): their arguments "VARIANT FLAGS" ... -- ARGS...
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

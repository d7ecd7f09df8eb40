#!/usr/bin/env bash
# Runs a command once as given and once per variant (extra flags appended), and checks that
# every run logs the same steps (--log-json) with each step's loss and gradient norm within
# a relative tolerance of the first run's. A tolerance of 0 asks for the same bits, and then
# for the same final weights too where the run prints their checksum (--weights-checksum).
# Usage: close_steps.sh CLI WORK_DIR TOLERANCE "VARIANT FLAGS" ... -- ARGS...
set -u
cli=$1 work=$2 tolerance=$3
shift 3
source "$(dirname "${BASH_SOURCE[0]}")/variant_flags.sh"
split_variants "$@"
mkdir -p "$work"
run_reference
if [ ! -s "$work/reference.steps" ]; then
  echo "close_steps: the run logged no steps" >&2
  exit 1
fi
echo "reference (step loss grad_norm):"
cat "$work/reference.steps"
i=0
for v in "${variants[@]}"; do
  i=$((i + 1))
  run_variant "variant$i" "$v"
  # Each number against the reference's: |got - want| <= tolerance * |want|.
  if ! awk -v tol="$tolerance" -v what="$v" '
    NR == FNR { want[FNR] = $0; n = FNR; next }
    {
      if (!(FNR in want)) { printf "close_steps: %s logs step %s, the reference stops at %d\n", what, $1, n; bad = 1; exit }
      split(want[FNR], w)
      if ($1 != w[1]) { printf "close_steps: %s logs step %s where the reference logs %s\n", what, $1, w[1]; bad = 1; exit }
      split("loss grad_norm", names)
      for (k = 2; k <= 3; ++k) {
        d = $k - w[k]; if (d < 0) d = -d
        a = w[k]; if (a < 0) a = -a
        if (d > tol * a) {
          printf "close_steps: %s: step %s %s %s, the reference %s (relative difference %.3g, tolerance %s)\n", what, $1, names[k - 1], $k, w[k], (a > 0 ? d / a : d), tol
          bad = 1
        }
      }
      m = FNR
    }
    END {
      if (!bad && m != n) { printf "close_steps: %s logs %d steps, the reference %d\n", what, m, n; bad = 1 }
      exit bad
    }' "$work/reference.steps" "$work/variant$i.steps" >&2; then
    exit 1
  fi
  if awk -v t="$tolerance" 'BEGIN { exit !(t == 0) }'; then
    want=$(logged_checksum reference) got=$(logged_checksum "variant$i")
    if [ "$got" != "$want" ]; then
      echo "close_steps: $v ends with '$got', the reference with '$want'" >&2
      exit 1
    fi
  fi
done
echo "close_steps: every variant within $tolerance of the reference"

#!/usr/bin/env bash
# A flag that changes the training reaches it: runs a command once as given and once per
# variant (extra flags appended), and checks that each variant's run departs from the first at
# step STEP. Every step before STEP logs the first run's loss and gradient norm bit for bit
# (--log-json), step STEP's loss differs, and so do the final weights (--weights-checksum). A
# run that ignored the variant's flags would log the first run's bits throughout; one that
# changed what comes before STEP would differ there. STEP 1: the flag changes the first loss
# (the model, its initial weights); STEP 2: it changes only the update (decay, clipping).
# Usage: departs_at.sh CLI WORK_DIR STEP "VARIANT FLAGS" ... -- ARGS...
set -u
cli=$1 work=$2 step=$3
shift 3
source "$(dirname "${BASH_SOURCE[0]}")/variant_flags.sh"
split_variants "$@"
mkdir -p "$work"
run_reference
if [ "$(awk -v s="$step" '$1 == s' "$work/reference.steps" | wc -l)" -ne 1 ]; then
  echo "departs_at: the run logged no step $step (--steps must reach it)" >&2
  exit 1
fi
if [ -z "$(logged_checksum reference)" ]; then
  echo "departs_at: the run printed no checksum (--weights-checksum)" >&2
  exit 1
fi
echo "reference (step loss grad_norm):"
cat "$work/reference.steps"
i=0
for v in "${variants[@]}"; do
  i=$((i + 1))
  run_variant "variant$i" "$v"
  if ! awk -v at="$step" -v what="$v" '
    NR == FNR { want[$1] = $0; next }
    $1 < at && $0 != want[$1] {
      printf "departs_at: %s: step %s logs \"%s\", the reference \"%s\"; the runs should agree before step %s\n", what, $1, $0, want[$1], at
      bad = 1
    }
    $1 == at {
      seen = 1
      split(want[$1], w)
      if ($2 == w[2]) {
        printf "departs_at: %s: step %s loss %s, the reference'"'"'s bits: the flags changed nothing by then\n", what, $1, $2
        bad = 1
      }
    }
    END {
      if (!seen) { printf "departs_at: %s logs no step %s\n", what, at; bad = 1 }
      exit bad
    }' "$work/reference.steps" "$work/variant$i.steps" >&2; then
    exit 1
  fi
  want=$(logged_checksum reference) got=$(logged_checksum "variant$i")
  if [ -z "$got" ] || [ "$got" = "$want" ]; then
    echo "departs_at: $v ends with '$got', the reference with '$want': the weights should differ" >&2
    exit 1
  fi
done
echo "departs_at: every variant agrees with the reference before step $step and differs from it there"

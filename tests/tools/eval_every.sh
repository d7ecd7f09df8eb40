#!/usr/bin/env bash
# Every held-out evaluation of a run measures the same batches (with weights that do not change, one loss); the
# loss after step s is the same whether it is one of --eval-every's, the closing one of a run that --stop-after ends at
# s, or one of a run resumed from a checkpoint (under another stage count), bit for bit; the
# last step's evaluation is the closing one alone; --quiet leaves the periodic lines out but
# not their --log-json records; --trace shows each evaluation on the training loop; a failed
# closing evaluation keeps the closing save; a resume under another --steps says (with --data
# only) that the held-out batches moved.
# Usage: eval_every.sh CONVEYOR WORK [DATA_FILE]   (with DATA_FILE: --data, else the Markov chain)
set -u
cli=$1 work=$2
rm -rf "$work" && mkdir -p "$work" || exit 1
data=()
[ $# -ge 3 ] && data=(--data "$3")
common=(train --device cpu --d-model 16 --layers 2 --batch-tokens 64 --microbatches 2
        --steps 6 --eval-batches 2 "${data[@]}")
fail() {
  echo "eval_every: $*" >&2
  exit 1
}
run() {
  local name=$1
  shift
  "$cli" "${common[@]}" "$@" >"$work/$name.out" 2>&1 || {
    cat "$work/$name.out"
    fail "run '$name' failed"
  }
}
# The hex loss of the --log-json evaluation record after step $2 in file $1.
record() { jq -r --argjson s "$2" 'select(.eval_step == $s) | .eval_loss_hex' "$1"; }
# The hex loss of the closing "eval   loss" line of run $1.
closing() { sed -nE 's/^eval   loss .* exactly (0x.*)$/\1/p' "$work/$1.out"; }

run whole --eval-every 2 --log-json "$work/whole.jsonl" --trace "$work/whole.trace"
periodic=$(sed -nE 's/^eval   step ([0-9]+): loss .* exactly (0x.*)$/\1 \2/p' "$work/whole.out")
[ "$(cut -d' ' -f1 <<<"$periodic" | paste -sd' ' -)" = "2 4" ] ||
  fail "the periodic lines are for steps '$(cut -d' ' -f1 <<<"$periodic" | paste -sd' ' -)', expected '2 4'"
for s in 2 4; do
  [ "$(grep "^$s " <<<"$periodic" | cut -d' ' -f2)" = "$(record "$work/whole.jsonl" $s)" ] ||
    fail "the line and the --log-json record of step $s differ"
done
[ "$(record "$work/whole.jsonl" 6)" = "$(closing whole)" ] && [ -n "$(closing whole)" ] ||
  fail "the closing evaluation's record and line differ"
[ "$(jq -r 'select(.eval_step) | .eval_step' "$work/whole.jsonl" | paste -sd' ' -)" = "2 4 6" ] ||
  fail "the --log-json evaluation records are not those of steps 2 4 6"
[ "$(jq -r '.traceEvents[] | select(.name | startswith("evaluation")) | .name' \
  "$work/whole.trace" | paste -sd, -)" = "evaluation after step 2,evaluation after step 4,evaluation after step 6" ] ||
  fail "the trace does not show the three evaluations"

# Weights that do not change (an update of 1e-30 rounds away) give one loss at every evaluation: the batches are the same.
run still --lr 1e-30 --min-lr 0 --eval-every 1 --quiet --log-json "$work/still.jsonl"
[ "$(jq -r 'select(.eval_step) | .eval_loss_hex' "$work/still.jsonl" | sort -u | wc -l)" = 1 ] ||
  fail "with unchanging weights the evaluations differ: $(jq -r 'select(.eval_step) | .eval_loss_hex' "$work/still.jsonl" | paste -sd' ' -)"

# Stopped after step 4: its closing evaluation is the whole run's after step 4.
run stopped --stop-after 4 --save-dir "$work/ckpt"
[ "$(closing stopped)" = "$(record "$work/whole.jsonl" 4)" ] ||
  fail "stopped at step 4: $(closing stopped), the whole run after step 4: $(record "$work/whole.jsonl" 4)"

# Resumed under two stages, quiet: no periodic line, the same records.
run resumed --resume "$work/ckpt" --stages 2 --eval-every 1 --quiet --log-json "$work/resumed.jsonl"
grep -q '^eval   step' "$work/resumed.out" && fail "--quiet printed a periodic evaluation line"
[ "$(record "$work/resumed.jsonl" 5)" != "" ] || fail "the resumed run has no record after step 5"
[ "$(record "$work/resumed.jsonl" 6)" = "$(record "$work/whole.jsonl" 6)" ] ||
  fail "resumed: $(record "$work/resumed.jsonl" 6) after step 6, the whole run: $(record "$work/whole.jsonl" 6)"
grep -q "held-out batches" "$work/resumed.out" && fail "a resume under the same --steps says the held-out batches moved"
# Resumed under more --steps: with --data, whose held-out batches follow the training ones, a note says they moved.
"$cli" train --device cpu --d-model 16 --layers 2 --batch-tokens 64 --microbatches 2 --steps 8 --stop-after 5 \
  --eval-batches 2 "${data[@]}" --resume "$work/ckpt" --quiet >"$work/longer.out" 2>&1 ||
  fail "the resume under --steps 8 failed: $(cat "$work/longer.out")"
moved="^note   the held-out batches of --data follow the --steps training batches: now those after batch 8, where the saved run's were those after batch 6; "
if [ ${#data[@]} -gt 0 ]; then
  grep -q "$moved" "$work/longer.out" || fail "no note that the held-out batches moved: $(cat "$work/longer.out")"
else
  grep -q "held-out batches" "$work/longer.out" && fail "the Markov chain's held-out walk does not move: $(cat "$work/longer.out")"
fi
# A closing evaluation that fails comes after the closing save, which it does not cost.
"$cli" train --device cpu --d-model 16 --layers 2 --vocab 32 --batch-tokens 64 --steps 1 \
  --lr 1e30 --eval-batches 1 --quiet --save-dir "$work/diverged" >"$work/diverged.out" 2>&1
status=$?
[ $status -eq 1 ] && grep -q "held-out loss is nan" "$work/diverged.out" ||
  fail "the diverged evaluation ended with $status: $(cat "$work/diverged.out")"
[ -f "$work/diverged/step_1/manifest.json" ] || fail "the failed evaluation lost the save of step 1"
echo "eval_every: after steps 2 4 6: $(record "$work/whole.jsonl" 2) $(record "$work/whole.jsonl" 4) $(closing whole); stopped and resumed alike"

#!/usr/bin/env bash
# `train --log-json` and `--trace` that name a file the run reads (--data, --schedule-file,
# --plan), each other, or the checkpoints of --save-dir or --resume are refused with exit 2
# before anything is opened, and the file they name is left as it was; so is an input inside
# the checkpoints of --save-dir, which a save or --keep would delete. A log kept next to the
# checkpoints, outside their latest and step_<N>, is the user's and still written.
# Usage: outputs_over_inputs.sh CLI DIR SCHEDULE_FILE
set -u
cli=$1
dir=$2
rm -rf "$dir" && mkdir -p "$dir" || exit 1
cp "$3" "$dir/schedule.txt" || exit 1
fail() { echo "outputs_over_inputs: $*" >&2; exit 1; }
small=(--device cpu --d-model 16 --layers 2 --vocab 64 --batch-tokens 64 --microbatches 2 --quiet)
for _ in $(seq 64); do printf 'the quick brown fox jumps over the lazy dog\n'; done >"$dir/data.txt"
"$cli" plan --device cpu --d-model 16 --layers 2 --vocab 64 --batch-tokens 64 --repetitions 1 \
  --stages 2 --out "$dir/plan.json" >/dev/null || fail "the plan failed"
"$cli" train "${small[@]}" --steps 2 --save-dir "$dir/ckpt" >/dev/null || fail "the first run failed"
ln -s data.txt "$dir/data_link.txt" || exit 1
sums() { (cd "$dir" && find . -type f -print0 | sort -z | xargs -0 md5sum); }
before=$(sums)
# refuse PATTERN ARGS...: exit 2, one error line matching PATTERN, no file changed.
refuse() {
  local pattern=$1
  shift
  local output status
  output=$("$cli" train "${small[@]}" "$@" 2>&1)
  status=$?
  [ "$status" -eq 2 ] || fail "exit status $status, expected 2, for: $* ($output)"
  grep -Eq -- "^conveyor: error: $pattern" <<<"$output" || fail "no /$pattern/ in: $output"
  [ "$(sums)" = "$before" ] || fail "a file changed or appeared for: $*"
}
refuse "--log-json and --trace both name '.*/same.json'; each writes a file of its own" \
  --steps 1 --log-json "$dir/same.json" --trace "$dir/./same.json"
refuse "--log-json file '.*/data.txt' is the file --data reads" \
  --steps 1 --data "$dir/data.txt" --log-json "$dir/data.txt"
refuse "--trace file '.*/data_link.txt' is the file --data reads" \
  --steps 1 --data "$dir/data.txt" --trace "$dir/data_link.txt"
refuse "--log-json file '.*/schedule.txt' is the file --schedule-file reads" \
  --steps 1 --schedule-file "$dir/schedule.txt" --log-json "$dir/schedule.txt"
refuse "--trace file '.*/plan.json' is the file --plan reads" \
  --steps 1 --plan "$dir/plan.json" --trace "$dir/plan.json"
refuse "--log-json file '.*/ckpt/latest' would overwrite the checkpoints of --save-dir '.*/ckpt/'" \
  --steps 4 --save-dir "$dir/ckpt/" --resume latest --log-json "$dir/ckpt/latest"
refuse "--log-json file '.*/ckpt/step_2/manifest.json' would overwrite the checkpoints of --resume '.*/ckpt/step_2'" \
  --steps 4 --resume "$dir/ckpt/step_2" --log-json "$dir/ckpt/step_2/manifest.json"
refuse "--trace file '.*/ckpt' would overwrite the checkpoints of --save-dir" \
  --steps 4 --save-dir "$dir/ckpt" --trace "$dir/ckpt"
# An input inside the checkpoints a save replaces or --keep removes.
cp "$dir/data.txt" "$dir/ckpt/step_2/corpus.txt" && cp "$dir/plan.json" "$dir/ckpt/step_2/plan.json" || exit 1
before=$(sums)
refuse "--data file '.*/ckpt/step_2/corpus.txt' lies in the checkpoints of --save-dir '.*/ckpt' \(its latest or a step_<N>\), which a save or --keep deletes" \
  --steps 4 --save-every 2 --keep 1 --save-dir "$dir/ckpt" --data "$dir/ckpt/step_2/corpus.txt"
refuse "--plan file '.*/ckpt/step_2/plan.json' lies in the checkpoints of --save-dir" \
  --steps 4 --save-dir "$dir/ckpt" --plan "$dir/ckpt/step_2/plan.json"
rm "$dir/ckpt/step_2/corpus.txt" "$dir/ckpt/step_2/plan.json"
before=$(sums)
# Both thrown away: nothing to destroy.
"$cli" train "${small[@]}" --steps 1 --log-json /dev/null --trace /dev/null >/dev/null ||
  fail "--log-json and --trace both /dev/null were refused"
# Next to the checkpoints: written.
"$cli" train "${small[@]}" --steps 4 --save-dir "$dir/ckpt" --resume latest \
  --log-json "$dir/ckpt/log.jsonl" >/dev/null || fail "a log next to the checkpoints was refused"
[ "$(wc -l <"$dir/ckpt/log.jsonl")" -eq 2 ] || fail "the log next to the checkpoints is not 2 lines"
"$cli" ckpt verify "$dir/ckpt" >/dev/null || fail "the checkpoints do not verify"
echo "outputs_over_inputs: ok"

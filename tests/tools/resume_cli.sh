#!/usr/bin/env bash
# `conveyor train --save-dir/--resume`: a run stopped and resumed logs the same losses as the
# uninterrupted one (also re-partitioned, also with --async-save); a run killed (SIGKILL)
# while writing a shard, committing, or between the folder's rename and `latest` leaves the
# previous checkpoint loadable and `latest` naming it, and the resumed run saves that step
# again; a checkpoint of another model is refused with exit 2 naming the difference; the same
# command run again into the folder of its saves is refused before it trains, not at its
# first save; a run whose last step is not saved exits 1, interrupted or not.
# Usage: resume_cli.sh CONVEYOR WORKDIR CASE
set -u
conveyor=$1
work=$2
case_name=$3
rm -rf "$work"
mkdir -p "$work"
dir=$work/ckpt
common=(--device cpu --steps 6 --batch-tokens 512 --microbatches 4 --vocab 32 --quiet)
model=(--d-model 32)

fail() {
  echo "resume_cli $case_name: $*" >&2
  exit 1
}

run() {
  "$conveyor" train "${common[@]}" "${model[@]}" "$@" >>"$work/log" 2>&1 || fail "'train $*' failed: $(tail -5 "$work/log")"
}

# step and loss of every logged step, in order
losses() { cut -d, -f1-2 "$@"; }

same_as_straight() {
  run --stages 4 --log-json "$work/straight.json"
  run --stages 4 --stop-after 3 --save-dir "$dir" --save-every 2 "$@" --log-json "$work/a.json"
  run "${second[@]}" --resume "$dir" --log-json "$work/b.json"
  diff <(losses "$work/straight.json") <(losses "$work/a.json" "$work/b.json") ||
    fail "the resumed run's losses differ from the uninterrupted run's"
  [ "$(wc -l <"$work/straight.json")" -eq 6 ] || fail "expected 6 logged steps"
}

# Saves step 2, then resumes and is killed inside the save of step 4 at pause point $1.
killed_in_save() {
  run --stop-after 2 --save-dir "$dir"
  CONVEYOR_TEST_PAUSE_IN_SAVE=$1 "$conveyor" train "${common[@]}" "${model[@]}" --save-dir "$dir" \
    --save-every 4 --resume latest >"$work/killed.log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do
    grep -q "paused in save at $1" "$work/killed.log" && break
    kill -0 "$pid" 2>/dev/null || fail "the run ended before pausing: $(cat "$work/killed.log")"
    sleep 0.1
  done
  grep -q "paused in save at $1" "$work/killed.log" || { kill -9 "$pid"; fail "no pause"; }
  kill -9 "$pid"
  wait "$pid" 2>/dev/null
  if [ "$1" = publish ]; then
    [ -f "$dir/step_4/manifest.json" ] || fail "expected step_4 renamed into place, unpublished"
  else
    [ -d "$dir/step_4.tmp" ] || fail "expected the unfinished save step_4.tmp"
  fi
  [ "$(cat "$dir/latest")" = "step_2" ] || fail "latest is '$(cat "$dir/latest")', expected step_2"
  "$conveyor" ckpt verify "$dir" >>"$work/log" 2>&1 || fail "the previous checkpoint does not verify"
  # The next run resumes from step 2 and its first save removes the unfinished one.
  run --save-dir "$dir" --save-every 4 --resume latest --log-json "$work/after.json"
  grep -q '"step":3' "$work/after.json" || fail "the resumed run did not start at step 3"
  [ ! -e "$dir/step_4.tmp" ] || fail "the unfinished save was not removed"
  [ -f "$dir/step_4/manifest.json" ] || fail "step 4 was not saved again"
  [ "$(cat "$dir/latest")" = "step_6" ] || fail "latest is '$(cat "$dir/latest")', expected step_6"
}

manifest=$dir/step_2/manifest.json
# refused EDIT PATTERN: $work/manifest.json with EDIT (python on m) in place of the manifest
# of step 2 is refused by the resume (exit 2) and by ckpt verify (exit 1), each saying PATTERN.
refused() {
  python3 -c "import json,sys; m=json.load(open(sys.argv[1])); $1; json.dump(m, open(sys.argv[2], 'w'))" \
    "$work/manifest.json" "$manifest" || fail "cannot edit the manifest"
  local command output status want
  for command in "train ${common[*]} ${model[*]} --resume $dir" "ckpt verify $dir"; do
    output=$(timeout 60 "$conveyor" $command 2>&1)
    status=$?
    echo "$output"
    case $command in train*) want=2 ;; *) want=1 ;; esac
    [ "$status" -eq "$want" ] || fail "$1: '$command' exited with $status, expected $want"
    grep -qF -- "$2" <<<"$output" || fail "$1: '$command' does not say '$2'"
  done
}

case $case_name in
  exact_p4)
    second=(--stages 4)
    same_as_straight
    ;;
  exact_repartition)
    second=(--stages 2 --schedule zbh1)
    same_as_straight
    ;;
  exact_async)
    second=(--stages 4)
    same_as_straight --async-save
    ;;
  exact_sharded)
    # ZeRO-1 state in pieces, saved by all four ranks, resumed with another stage count and
    # the same replicas (the same gradient sums): the losses of the straight run.
    sharded=(--dp 2 --shard-optimizer)
    run --stages 2 "${sharded[@]}" --log-json "$work/straight.json"
    run --stages 2 "${sharded[@]}" --stop-after 3 --save-dir "$dir" --save-every 2 \
      --log-json "$work/a.json"
    [ -f "$dir/step_2/rank_3.safetensors" ] || fail "replica 1 saved no shard of its moments"
    "$conveyor" ckpt verify "$dir" >>"$work/log" 2>&1 || fail "the sharded checkpoint does not verify"
    "$conveyor" ckpt inspect "$dir" >"$work/inspect.txt" 2>&1 || fail "inspect failed"
    grep -Eq "optimizer.m.blocks.0.fc1.weight .* [12] pieces?" "$work/inspect.txt" ||
      fail "inspect shows no pieces: $(head -40 "$work/inspect.txt")"
    run --stages 1 "${sharded[@]}" --resume "$dir" --log-json "$work/b.json"
    diff <(losses "$work/straight.json") <(losses "$work/a.json" "$work/b.json") ||
      fail "the resumed run's losses differ from the uninterrupted run's"
    # And into one replica, unsharded: it runs to the end from the saved state.
    run --stages 2 --resume "$dir/step_2" --log-json "$work/c.json"
    [ "$(wc -l <"$work/c.json")" -eq 4 ] || fail "expected 4 steps after step 2"
    ;;
  kill_in_shard) killed_in_save shard ;;
  kill_in_commit) killed_in_save commit ;;
  kill_before_publish) killed_in_save publish ;;
  rerun_into_saves)
    run --save-dir "$dir" --save-every 2
    output=$("$conveyor" train "${common[@]}" "${model[@]}" --save-dir "$dir" --save-every 2 2>&1)
    status=$?
    echo "$output"
    [ "$status" -eq 2 ] || fail "exit status $status, expected 2"
    grep -q "^conveyor: error: --save-dir .* would refuse a save of this run: cannot save step 2: .*step_2' exists already; remove it or save into another folder$" \
      <<<"$output" || fail "the refusal does not name the first save and its folder"
    ! grep -q "^done " <<<"$output" || fail "the run trained before refusing"
    # Resumed from there it saves on.
    longer=("${common[@]}")
    longer[3]=8  # the value of --steps
    "$conveyor" train "${longer[@]}" "${model[@]}" --save-dir "$dir" --save-every 2 --resume latest \
      >>"$work/log" 2>&1 || fail "the resumed run failed: $(tail -5 "$work/log")"
    [ "$(cat "$dir/latest")" = "step_8" ] || fail "latest is '$(cat "$dir/latest")', expected step_8"
    ;;
  other_model)
    run --stop-after 2 --save-dir "$dir"
    output=$("$conveyor" train "${common[@]}" --d-model 16 --resume "$dir" 2>&1)
    status=$?
    echo "$output"
    [ "$status" -eq 2 ] || fail "exit status $status, expected 2"
    grep -q "another model: --d-model 32 in the checkpoint, 16 in this run; --hidden 128 in the checkpoint, 64 in this run" <<<"$output" ||
      fail "the refusal does not name the difference"
    ;;
  changed_settings)
    # Another learning rate, warm-up or total steps is the user's call and is said, one line
    # each; another batch size would start the next step's tokens elsewhere and is refused.
    run --stop-after 2 --save-dir "$dir" --lr 0.002 --warmup 1
    longer=("${common[@]}")
    longer[3]=8  # the value of --steps
    output=$("$conveyor" train "${longer[@]}" "${model[@]}" --lr 0.004 --warmup 1 --resume "$dir" 2>&1) ||
      fail "the resume with another --lr failed: $output"
    echo "$output"
    grep -q "^note   resuming with --lr 0.004 where the checkpoint was saved with 0.002$" <<<"$output" ||
      fail "the change of --lr is not said"
    grep -q "^note   resuming with --steps 8 where the checkpoint was saved with 6 " <<<"$output" ||
      fail "the change of --steps is not said"
    [ "$(grep -c "^note   resuming" <<<"$output")" -eq 2 ] || fail "expected exactly two notes"
    smaller=("${common[@]}")
    smaller[5]=256  # the value of --batch-tokens
    output=$("$conveyor" train "${smaller[@]}" "${model[@]}" --resume "$dir" 2>&1)
    status=$?
    echo "$output"
    [ "$status" -eq 2 ] || fail "another --batch-tokens: exit status $status, expected 2"
    grep -q "resume with --batch-tokens 512" <<<"$output" || fail "the refusal does not say what to do"
    ;;
  inherited)
    # The flags left out take the checkpoint's settings, not their defaults: `--resume DIR`
    # alone goes on as the saved run, bitwise, and says which settings it took; a flag given
    # still changes its setting.
    saved=(--device cpu --steps 7 --batch-tokens 384 --microbatches 3 --vocab 48 --d-model 24
           --layers 3 --hidden 40 --activation relu --seed 5 --optimizer sgd --lr 0.02
           --min-lr 0.001 --warmup 2 --weight-decay 0.01 --clip 0.5 --quiet --weights-checksum)
    "$conveyor" train "${saved[@]}" >"$work/straight.out" 2>&1 || fail "the whole run failed: $(cat "$work/straight.out")"
    "$conveyor" train "${saved[@]}" --stop-after 3 --save-dir "$dir" >>"$work/log" 2>&1 ||
      fail "the first part failed: $(tail -5 "$work/log")"
    output=$("$conveyor" train --device cpu --quiet --weights-checksum --resume "$dir" 2>&1) ||
      fail "the resume with no other flag failed: $output"
    echo "$output"
    [ "$(grep '^weights xxh3' <<<"$output")" = "$(grep '^weights xxh3' "$work/straight.out")" ] ||
      fail "the resumed weights differ from the whole run's: $(grep '^weights' "$work/straight.out")"
    grep -q "^note   the checkpoint's settings, for the flags left out: the model tiny (d=24, L=3, V=48, hidden=40, relu, [0-9]* parameters), --batch-tokens 384, --seed 5, --steps 7, --microbatches 3, --optimizer sgd, --lr 0.02, --min-lr 0.001, --warmup 2, --weight-decay 0.01, --clip 0.5$" <<<"$output" ||
      fail "the settings taken are not said"
    ! grep -q "^note   resuming" <<<"$output" || fail "a setting left out is said as changed"
    output=$("$conveyor" train --device cpu --quiet --resume "$dir" --lr 0.03 --steps 8 2>&1) ||
      fail "the resume with --lr and --steps failed: $output"
    grep -q "^note   resuming with --lr 0.03 where the checkpoint was saved with 0.02$" <<<"$output" ||
      fail "the --lr given is not said as a change"
    grep -q "^note   the checkpoint's settings, for the flags left out: the model .*, --batch-tokens 384, --seed 5, --microbatches 3, --optimizer sgd, --min-lr 0.001, " <<<"$output" ||
      fail "the settings given are said as taken"
    ;;
  inherited_refusals)
    # A refusal that speaks of a setting the resume took from the checkpoint says so (the user
    # never typed it); a --min-lr the given --lr lowers is not said to be the checkpoint's; a
    # double is said as typed (0, not 0.0); a model flag given alone, with which the others
    # keep their defaults, is said to be why another model is refused.
    "$conveyor" train --device cpu --quiet --steps 4 --batch-tokens 384 --microbatches 3 --vocab 32 \
      --d-model 16 --layers 3 --lr 0.02 --min-lr 0.001 --clip 0 --stop-after 2 --save-dir "$dir" \
      >>"$work/log" 2>&1 || fail "the first part failed: $(tail -5 "$work/log")"
    refused() {
      output=$("$conveyor" train --device cpu --quiet --resume "$dir" "$@" 2>&1)
      status=$?
      [ "$status" -eq 2 ] || fail "--resume with $*: exit status $status, expected 2: $output"
    }
    refused --microbatches 5
    grep -q "^conveyor: error: the batch of --batch-tokens 384 cannot be split into --microbatches 5 .* (--batch-tokens 384 is the checkpoint's, which --resume takes for the flags left out)$" <<<"$output" ||
      fail "--microbatches 5: the refusal does not say that --batch-tokens 384 is the checkpoint's: $output"
    refused --dp 2
    grep -q "(--microbatches 3 is the checkpoint's, which --resume takes for the flags left out)$" <<<"$output" ||
      fail "--dp 2: the refusal does not say that --microbatches 3 is the checkpoint's: $output"
    refused --min-lr 0.05
    grep -q "(--lr 0.02 is the checkpoint's, which --resume takes for the flags left out)$" <<<"$output" ||
      fail "--min-lr 0.05: the refusal does not say that --lr 0.02 is the checkpoint's: $output"
    "$conveyor" plan --stages 2 --batch-tokens 256 --vocab 32 --d-model 16 --layers 3 \
      --out "$work/plan256.json" >>"$work/log" 2>&1 || fail "conveyor plan failed: $(tail -5 "$work/log")"
    refused --stages 2 --plan "$work/plan256.json"
    grep -q "was planned for --batch-tokens 256 and this run has 384; .* (--batch-tokens 384 is the checkpoint's, which --resume takes for the flags left out)$" <<<"$output" ||
      fail "a plan for another batch: the refusal does not say that --batch-tokens 384 is the checkpoint's: $output"
    refused --d-model 16
    grep -q "another model: .*(with --d-model given, --resume takes none of the model's settings from the checkpoint" <<<"$output" ||
      fail "--d-model alone: the refusal does not say why the model is not the checkpoint's: $output"
    output=$("$conveyor" train --device cpu --quiet --resume "$dir" --lr 0.0005 2>&1) ||
      fail "the resume with --lr 0.0005 failed: $output"
    grep -q "^note   the checkpoint's settings, for the flags left out: the model .*, --batch-tokens 384, --steps 4, --microbatches 3, --clip 0$" <<<"$output" ||
      fail "--lr 0.0005: the settings taken are not said as they are: $(grep '^note' <<<"$output")"
    grep -q "^note   resuming with --min-lr 0.0005 where the checkpoint was saved with 0.001$" <<<"$output" ||
      fail "--lr 0.0005: the lowered --min-lr is not said"
    ;;
  bad_manifest)
    # A manifest edited out of agreement with itself is refused at once (exit 2, naming the
    # file and field), never replayed or loaded: a data position of 2^64-1 would take ages.
    run --stop-after 2 --save-dir "$dir"
    cp "$manifest" "$work/manifest.json"
    refused "m['data']['position'] = 2**64 - 1" "manifest.json': manifest.data.position is 18446744073709551615, expected step x rng.batch_tokens = 2 x 512 = 1024"
    refused "m['stages'][0]['units'][1] += 3" "manifest.stages end at unit"
    refused "m['optimizer']['steps_taken'] = 10**15" "manifest.optimizer.steps_taken is 1000000000000000"
    refused "m['lr_schedule']['step'] = 99" "manifest.lr_schedule.step is 99"
    refused "m['data']['token'] = -1" "manifest.data.token is -1, expected an integer >= 0"
    # A token that passes every check of its own is still another token: the manifest's
    # checksum of its training state refuses it, and so any other edit of those fields.
    refused "m['data']['token'] = (m['data']['token'] + 1) % 32" "manifest.json': the training state (step, optimizer, lr_schedule, data, rng) does not match its checksum"
    refused "m['rng'] = None" "does not match its checksum"
    # Only the fingerprint edited: it no longer fingerprints the model description beside it,
    # which the loader names, with both fingerprints, before any comparison with this run.
    python3 -c "import json,sys; m=json.load(open(sys.argv[1])); m['model_fingerprint'] = 'xxh3_64:0000000000000000'; json.dump(m, open(sys.argv[2], 'w'))" \
      "$work/manifest.json" "$manifest" || fail "cannot edit the manifest"
    output=$("$conveyor" train "${common[@]}" "${model[@]}" --resume "$dir" 2>&1)
    echo "$output"
    grep -q "the model description does not match its fingerprint manifest.model_fingerprint (xxh3_64:0000000000000000; the description's is xxh3_64:[0-9a-f]\{16\}): the file was edited or corrupted" <<<"$output" ||
      fail "the refusal of an edited fingerprint does not name both"
    ;;
  manifest_without_checksums)
    # A manifest of before state_xxh3_64 and manifest_xxh3_64 were recorded: verify says that
    # it checked the shards' checksums and the manifest's rules, not that every checksum
    # matches, and refuses what a resume refuses of the manifest with the same sentence.
    run --stop-after 2 --save-dir "$dir"
    python3 -c "import json,sys; m=json.load(open(sys.argv[1])); del m['state_xxh3_64'], m['manifest_xxh3_64']; json.dump(m, open(sys.argv[1], 'w'))" \
      "$manifest" || fail "cannot edit the manifest"
    cp "$manifest" "$work/manifest.json"
    output=$("$conveyor" ckpt verify "$dir" 2>&1) || fail "verify refused the old manifest: $output"
    echo "$output"
    grep -q "^ok: .*step_2, step 2: .* every tensor's and shard file's checksum matches; the manifest has no state_xxh3_64 or manifest_xxh3_64 (written before they were recorded), so its fields were checked against the format's rules and the shards only" \
      <<<"$output" || fail "verify does not say what it checked"
    ! grep -q "every checksum matches" <<<"$output" || fail "verify claims checksums the manifest lacks"
    refused "m['data']['token'] = 9999" "manifest.json': manifest.data.token is 9999, expected a token id below manifest.model.vocab 32"
    refused "m['rng'] = 'x'" "manifest.json': manifest.rng is \"x\", expected the {\"seed\", \"batch_tokens\"} a training run saves"
    refused "m['rng'] = {'seed': 1}" "manifest.rng is {\"seed\":1}, expected"
    cp "$work/manifest.json" "$manifest"
    run --resume "$dir" --log-json "$work/rest.json"
    [ "$(wc -l <"$work/rest.json")" -eq 4 ] || fail "expected steps 3 to 6 after step 2"
    ;;
  data_contents)
    # --data is matched by the digest of the file's bytes the checkpoint records: the same
    # bytes by another path, absolute or under another name resume, a note saying so; one
    # byte changed in place (the same size) is refused. A checkpoint without the digest
    # (written before it was recorded) is matched by the path as typed and the size. Another
    # --seed is said to change nothing.
    cd "$work" || fail "cannot enter $work"
    python3 -c "import random; r = random.Random(3); open('d.txt', 'w').write(''.join(r.choice('abcdefgh \n') for _ in range(4096)))"
    mkdir explore && cp d.txt explore/d.txt && cp d.txt d2.txt
    on_file=(--device cpu --steps 6 --batch-tokens 512 --microbatches 4 --vocab 256 --d-model 32 --quiet)
    "$conveyor" train "${on_file[@]}" --data d.txt --stop-after 2 --save-dir ck >>log 2>&1 ||
      fail "the first run failed: $(tail -5 log)"
    grep -q '"contents": "xxh3_64:[0-9a-f]\{16\}"' ck/step_2/manifest.json ||
      fail "the manifest records no digest of the data: $(cat ck/step_2/manifest.json)"
    # --data left out: --resume does not take it, and the refusal names the flag.
    output=$("$conveyor" train "${on_file[@]}" --resume ck 2>&1)
    [ $? -eq 2 ] && grep -q "but this run reads Markov chain .*; resume with the same data (--data FILE) and seed (--seed)$" <<<"$output" ||
      fail "a resume without --data is not refused naming it: $output"
    # A checkpoint of the Markov chain resumed with --data is refused for its data, not for
    # the vocab of 256 that --data alone gives the preset's model.
    on_chain=(--device cpu --steps 6 --batch-tokens 512 --microbatches 4 --quiet)
    "$conveyor" train "${on_chain[@]}" --stop-after 2 --save-dir chain >>log 2>&1 ||
      fail "the run on the Markov chain failed: $(tail -5 log)"
    output=$("$conveyor" train "${on_chain[@]}" --data d.txt --resume chain 2>&1)
    [ $? -eq 2 ] && grep -q "^conveyor: error: .*manifest.json' was trained on Markov chain (vocab 64, .* but this run reads bytes of 'd.txt' (4096 tokens, vocab 256); resume with the same data (--data FILE) and seed (--seed)$" <<<"$output" ||
      fail "a Markov checkpoint resumed with --data is not refused for its data: $output"
    # The preset's model on --data (vocab 256) is what the flags give: resumed, it is not said
    # to be the checkpoint's.
    "$conveyor" train "${on_chain[@]}" --data d.txt --stop-after 2 --save-dir bytes >>log 2>&1 ||
      fail "the run on d.txt without model flags failed: $(tail -5 log)"
    output=$("$conveyor" train "${on_chain[@]}" --data d.txt --resume bytes 2>&1) ||
      fail "the resume on d.txt without model flags failed: $output"
    ! grep -q "^note   the checkpoint's settings" <<<"$output" ||
      fail "the model the flags give with --data is said to be the checkpoint's: $output"
    # Held-out batches past the file, with the checkpoint's --steps: the refusal says whose
    # --steps it counts.
    output=$("$conveyor" train --device cpu --batch-tokens 512 --microbatches 4 --vocab 256 \
      --d-model 32 --quiet --data d.txt --eval-batches 2 --resume ck 2>&1)
    [ $? -eq 2 ] && grep -q "^conveyor: error: --eval-batches 2 needs 4097 bytes of --data (6 training batches and 2 held-out batches .*, or fewer --steps (--steps 6 is the checkpoint's, which --resume takes for the flags left out)$" <<<"$output" ||
      fail "held-out batches past the file do not say that --steps is the checkpoint's: $output"
    for data in ./explore/d.txt "$work/d.txt" d2.txt; do
      output=$("$conveyor" train "${on_file[@]}" --data "$data" --resume ck 2>&1) ||
        fail "--data $data: the resume failed: $output"
      echo "$output"
      grep -q "^note   resuming on bytes of '$data' (4096 tokens, vocab 256) where the checkpoint was trained on bytes of 'd.txt' (4096 tokens, vocab 256): the same bytes (xxh3_64:[0-9a-f]\{16\}) under another path$" \
        <<<"$output" || fail "--data $data: the other name is not said"
    done
    output=$("$conveyor" train "${on_file[@]}" --data d.txt --resume ck 2>&1) ||
      fail "the resume on the same file failed: $output"
    ! grep -q "^note   resuming" <<<"$output" || fail "a note for the same file: $output"
    # Another --seed: it drew the weights, which are the checkpoint's, and the data are the
    # file's, so the run is the one under the saved seed (1), and a note says so.
    same=$("$conveyor" train "${on_file[@]}" --data d.txt --resume ck --seed 1 2>&1) ||
      fail "the resume under the saved --seed failed: $same"
    ! grep -q "^note   resuming" <<<"$same" || fail "a note for the saved --seed: $same"
    output=$("$conveyor" train "${on_file[@]}" --data d.txt --resume ck --seed 2 2>&1) ||
      fail "the resume under another --seed failed: $output"
    grep -q "^note   resuming with --seed 2 where the checkpoint was saved with 1, to no effect: the seed draws the initial weights and the Markov chain's tokens, and this run takes its weights from the checkpoint and its tokens from bytes of 'd.txt' (4096 tokens, vocab 256)$" \
      <<<"$output" || fail "another --seed is not said to change nothing: $output"
    [ "$(grep "^loss " <<<"$output")" = "$(grep "^loss " <<<"$same")" ] ||
      fail "another --seed changed the resumed run: $output, against $same"
    printf 'Z' | dd of=d2.txt bs=1 seek=100 conv=notrunc status=none
    output=$("$conveyor" train "${on_file[@]}" --data d2.txt --resume ck 2>&1)
    status=$?
    echo "$output"
    [ "$status" -eq 2 ] || fail "edited data: exit status $status, expected 2"
    grep -q "^conveyor: error: .*manifest.json' was trained on bytes of 'd.txt' (4096 tokens, vocab 256), whose bytes have digest xxh3_64:[0-9a-f]\{16\}, but this run reads bytes of 'd2.txt' (4096 tokens, vocab 256) with digest xxh3_64:[0-9a-f]\{16\}: other data; resume with the data it was trained on$" \
      <<<"$output" || fail "the refusal of other bytes is not the sentence expected"
    python3 -c "import json,sys; m=json.load(open(sys.argv[1])); del m['data']['contents'], m['state_xxh3_64'], m['manifest_xxh3_64']; json.dump(m, open(sys.argv[1], 'w'))" \
      ck/step_2/manifest.json || fail "cannot edit the manifest"
    "$conveyor" train "${on_file[@]}" --data d.txt --resume ck >>log 2>&1 ||
      fail "the checkpoint without a digest does not resume on its file: $(tail -5 log)"
    output=$("$conveyor" train "${on_file[@]}" --data ./explore/d.txt --resume ck 2>&1)
    status=$?
    echo "$output"
    [ "$status" -eq 2 ] || fail "without a digest, another path: exit status $status, expected 2"
    grep -q "was trained on bytes of 'd.txt' (4096 tokens, vocab 256) but this run reads bytes of './explore/d.txt'" \
      <<<"$output" || fail "without a digest, another path is not refused by name"
    ;;
  stop_after_past_steps)
    # Resumed with a --stop-after past --steps, the run says so and trains to --steps; resumed
    # again at its end it is refused, naming the one limit to raise, without the note.
    run --stop-after 2 --save-dir "$dir"
    output=$("$conveyor" train "${common[@]}" "${model[@]}" --stop-after 10 --save-dir "$dir" \
      --resume latest --log-json "$work/rest.json" 2>&1) || fail "the resumed run failed: $output"
    echo "$output"
    grep -q "^note   --stop-after 10 is past --steps 6: the run ends at step 6 " <<<"$output" ||
      fail "the --stop-after past --steps is not said"
    [ "$(wc -l <"$work/rest.json")" -eq 4 ] || fail "expected steps 3 to 6 after step 2"
    ! grep -q "^stopped at step" <<<"$output" || fail "a run that reached --steps says it stopped early"
    [ "$(cat "$dir/latest")" = "step_6" ] || fail "latest is '$(cat "$dir/latest")', expected step_6"
    output=$("$conveyor" train "${common[@]}" "${model[@]}" --stop-after 10 --resume "$dir" 2>&1)
    status=$?
    echo "$output"
    [ "$status" -eq 2 ] || fail "resumed at --steps: exit status $status, expected 2"
    grep -q "^conveyor: error: nothing to train: the run is at step 6 and stops at step 6 (--steps); raise --steps$" \
      <<<"$output" || fail "the refusal does not name --steps as the limit to raise"
    ! grep -q "^note   --stop-after" <<<"$output" || fail "a refused run printed the note"
    output=$("$conveyor" train "${common[@]}" "${model[@]}" --stop-after 4 --resume "$dir" 2>&1)
    grep -q "^conveyor: error: nothing to train: the run is at step 6 and stops at step 4 (--stop-after); raise --stop-after$" \
      <<<"$output" || fail "the refusal does not name --stop-after as the limit to raise: $output"
    # A --steps below the checkpoint's step is refused by the resume; one step is one step.
    one_step=("${common[@]}")
    one_step[3]=1  # the value of --steps
    output=$("$conveyor" train "${one_step[@]}" "${model[@]}" --resume "$dir" 2>&1)
    grep -q "^conveyor: error: .*manifest.json' is of step 6 but this run has only 1 step; raise --steps to train past the checkpoint$" \
      <<<"$output" || fail "the refusal of --steps 1 does not say it: $output"
    ;;
  rerun_after_keep)
    # --keep 1 leaves only step_6; another run into the folder would save step 2, moving
    # `latest` back, and then replace step_6 as if a crash had left it: it is refused first.
    run --save-dir "$dir" --save-every 2 --keep 1
    before=$(cat "$dir/step_6/manifest.json")
    output=$("$conveyor" train "${common[@]}" "${model[@]}" --seed 2 --save-dir "$dir" \
      --save-every 2 --keep 1 2>&1)
    status=$?
    echo "$output"
    [ "$status" -eq 2 ] || fail "exit status $status, expected 2"
    grep -q "would refuse a save of this run: cannot save step 2: 'latest' of .* names step 6, a later checkpoint" \
      <<<"$output" || fail "the refusal does not name the later checkpoint"
    [ "$(cat "$dir/step_6/manifest.json")" = "$before" ] || fail "step_6 was replaced"
    [ "$(cat "$dir/latest")" = "step_6" ] || fail "latest is '$(cat "$dir/latest")', expected step_6"
    ;;
  fresh_run_into_unpublished)
    # A step folder newer than `latest`, or in a folder without one, is replaced only by the
    # run that resumed from the folder (its own save, unpublished); a fresh run is refused
    # before it trains, and the folder is left as it was.
    run --save-dir "$dir" --save-every 2
    before=$(cat "$dir/step_6/manifest.json")
    for latest in step_4 none; do
      if [ "$latest" = none ]; then rm "$dir/latest"; else echo "$latest" >"$dir/latest"; fi
      output=$("$conveyor" train "${common[@]}" "${model[@]}" --seed 2 --save-dir "$dir" 2>&1)
      status=$?
      echo "$output"
      [ "$status" -eq 2 ] || fail "latest $latest: exit status $status, expected 2"
      case $latest in
        none) why=" (no 'latest'), and this run does not continue the folder's run: it did not resume from it" ;;
        *) why=", newer than the step 'latest' names, and this run does not continue the folder's run: it did not resume from it" ;;
      esac
      grep -qF "would refuse a save of this run: cannot save step 6: '$dir/step_6' exists already$why; remove it or save into another folder" \
        <<<"$output" || fail "latest $latest: the refusal does not say why"
      ! grep -q "^done " <<<"$output" || fail "latest $latest: the run trained before refusing"
      [ "$(cat "$dir/step_6/manifest.json")" = "$before" ] || fail "latest $latest: step_6 was replaced"
    done
    # Resumed from the folder, the run is the folder's own and replaces it.
    echo step_4 >"$dir/latest"
    run --save-dir "$dir" --resume latest
    [ "$(cat "$dir/latest")" = "step_6" ] || fail "latest is '$(cat "$dir/latest")', expected step_6"
    ;;
  save_fails_continue)
    # Under --on-save-error continue, saves that fail (the file size limit, with SIGXFSZ
    # ignored: each shard write fails with EFBIG) are each reported once, training goes on,
    # and a run whose last step is not saved says so and exits 1; with --async-save the
    # same, no `saved` line for a write that failed.
    for async in "" --async-save; do
      output=$(trap '' XFSZ; ulimit -f 4; "$conveyor" train "${common[@]}" "${model[@]}" \
        --save-dir "$dir$async" --save-every 2 --on-save-error continue $async 2>&1)
      status=$?
      echo "$output"
      [ "$status" -eq 1 ] || fail "'$async': exit status $status, expected 1"
      grep -q "^done   6 steps" <<<"$output" || fail "'$async': training did not go on"
      [ "$(grep -c "warning: checkpoint not saved" <<<"$output")" -eq 3 ] ||
        fail "'$async': expected one warning for each of the saves of steps 2, 4 and 6"
      grep -q "^not saved: step 6, the run's last (see the warning); this run saved no checkpoint into " \
        <<<"$output" || fail "'$async': the unsaved last step is not said"
      ! grep -q "^saved " <<<"$output" || fail "'$async': a failed save is said to be saved"
      [ ! -e "$dir$async/latest" ] || fail "'$async': latest exists"
    done
    ;;
  save_fails_interrupted)
    # So for a run interrupted (SIGINT) under --on-save-error continue whose closing save of
    # its last step fails: it says so and exits 1, not 130, which would say the step was saved
    # for --resume. Its output goes through a FIFO, which the file size limit does not cut.
    mkfifo "$work/out.fifo"
    cat "$work/out.fifo" >"$work/out" &
    reader=$!
    bash -c 'trap "" XFSZ; ulimit -f 4; exec "$@"' _ "$conveyor" train --device cpu \
      --steps 1000000 --batch-tokens 512 --microbatches 4 --vocab 32 "${model[@]}" --log-every 1 \
      --save-dir "$dir" --on-save-error continue >"$work/out.fifo" 2>&1 &
    pid=$!
    for _ in $(seq 600); do
      [ "$(grep -c "^step " "$work/out")" -ge 3 ] && break
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -INT "$pid"
    wait "$pid"
    status=$?
    wait "$reader"
    output=$(cat "$work/out")
    echo "$output"
    [ "$status" -eq 1 ] || fail "exit status $status, expected 1"
    step=$(sed -n 's/^interrupted at step \([0-9]*\) .*/\1/p' <<<"$output")
    [ -n "$step" ] || fail "the run was not interrupted"
    grep -q "^not saved: step $step, the run's last (see the warning); this run saved no checkpoint into " \
      <<<"$output" || fail "the unsaved last step is not said"
    [ ! -e "$dir/latest" ] || fail "latest exists"
    ;;
  no_checkpoint)
    # A --resume that names no checkpoint is refused before the model is built and the run
    # described: the refusal is all the run prints. A folder in the place of `latest` is said
    # as such.
    mkdir -p "$work/in_the_way/latest"
    for given in "absent|$work/absent|no checkpoint at '$work/absent': it does not exist; give DIR, DIR/latest or DIR/step_<N>" \
      "latest folder|latest --save-dir $work/in_the_way|'$work/in_the_way/latest' is a folder, where a file naming the newest checkpoint of '$work/in_the_way' is expected; remove or rename the folder, or give one of the step_<N> folders"; do
      IFS='|' read -r what flags message <<<"$given"
      # shellcheck disable=SC2086 # $flags: the path, or latest and --save-dir DIR
      output=$(timeout 60 "$conveyor" train "${common[@]}" "${model[@]}" --resume $flags 2>&1)
      status=$?
      echo "$output"
      [ "$status" -eq 2 ] || fail "$what: exit status $status, expected 2"
      [ "$output" = "conveyor: error: $message" ] ||
        fail "$what: expected the refusal alone, got: $output"
    done
    ;;
  *) fail "unknown case" ;;
esac
echo "resume_cli $case_name: ok"

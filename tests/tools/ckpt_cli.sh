#!/usr/bin/env bash
# The `conveyor ckpt` commands on a checkpoint written by the hidden `ckpt demo`: what
# inspect prints, and verify's exit status (0 all match, 1 naming the bad tensor or file) for
# a sound checkpoint and for damaged copies of it.
# Usage: ckpt_cli.sh CONVEYOR WORKDIR CASE
set -u
conveyor=$1
work=$2
case_name=$3
rm -rf "$work"
mkdir -p "$work"
dir=$work/ckpt

fail() {
  echo "ckpt_cli $case_name: $*" >&2
  exit 1
}

# expect STATUS PATTERN COMMAND...: runs COMMAND, checks its status and that its output
# (stdout and stderr) matches PATTERN.
expect() {
  local want=$1 pattern=$2
  shift 2
  local output status
  output=$("$@" 2>&1)
  status=$?
  echo "$output"
  [ "$status" -eq "$want" ] || fail "'$*' exited with $status, expected $want"
  grep -Eq -- "$pattern" <<<"$output" || fail "the output of '$*' does not match /$pattern/"
}

# flip_byte FILE OFFSET: xors the byte at OFFSET of FILE.
flip_byte() {
  local file=$1 offset=$2 byte
  byte=$(od -An -tu1 -j "$offset" -N1 "$file" | tr -d ' ')
  printf "$(printf '\\%03o' $(((byte ^ 0x5a) & 0xff)))" |
    dd of="$file" bs=1 seek="$offset" conv=notrunc status=none
}

expect 0 "wrote .*step_2 \(2 shards\)" "$conveyor" ckpt demo "$dir" --step 2
shard1=$dir/step_2/rank_1.safetensors

case $case_name in
  inspect)
    expect 0 "step 2" "$conveyor" ckpt inspect "$dir"
    expect 0 "^ +name +dtype +shape +bytes +shard +xxh3_64" "$conveyor" ckpt inspect "$dir"
    expect 0 "blocks\.1\.gain +BF16 +\[3, 5\] +30 +rank_1\.safetensors +[0-9a-f]{16}" \
      "$conveyor" ckpt inspect "$dir/latest"
    expect 0 "optimizer\.v\.blocks\.0\.fc1\.weight +F32 +\[8, 4\] +128 +rank_0\.safetensors" \
      "$conveyor" ckpt inspect "$dir/step_2"
    expect 0 "blocks\.0\.token_counts +I32 +\[6\] +24 .* -?[0-9]+ -?[0-9]+$" \
      "$conveyor" ckpt inspect "$dir" --values 2
    expect 0 "total: 16 tensors, 1068 bytes of data, 2 shards" "$conveyor" ckpt inspect "$dir"
    expect 0 "\"xxh3_64\": \"[0-9a-f]{16}\"" "$conveyor" ckpt inspect "$dir" --json
    ;;
  inspect_data)
    # The data line shows the digest a --data resume is matched by, as the manifest holds it.
    seq 1 1000 >"$work/data.txt"
    expect 0 "done +1 step" "$conveyor" train --device cpu --data "$work/data.txt" --steps 1 \
      --batch-tokens 64 --microbatches 1 --quiet --save-dir "$work/run"
    digest=$(grep -Eo '"contents": *"xxh3_64:[0-9a-f]{16}"' "$work/run/step_1/manifest.json" |
      grep -Eo 'xxh3_64:[0-9a-f]{16}')
    [ -n "$digest" ] || fail "the manifest holds no data.contents"
    expect 0 "^  data +.*, position 64, contents $digest$" "$conveyor" ckpt inspect "$work/run"
    ;;
  inspect_replicas)
    # A training run's replica count, which a resume compares with its own, is on the
    # schedule line and in the JSON; the demo's writer records none and shows none.
    expect 0 "done +2 steps" "$conveyor" train --device cpu --steps 2 --batch-tokens 64 \
      --microbatches 2 --dp 2 --quiet --save-dir "$work/run"
    expect 0 "^  schedule +1f1b, 2 micro-batches over 2 data-parallel replicas$" \
      "$conveyor" ckpt inspect "$work/run"
    expect 0 '^    "data_parallel": 2,$' "$conveyor" ckpt inspect "$work/run" --json
    output=$("$conveyor" ckpt inspect "$dir") || fail "inspect failed on the demo"
    grep -q "^  schedule     1f1b, 4 micro-batches$" <<<"$output" ||
      fail "the demo's schedule line is not '1f1b, 4 micro-batches': $output"
    ;;
  inspect_control)
    # Names and strings a hand put into the headers or the manifest are shown with their
    # control characters escaped, as errors show them: none reaches the terminal.
    python3 - "$shard1" <<'EOF' || fail "cannot edit the shard"
import json, struct, sys
path = sys.argv[1]
data = open(path, "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
bad = "blocks.1.ga\u001b[2Jin\n"
header[bad] = header.pop("blocks.1.gain")
header["__metadata__"]["xxh3_64:" + bad] = header["__metadata__"].pop("xxh3_64:blocks.1.gain")
text = json.dumps(header, separators=(",", ":")).encode()
text += b" " * (-len(text) % 8)
open(path, "wb").write(struct.pack("<Q", len(text)) + text + data[8 + n:])
EOF
    # The manifest without its own checksums, listing the shard's new size; its checksum,
    # which python3 cannot compute here, is the one verify reports.
    edit() {
      python3 -c "import json,sys; p=sys.argv[1]; m=json.load(open(p)); exec(sys.argv[2]); json.dump(m, open(p, 'w'))" \
        "$manifest" "$1" || fail "cannot edit the manifest"
    }
    manifest=$dir/step_2/manifest.json
    edit "del m['state_xxh3_64'], m['manifest_xxh3_64']; m['shards'][1]['bytes'] = $(stat -c %s "$shard1")
m['schedule']['name'] = '1f1b\x1b[2J\nx'; m['data']['source'] = 'demo\x07 tokens'"
    sum=$("$conveyor" ckpt verify "$dir" 2>&1 | grep -Eo "has XXH3-64 [0-9a-f]{16}" | grep -Eo "[0-9a-f]{16}")
    [ -n "$sum" ] || fail "verify names no checksum of the edited shard"
    edit "m['shards'][1]['xxh3_64'] = '$sum'"
    output=$("$conveyor" ckpt inspect "$dir") || fail "inspect refused the edited checkpoint"
    echo "$output"
    ! grep -q $'[\x01-\x08\x0b-\x1f]' <<<"$output" || fail "inspect printed a control character"
    grep -qF '  schedule     1f1b\x1b[2J\nx, 4 micro-batches' <<<"$output" || fail "the schedule is not escaped"
    grep -qF '  data         demo\x07 tokens, position' <<<"$output" || fail "the data source is not escaped"
    grep -qF '  blocks.1.ga\x1b[2Jin\n ' <<<"$output" || fail "the tensor name is not escaped"
    [ "$(wc -l <<<"$output")" -eq 31 ] || fail "inspect printed $(wc -l <<<"$output") lines, expected 31"
    # So does the resume line of train.
    expect 0 "done +1 step" "$conveyor" train --device cpu --steps 1 --batch-tokens 64 \
      --microbatches 1 --quiet --save-dir "$work/run"
    manifest=$work/run/step_1/manifest.json
    edit "del m['state_xxh3_64'], m['manifest_xxh3_64']; m['schedule']['name'] = '1f1b\x1b[2J'"
    expect 0 "^resume .*step_1 at step 1 \(saved with 1 stage\(s\), schedule 1f1b\\\\x1b\[2J\)$" \
      "$conveyor" train --device cpu --steps 2 --batch-tokens 64 --microbatches 1 --resume "$work/run"
    ;;
  inspect_nonfinite)
    # NaN and the infinities, which JSON has no numbers for, are strings in --json, as the
    # text shows them, while finite elements stay numbers. The checksums are put right after
    # the edit with the values verify reports: the tensor's first, then the shard file's.
    bias=blocks.1.fc1.bias
    python3 - "$shard1" "$bias" <<'EOF' || fail "cannot edit the shard"
import json, struct, sys
path, name = sys.argv[1], sys.argv[2]
data = bytearray(open(path, "rb").read())
n = struct.unpack("<Q", data[:8])[0]
begin = 8 + n + json.loads(data[8:8 + n])[name]["data_offsets"][0]
data[begin:begin + 16] = struct.pack("<4f", float("nan"), float("inf"), -float("inf"), 1.5)
open(path, "wb").write(bytes(data))
EOF
    old=$(grep -aEo "\"xxh3_64:$bias\":\"[0-9a-f]{16}\"" "$shard1" | grep -Eo "[0-9a-f]{16}")
    new=$("$conveyor" ckpt verify "$dir" 2>&1 | grep -Eo "its bytes hash to [0-9a-f]{16}" | grep -Eo "[0-9a-f]{16}$")
    [ -n "$old" ] && [ -n "$new" ] || fail "no tensor checksum to put right"
    LC_ALL=C sed -i "s/\"xxh3_64:$bias\":\"$old\"/\"xxh3_64:$bias\":\"$new\"/" "$shard1"
    sum=$("$conveyor" ckpt verify "$dir" 2>&1 | grep -Eo "has XXH3-64 [0-9a-f]{16}" | grep -Eo "[0-9a-f]{16}")
    [ -n "$sum" ] || fail "verify names no checksum of the edited shard"
    python3 -c "import json,sys; p=sys.argv[1]; m=json.load(open(p)); del m['state_xxh3_64'], m['manifest_xxh3_64']; m['shards'][1]['xxh3_64'] = sys.argv[2]; json.dump(m, open(p, 'w'))" \
      "$dir/step_2/manifest.json" "$sum" || fail "cannot edit the manifest"
    expect 0 "^  $bias +F32 +\[8\] +32 +rank_1\.safetensors +$new +nan inf -inf 1\.5$" \
      "$conveyor" ckpt inspect "$dir" --values 4
    output=$("$conveyor" ckpt inspect "$dir" --json --values 4) || fail "inspect --json refused the checkpoint"
    values=$(python3 -c "import json,sys; print(json.dumps([t['values'] for t in json.load(sys.stdin)['tensors'] if t['name'] == sys.argv[1]][0]))" \
      "$bias" <<<"$output") || fail "inspect --json printed no values of $bias"
    [ "$values" = '["nan", "inf", "-inf", 1.5]' ] || fail "inspect --json gave $bias the values $values"
    ;;
  verify_ok)
    expect 0 "ok: .*step_2, step 2: 16 tensors in 2 shards .* every checksum matches \(tensors, shard files, training state, manifest\)$" \
      "$conveyor" ckpt verify "$dir"
    # One shard is said in the singular, by each command that counts them.
    expect 0 "wrote .*step_2 \(1 shard\)$" "$conveyor" ckpt demo "$work/one" --step 2 --ranks 1
    expect 0 "ok: .*step_2, step 2: [0-9]+ tensors in 1 shard \([0-9]+ bytes\), " \
      "$conveyor" ckpt verify "$work/one"
    expect 0 "^total: [0-9]+ tensors, [0-9]+ bytes of data, 1 shard of [0-9]+ bytes$" \
      "$conveyor" ckpt inspect "$work/one"
    ;;
  verify_bitflip)
    # The last bytes of rank 1's data are its i32 tensor.
    flip_byte "$shard1" $(($(stat -c %s "$shard1") - 3))
    expect 1 "rank_1\.safetensors': checksum mismatch in tensor 'blocks\.1\.token_counts'" \
      "$conveyor" ckpt verify "$dir"
    ;;
  verify_truncated)
    truncate -s -1 "$shard1"
    expect 1 "rank_1\.safetensors': .*truncated" "$conveyor" ckpt verify "$dir"
    ;;
  verify_header)
    # The header's shape of the bf16 tensor no longer fits its bytes.
    LC_ALL=C sed -i 's/"shape":\[3,5\]/"shape":[5,5]/' "$shard1"
    expect 1 "rank_1\.safetensors': tensor 'blocks\.1\.gain' is BF16\[5, 5\] \(50 bytes\) but .* hold 30" \
      "$conveyor" ckpt verify "$dir"
    ;;
  verify_missing_shard)
    rm "$dir/step_2/rank_0.safetensors"
    expect 1 "rank_0\.safetensors' is listed in .*manifest\.json' but missing" \
      "$conveyor" ckpt verify "$dir"
    ;;
  verify_symlink)
    # A shard that is a symbolic link to the file is read through it; a link that loops is
    # named as such, not as missing.
    shard0=$dir/step_2/rank_0.safetensors
    mv "$shard0" "$work/rank_0.safetensors"
    ln -s "$work/rank_0.safetensors" "$shard0"
    expect 0 "every checksum matches" "$conveyor" ckpt verify "$dir"
    rm "$shard0"
    ln -s rank_0.safetensors "$shard0"
    expect 1 "^conveyor: error: .*rank_0\.safetensors' is listed in .*manifest\.json' but cannot be opened: Too many levels of symbolic links$" \
      "$conveyor" ckpt verify "$dir"
    ;;
  verify_old_manifest)
    # Without the manifest's own checksums (manifest_xxh3_64 came after state_xxh3_64) verify
    # says what it checked. The demo's rng has no batch_tokens: no training run's checkpoint,
    # which the library may write, so verify does not hold it to what a resume needs.
    drop() {
      python3 -c "import json,sys; m=json.load(open(sys.argv[1])); del m[sys.argv[2]]; json.dump(m, open(sys.argv[1], 'w'))" \
        "$dir/step_2/manifest.json" "$1" || fail "cannot edit the manifest"
    }
    drop manifest_xxh3_64
    expect 0 "every tensor's and shard file's checksum matches; the manifest has no manifest_xxh3_64 \(written before" \
      "$conveyor" ckpt verify "$dir"
    drop state_xxh3_64
    expect 0 "the manifest has no state_xxh3_64 or manifest_xxh3_64 \(written before they were recorded\), so its fields were checked against the format's rules and the shards only$" \
      "$conveyor" ckpt verify "$dir"
    ! "$conveyor" ckpt verify "$dir" | grep -q "every checksum matches" || fail "verify claims checksums the manifest lacks"
    ;;
  verify_fifo)
    # A FIFO where a shard or the manifest should be is refused at once: opening it for
    # reading would otherwise wait for a writer forever (timeout turns a hang into a failure).
    mv "$shard1" "$work/rank_1.safetensors"
    mkfifo "$shard1"
    expect 1 "cannot read .*rank_1\.safetensors': it is a FIFO \(named pipe\), not a regular file" \
      timeout 20 "$conveyor" ckpt verify "$dir"
    rm "$shard1"
    # A folder there is a bad file as well: exit 1, as for any checkpoint that fails a check.
    mkdir "$shard1"
    expect 1 "rank_1\.safetensors': .*not a regular file" timeout 20 "$conveyor" ckpt verify "$dir"
    rmdir "$shard1"
    mv "$work/rank_1.safetensors" "$shard1"
    rm "$dir/step_2/manifest.json"
    mkfifo "$dir/step_2/manifest.json"
    expect 1 "manifest\.json': it is a FIFO \(named pipe\), not a regular file" \
      timeout 20 "$conveyor" ckpt inspect "$dir"
    ;;
  verify_manifest)
    sed -i 's/"step": 2/"step": 3/' "$dir/step_2/manifest.json"
    expect 1 "manifest\.json' is of step 3, but its folder is named for step 2" \
      "$conveyor" ckpt verify "$dir"
    ;;
  verify_unfinished)
    # A save that never finished is no checkpoint: bad input, as an empty folder is.
    mv "$dir/step_2" "$dir/step_2.tmp"
    rm "$dir/latest"
    expect 2 "holds no checkpoint" "$conveyor" ckpt verify "$dir"
    expect 2 "step_2\.tmp' is an unfinished save" "$conveyor" ckpt verify "$dir/step_2.tmp"
    ;;
  not_a_checkpoint)
    # A path that names no checkpoint is bad input (2) for inspect and verify alike, each with
    # a sentence saying what was expected; a checkpoint that fails a check is their finding (1).
    mkdir "$work/empty"
    echo "not a checkpoint" >"$work/notes.txt"
    mkfifo "$work/fifo"
    for action in inspect verify; do
      expect 2 "^conveyor: error: no checkpoint at '$work/absent': it does not exist; give DIR, DIR/latest or DIR/step_<N>$" \
        "$conveyor" ckpt "$action" "$work/absent"
      expect 2 "^conveyor: error: .*notes\.txt' is a file, neither a checkpoint folder nor a 'latest' file naming one; give DIR, DIR/latest or DIR/step_<N>$" \
        "$conveyor" ckpt "$action" "$work/notes.txt"
      expect 2 "^conveyor: error: .*empty' holds no checkpoint: it has neither a 'latest' file nor a manifest\.json; give a folder that checkpoints were saved into, or one of its step_<N> folders$" \
        "$conveyor" ckpt "$action" "$work/empty"
      expect 2 "^conveyor: error: .*fifo' is a FIFO \(named pipe\), neither a folder nor a regular file, so neither a checkpoint folder nor a 'latest' file; give DIR, DIR/latest or DIR/step_<N>$" \
        timeout 20 "$conveyor" ckpt "$action" "$work/fifo"
      expect 2 "^conveyor: error: '/dev/null' is a character device, neither a folder nor a regular file" \
        "$conveyor" ckpt "$action" /dev/null
      expect 2 "^conveyor: error: .*manifest\.json' is a file of the checkpoint folder .*step_2'; give the folder itself$" \
        "$conveyor" ckpt "$action" "$dir/step_2/manifest.json"
    done
    truncate -s -1 "$shard1"
    for action in inspect verify; do
      expect 1 "^conveyor: error: .*rank_1\.safetensors': .*the file is truncated$" \
        "$conveyor" ckpt "$action" "$dir"
    done
    # demo writes a checkpoint: a folder that cannot take one is refused before anything is
    # written, as train refuses its --save-dir.
    expect 2 "^conveyor: error: cannot create checkpoint folder .*notes\.txt" \
      "$conveyor" ckpt demo "$work/notes.txt"
    expect 2 "^conveyor: error: cannot save step 2: .*step_2' exists already" \
      "$conveyor" ckpt demo "$dir" --step 2
    ;;
  keep_last)
    expect 0 "step_3" "$conveyor" ckpt demo "$dir" --step 3 --keep 2
    expect 0 "step_4" "$conveyor" ckpt demo "$dir" --step 4 --keep 2
    [ "$(ls "$dir" | tr '\n' ' ')" = "latest step_3 step_4 " ] || fail "left $(ls "$dir" | tr '\n' ' ')"
    [ "$(cat "$dir/latest")" = "step_4" ] || fail "latest holds $(cat "$dir/latest")"
    expect 0 "step 4" "$conveyor" ckpt verify "$dir"
    ;;
  keep_stuck)
    # An old checkpoint whose removal fails (a file that cannot be unlinked: immutable for
    # root, whom permission bits do not stop) is left as step_2.removing, which verify refuses
    # as no checkpoint; the save succeeds, and the next save removes it once it can.
    mkdir "$dir/step_2/extra" && echo "a file the removal stops at" >"$dir/step_2/extra/notes.txt"
    if [ "$(id -u)" -eq 0 ]; then
      chattr +i "$dir/step_2/extra/notes.txt" 2>/dev/null ||
        { echo "skipped: chattr +i does not work here"; exit 77; }
      trap 'chattr -i "$dir"/step_2*/extra/notes.txt 2>/dev/null' EXIT
      release() { chattr -i "$dir/step_2.removing/extra/notes.txt"; }
    else
      chmod 500 "$dir/step_2/extra"
      trap 'chmod 755 "$dir"/step_2*/extra 2>/dev/null' EXIT
      release() { chmod 755 "$dir/step_2.removing/extra"; }
    fi
    expect 0 "^conveyor: warning: cannot remove old checkpoint '.*/step_2': [^;]*; what is left of it is named step_2\.removing, which no load takes for a checkpoint and the next saves try again to remove$" \
      "$conveyor" ckpt demo "$dir" --step 3 --keep 1
    [ "$(ls "$dir" | tr '\n' ' ')" = "latest step_2.removing step_3 " ] || fail "left $(ls "$dir" | tr '\n' ' ')"
    expect 0 "step 3" "$conveyor" ckpt verify "$dir"
    for action in inspect verify; do
      expect 2 "^conveyor: error: .*step_2\.removing' is an old checkpoint whose removal did not finish" \
        "$conveyor" ckpt "$action" "$dir/step_2.removing"
    done
    release || fail "cannot release the file"
    expect 0 "step_4" "$conveyor" ckpt demo "$dir" --step 4 --keep 1
    [ "$(ls "$dir" | tr '\n' ' ')" = "latest step_4 " ] || fail "left $(ls "$dir" | tr '\n' ' ')"
    ;;
  *)
    fail "unknown case"
    ;;
esac

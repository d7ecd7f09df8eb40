# Sourced by the MPI test scripts: their failures and skips, the wire between two network
# namespaces, and what of one `conveyor train` run must equal another's bit for bit. A run
# NAME left NAME.jsonl (--log-json) and NAME.out (stdout with --weights-checksum) in the work
# folder.
fail() { echo "FAIL: $*"; exit 1; }
# Exit status 77: ctest reports the test as skipped, with this reason.
skip() { echo "SKIP: $*"; exit 77; }
# The bitwise part of a --log-json file: step, loss and gradient norm of every step.
numbers() { jq -c '[.step, .loss, .grad_norm]' "$1"; }
checksum() { grep -o 'weights xxh3 [0-9a-f]*' "$1"; }

# join_namespaces NS0 NS1 VETH0 VETH1 ADDR0 ADDR1: two network namespaces joined by a veth
# pair, each end in its namespace with its address (/24) and up, loopback up too: the wire
# between two "hosts" of one machine. Skipped where this machine cannot make a veth pair.
join_namespaces() {
  local ns=("$1" "$2") veth=("$3" "$4") addr=("$5" "$6") err i
  err=$(ip link add "${veth[0]}" type veth peer name "${veth[1]}" 2>&1) ||
    skip "a veth pair cannot be made here: $err"
  for i in 0 1; do
    ip link set "${veth[i]}" netns "${ns[i]}" &&
      ip -n "${ns[i]}" addr add "${addr[i]}/24" dev "${veth[i]}" &&
      ip -n "${ns[i]}" link set "${veth[i]}" up &&
      ip -n "${ns[i]}" link set lo up || fail "setting up ${ns[i]} failed"
  done
}

# same_run DIR REF GOT WHAT: GOT's per-step numbers and final weights equal REF's; WHAT names
# GOT in the messages ("of mpirun -np 2", "over the two namespaces").
same_run() {
  local dir=$1 ref=$2 got=$3 what=$4
  diff <(numbers "$dir/$ref.jsonl") <(numbers "$dir/$got.jsonl") ||
    fail "per-step losses $what differ from the $ref run"
  [ -n "$(checksum "$dir/$ref.out")" ] || fail "no checksum in the $ref run"
  [ "$(checksum "$dir/$ref.out")" = "$(checksum "$dir/$got.out")" ] ||
    fail "final weights $what differ: $ref $(checksum "$dir/$ref.out"), $got $(checksum "$dir/$got.out")"
}

# eval_line DIR NAME: the summary's eval line of DIR/NAME.out, checked to be the only one.
eval_line() {
  [ "$(grep -c '^eval   loss ' "$1/$2.out")" = 1 ] || fail "not one eval line in $2: $(cat "$1/$2.out")"
  grep '^eval   loss ' "$1/$2.out"
}

#!/usr/bin/env bash
# GPU ranks as processes: `mpirun -np 2 conveyor train --device cuda --stages 2`, its NCCL
# communicators bootstrapped over MPI, against the one-process run of the same configuration.
#   nccl_mpi_train.sh CONVEYOR
# With 2 GPUs or more: per-step losses and gradient norms (--log-json) and the final weights'
# checksum of the mpirun run (auto, and --transport nccl) equal, bit for bit, those of the
# one-process --stages 2 runs over in-process NCCL and over the in-process transport (CUDA
# runs are deterministic per device, and stage s runs on cuda:s in all of them); the same for
# data parallelism, `--stages 1 --dp 2` under `mpirun -np 2` (rank r on cuda:r), plain and
# with --shard-optimizer (the group sum, then the reduce-scatter and gather, over NCCL),
# and with 4 GPUs or more `--stages 2 --dp 2` under `mpirun -np 4` (reported as skipped
# with fewer); the difference to the CPU run is printed, not checked.
# With one GPU: `mpirun -np 1 ... --transport nccl --stages 1` (the bootstrap over MPI and a
# one-rank all-reduce over NCCL) equals the one-process run, then exit 77: two ranks over NCCL
# need two GPUs (NCCL refuses two ranks of one communicator on one GPU).
# Exit status 77 (skipped) with the reason where there is no GPU, no mpirun or no jq.
set -uo pipefail
cli=$1
skip() { echo "SKIP: $*"; exit 77; }
command -v mpirun >/dev/null || skip "no mpirun"
command -v jq >/dev/null || skip "no jq"
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
  gpus=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
elif command -v nvidia-smi >/dev/null; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
else
  gpus=0
fi
[ "$gpus" -ge 1 ] || skip "no CUDA device (nvidia-smi lists none)"
[ -x "$cli" ] || { echo "FAIL: no conveyor binary at $cli (build the conveyor_cli target)"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
common=(train --layers 4 --microbatches 4 --batch-tokens 512 --steps 4 --seed 7
        --quiet --weights-checksum --timeout 60)
# fail, numbers, checksum, same_run
source "$(dirname "${BASH_SOURCE[0]}")/mpi_compare.sh"

# run NAME ARGS...: a run leaving NAME.jsonl and NAME.out in the work folder.
run() {
  local name=$1
  shift
  timeout 120 "$@" --log-json "$work/$name.jsonl" >"$work/$name.out" 2>&1 ||
    fail "run $name ($*) failed: $(cat "$work/$name.out")"
}
uses_nccl() { grep -q "transport nccl" "$work/$1.out" || fail "run $1 did not use NCCL: $(cat "$work/$1.out")"; }

# The largest absolute difference between two runs' per-step losses.
loss_difference() {
  jq -s -r '[.[0], .[1]] | transpose | map(.[0].loss - .[1].loss | fabs) | max' \
    <(jq -s . "$work/$1.jsonl") <(jq -s . "$work/$2.jsonl") 2>/dev/null ||
    echo "unknown"
}

if [ "$gpus" -lt 2 ]; then
  run one1 "$cli" "${common[@]}" --device cuda --stages 1
  run mpi1 "${mpirun[@]}" -np 1 "$cli" "${common[@]}" --device cuda --stages 1 --transport nccl
  uses_nccl mpi1
  same_run "$work" one1 mpi1 "of mpirun -np 1 --transport nccl"
  echo "mpirun -np 1 --transport nccl: $(numbers "$work/mpi1.jsonl" | wc -l) steps and $(checksum "$work/mpi1.out") equal to the one-process run"
  skip "two ranks over NCCL need two GPUs, found $gpus (the one-rank run above passed)"
fi

cuda=("${common[@]}" --device cuda --stages 2)
run nccl "$cli" "${cuda[@]}"
uses_nccl nccl
run inproc "$cli" "${cuda[@]}" --transport inproc
run mpi "${mpirun[@]}" -np 2 "$cli" "${cuda[@]}"
uses_nccl mpi
[ "$(grep -c '^done ' "$work/mpi.out")" = 1 ] || fail "ranks other than 0 printed: $(cat "$work/mpi.out")"
run explicit "${mpirun[@]}" -np 2 "$cli" "${cuda[@]}" --transport nccl
uses_nccl explicit
[ "$(numbers "$work/mpi.jsonl" | wc -l)" = 4 ] || fail "expected 4 steps in --log-json"
for ref in nccl inproc; do
  same_run "$work" "$ref" mpi "of mpirun -np 2"
  same_run "$work" "$ref" explicit "of mpirun -np 2 --transport nccl"
done

# Data parallelism over NCCL: the replicas' sums over the host in group order, so the bits
# are those of the in-process transport, in one process and across processes.
# dp_case NAME RANKS REFS ARGS...: mpirun -np RANKS equal to the one-process runs REFS
# ("inproc", or "nccl inproc") of the same arguments. (The one-process NCCL run is made once
# only: the gtest cases check its group calls, and every run costs communicator set-up.)
dp_case() {
  local name=$1 ranks=$2 refs=$3
  shift 3
  for ref in $refs; do
    run "${name}_$ref" "$cli" "$@" --transport "$ref"
    [ "$ref" = inproc ] || uses_nccl "${name}_$ref"
  done
  run "${name}_mpi" "${mpirun[@]}" -np "$ranks" "$cli" "$@"
  uses_nccl "${name}_mpi"
  for ref in $refs; do
    same_run "$work" "${name}_$ref" "${name}_mpi" "of mpirun -np $ranks ($name)"
  done
  echo "mpirun -np $ranks ($name): $(numbers "$work/${name}_mpi.jsonl" | wc -l) steps and $(checksum "$work/${name}_mpi.out") equal to the one-process $refs run(s)"
}
dp_case dp 2 "nccl inproc" "${common[@]}" --device cuda --stages 1 --dp 2
dp_case zero 2 inproc "${common[@]}" --device cuda --stages 1 --dp 2 --shard-optimizer
if [ "$gpus" -ge 4 ]; then
  dp_case dp4 4 inproc "${cuda[@]}" --dp 2
  dp4="checked"
else
  dp4="skipped: 4 ranks need 4 GPUs, found $gpus"
fi

run cpu "$cli" "${common[@]}" --device cpu --stages 2
echo "mpirun -np 2 --device cuda --stages 2: $(numbers "$work/mpi.jsonl" | wc -l) steps and $(checksum "$work/mpi.out") equal to the one-process NCCL and in-process runs"
echo "against the CPU run (reported, not checked): largest loss difference $(loss_difference mpi cpu), CPU $(checksum "$work/cpu.out")"
echo "--stages 2 --dp 2 over NCCL across processes: $dp4"

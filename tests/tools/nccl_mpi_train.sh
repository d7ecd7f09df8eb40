#!/usr/bin/env bash
# GPU ranks as processes: `mpirun -np N conveyor train --device cuda ...`, their NCCL
# communicators bootstrapped over MPI, against the one-process runs of the same configuration.
#   nccl_mpi_train.sh CONVEYOR equal   mpirun -np 2 --stages 2 (auto, and --transport nccl):
#                                      per-step losses and gradient norms (--log-json) and the
#                                      final weights' checksum equal, bit for bit, those of the
#                                      one-process --stages 2 runs over the in-process transport
#                                      and (with 2 GPUs or more) over in-process NCCL; so does
#                                      the held-out evaluation's exact line (--eval-batches 2);
#                                      with one GPU first mpirun -np 1 --transport nccl
#                                      --stages 1 against the one-process run, and a launch of
#                                      more processes than GPUs without NCCL_HOSTID refused
#   nccl_mpi_train.sh CONVEYOR dp      data parallelism over NCCL: --stages 1 --dp 2 under
#                                      mpirun -np 2, plain and with --shard-optimizer, and
#                                      --stages 2 --dp 2 under mpirun -np 4, equal to the
#                                      one-process runs of the same flags
#   nccl_mpi_train.sh CONVEYOR ckpt    a checkpoint saved after step 2 by mpirun -np 2 --stages 2
#                                      and resumed by the same launch gives the uninterrupted
#                                      run bit for bit; it verifies, and a one-stage CPU run
#                                      resumes from it
#   nccl_mpi_train.sh CONVEYOR stop    rank 1 of mpirun -np 2 stopped (SIGSTOP) mid-run: rank
#                                      0's wait on NCCL ends at its --timeout, it aborts its
#                                      communicators and the job ends within 30 s with rank 0's
#                                      error and its position in the rank x action grid
#   nccl_mpi_train.sh CONVEYOR kill    rank 1 killed (SIGKILL) mid-run: the job ends non-zero
#                                      within 30 s, naming the lost rank
# CUDA runs are deterministic per device: rank r runs on cuda:r, or on cuda:0 for all where
# there are fewer GPUs than ranks, in the reference runs and under mpirun alike; the difference
# to the CPU run is printed, not checked.
#
# Fewer GPUs than processes: each process is given an NCCL host id of its own (NCCL_HOSTID),
# so NCCL takes each for a host of its own and lets their ranks share one GPU, connected over
# sockets on the loopback interface. Slower than NVLink or PCIe, but the same NCCL calls,
# set-up, waits and aborts, so one GPU tests every path of NCCL across processes. (NCCL
# refuses two ranks of one communicator on one GPU of one host, and so does `conveyor train`
# before NCCL is asked, unless NCCL_HOSTID is set.)
# Exit status 77 (skipped) with the reason where there is no GPU, no OpenMPI mpirun or no jq.
set -uo pipefail
cli=$1 mode=${2:-equal}
# fail, skip, numbers, checksum, same_run, eval_line
source "$(dirname "${BASH_SOURCE[0]}")/mpi_compare.sh"
command -v mpirun >/dev/null || skip "no mpirun"
# The flags below and OMPI_COMM_WORLD_RANK are OpenMPI's, and so is the MPI the build links.
mpirun --version 2>&1 | grep -q "Open MPI" ||
  skip "mpirun is not OpenMPI's: $(mpirun --version 2>&1 | head -1)"
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
# A GPU in an exclusive compute mode takes one process's context only.
exclusive=0
nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | grep -qi exclusive &&
  exclusive=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
# NCCL's own reason for a failure (rank 0's; the others' output is silenced) in the log.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
device=(--device cuda)
common=(train --layers 4 --microbatches 4 --batch-tokens 512 --steps 4 --seed 7
        --quiet --weights-checksum --timeout 60)

# launch N: sets `launched` to the command that starts `conveyor` as N processes under
# mpirun, the arguments to follow; with fewer GPUs than N each process is a host of its own
# to NCCL (above). CONVEYOR_TEST_PID_FILE, when set, receives the pid of rank
# $CONVEYOR_TEST_PID_RANK (the process itself: exec keeps it).
launch() {
  local hosts=0
  [ "$gpus" -lt "$1" ] && hosts=1
  [ "$hosts" = 1 ] && [ "$exclusive" = 1 ] &&
    skip "$1 processes on $gpus GPU(s) need the GPUs' default compute mode, not exclusive"
  launched=("${mpirun[@]}" -np "$1" bash -c '
    if [ "$0" = 1 ]; then
      export NCCL_HOSTID=conveyor-test-host-$OMPI_COMM_WORLD_RANK NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
    fi
    if [ -n "${CONVEYOR_TEST_PID_FILE:-}" ] && [ "$OMPI_COMM_WORLD_RANK" = "${CONVEYOR_TEST_PID_RANK:-}" ]; then
      echo $$ >"$CONVEYOR_TEST_PID_FILE"
    fi
    exec "$@"' "$hosts" "$cli")
}

# run NAME COMMAND...: a run leaving NAME.jsonl and NAME.out in the work folder.
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

# case_equal NAME RANKS ARGS...: `launch RANKS ARGS` equal to the one-process runs of ARGS
# over the in-process transport and, with a GPU per rank, over in-process NCCL (made once
# only where the gtest cases check its calls: every run costs communicator set-up).
case_equal() {
  local name=$1 ranks=$2
  shift 2
  local refs=inproc
  [ "$gpus" -ge "$ranks" ] && refs="nccl inproc"
  for ref in $refs; do
    run "${name}_$ref" "$cli" "$@" --transport "$ref"
    [ "$ref" = inproc ] || uses_nccl "${name}_$ref"
  done
  launch "$ranks"
  run "${name}_mpi" "${launched[@]}" "$@"
  uses_nccl "${name}_mpi"
  [ "$(grep -c '^done ' "$work/${name}_mpi.out")" = 1 ] ||
    fail "ranks other than 0 printed: $(cat "$work/${name}_mpi.out")"
  [ "$(numbers "$work/${name}_mpi.jsonl" | wc -l)" = 4 ] || fail "expected 4 steps in ${name}'s --log-json"
  for ref in $refs; do
    same_run "$work" "${name}_$ref" "${name}_mpi" "of mpirun -np $ranks ($name)"
  done
  echo "mpirun -np $ranks ($name$([ "$gpus" -lt "$ranks" ] && echo ", $gpus GPU(s), processes as NCCL hosts")): $(numbers "$work/${name}_mpi.jsonl" | wc -l) steps and $(checksum "$work/${name}_mpi.out") equal to the one-process $refs run(s)"
}

# signal_rank_one SIGNAL TIMEOUT: rank 1 of `launch 2 ... --stages 2` gets SIGNAL once rank 0
# has finished its first step of a run far longer than the test; the job must then end
# non-zero, by itself, within 30 s. Output in $work/out.
signal_rank_one() {
  local sig=$1 deadline=$2 status took start job pid
  rm -f "$work/rank1.pid"
  launch 2
  CONVEYOR_TEST_PID_FILE=$work/rank1.pid CONVEYOR_TEST_PID_RANK=1 timeout 120 "${launched[@]}" \
    train "${device[@]}" --stages 2 --layers 4 --microbatches 4 --batch-tokens 512 \
    --steps 1000000 --log-every 1000000 --timeout "$deadline" >"$work/out" 2>&1 &
  job=$!
  for _ in $(seq 600); do
    grep -q '^step  *1/' "$work/out" 2>/dev/null && break
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  grep -q '^step  *1/' "$work/out" || fail "no first step within 60 s: $(cat "$work/out")"
  pid=$(cat "$work/rank1.pid") || fail "rank 1 left no pid"
  start=$(date +%s)
  kill -"$sig" "$pid"
  wait "$job"
  status=$?
  took=$(( $(date +%s) - start ))
  kill -KILL "$pid" 2>/dev/null  # a stopped rank 1 would outlive the job
  [ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "status $status after ${took}s: $(cat "$work/out")"
  [ "$took" -le 30 ] || fail "took ${took}s, more than the $deadline s timeout allows"
  ended="status $status ${took}s after the signal"
}

case $mode in
  equal)
    if [ "$gpus" -lt 2 ]; then
      run one1 "$cli" "${common[@]}" "${device[@]}" --stages 1
      run mpi1 "${mpirun[@]}" -np 1 "$cli" "${common[@]}" "${device[@]}" --stages 1 --transport nccl
      uses_nccl mpi1
      same_run "$work" one1 mpi1 "of mpirun -np 1 --transport nccl"
      echo "mpirun -np 1 --transport nccl: $(numbers "$work/mpi1.jsonl" | wc -l) steps and $(checksum "$work/mpi1.out") equal to the one-process run"
      [ "$exclusive" = 1 ] && skip "two processes on one GPU need its default compute mode, not exclusive"
      # Two processes on one GPU, without host ids of their own: refused before NCCL is asked.
      timeout 120 "${mpirun[@]}" -np 2 "$cli" "${common[@]}" "${device[@]}" --stages 2 \
        >"$work/shared.out" 2>&1
      status=$?
      [ "$status" -ne 0 ] && [ "$status" -ne 124 ] || fail "status $status: $(cat "$work/shared.out")"
      grep -Eq "ranks 0 and 1 would run on the same GPU \(GPU-[0-9a-f-]{36}, their cuda:0 and cuda:0\), and NCCL refuses two ranks on one GPU" \
        "$work/shared.out" || fail "two processes on one GPU not refused by name: $(cat "$work/shared.out")"
      [ "$(grep -c "would run on the same GPU" "$work/shared.out")" -eq 1 ] ||
        fail "the refusal of two processes on one GPU is not said once: $(cat "$work/shared.out")"
      echo "mpirun -np 2 on $gpus GPU without NCCL_HOSTID: refused, status $status"
    fi
    case_equal pipe 2 "${common[@]}" "${device[@]}" --stages 2
    launch 2
    run explicit "${launched[@]}" "${common[@]}" "${device[@]}" --stages 2 --transport nccl
    uses_nccl explicit
    same_run "$work" pipe_inproc explicit "of mpirun -np 2 --transport nccl"
    # The held-out evaluation: activations between the processes over NCCL, the loss's sum
    # over the world communicator; rank 0 alone prints it, exactly as one process does.
    run eval_inproc "$cli" "${common[@]}" "${device[@]}" --stages 2 --eval-batches 2 --transport inproc
    run eval_mpi "${launched[@]}" "${common[@]}" "${device[@]}" --stages 2 --eval-batches 2
    want=$(eval_line "$work" eval_inproc) got=$(eval_line "$work" eval_mpi) || exit 1
    [ "$got" = "$want" ] || fail "mpirun -np 2 --eval-batches 2: '$got', one process: '$want'"
    echo "mpirun -np 2 --eval-batches 2: $got"
    run cpu "$cli" "${common[@]}" --device cpu --stages 2
    echo "against the CPU run (reported, not checked): largest loss difference $(loss_difference pipe_mpi cpu), CPU $(checksum "$work/cpu.out")"
    ;;
  dp)
    # The replicas' sums over the host in group order, so the bits are those of the
    # in-process transport, in one process and across processes.
    case_equal dp 2 "${common[@]}" "${device[@]}" --stages 1 --dp 2
    case_equal zero 2 "${common[@]}" "${device[@]}" --stages 1 --dp 2 --shard-optimizer
    case_equal dp4 4 "${common[@]}" "${device[@]}" --stages 2 --dp 2
    grep -q "2 replicas x 2 pipeline ranks" "$work/dp4_mpi.out" || fail "no replicas: $(cat "$work/dp4_mpi.out")"
    ;;
  ckpt)
    # Checkpoints of GPU processes over NCCL: saved after step 2 by mpirun -np 2 and resumed by
    # the same launch, the run is the uninterrupted one bit for bit (same GPUs, same ranks);
    # the checkpoint verifies, and a CPU run of one stage resumes from it.
    launch 2
    run whole "${launched[@]}" "${common[@]}" "${device[@]}" --stages 2
    uses_nccl whole
    run first "${launched[@]}" "${common[@]}" "${device[@]}" --stages 2 --stop-after 2 \
      --save-dir "$work/ckpt"
    "$cli" ckpt verify "$work/ckpt/latest" >"$work/verify.out" 2>&1 ||
      fail "the checkpoint of mpirun -np 2 does not verify: $(cat "$work/verify.out")"
    run second "${launched[@]}" "${common[@]}" "${device[@]}" --stages 2 --save-dir "$work/ckpt" \
      --resume latest
    grep -q "^resume .*step_2 at step 2 (saved with 2 stage(s)" "$work/second.out" ||
      fail "no resume line from rank 0: $(cat "$work/second.out")"
    cat "$work/first.jsonl" "$work/second.jsonl" >"$work/joined.jsonl"
    cp "$work/second.out" "$work/joined.out"
    same_run "$work" whole joined "saved and resumed by mpirun -np 2 over NCCL"
    run on_cpu "$cli" "${common[@]}" --device cpu --stages 1 --resume "$work/ckpt/step_2"
    grep -q "^resume .*step_2 at step 2" "$work/on_cpu.out" ||
      fail "the CPU run did not resume: $(cat "$work/on_cpu.out")"
    echo "saved after step 2 and resumed by mpirun -np 2: $(checksum "$work/joined.out") as the uninterrupted run; the CPU resumed it, $(checksum "$work/on_cpu.out")"
    ;;
  stop)
    signal_rank_one STOP 5
    # Rank 0 waits on a stream NCCL work is queued on (a transfer from rank 1, or the step's
    # all-reduce) and gives up at its deadline, naming what did not finish.
    grep -Eq "conveyor: error: rank 0.*(did not finish within 5000 ms|NCCL error)" "$work/out" ||
      fail "rank 0 did not give up at its deadline: $(cat "$work/out")"
    grep -Eq "^r0: .*>>[A-Z]+[0-9.]+[<>]?[0-9]*<<" "$work/out" ||
      fail "rank 0's position is not marked in the grid: $(cat "$work/out")"
    grep -q "^rank(s) 1: held by other processes" "$work/out" ||
      fail "rank 1 is not named as unknown here: $(cat "$work/out")"
    echo "rank 1 stopped: rank 0 gave up, job ended with $ended"
    sed -n '/^conveyor: error: rank 0/,/^rank(s) /p' "$work/out"
    ;;
  kill)
    signal_rank_one KILL 20
    grep -Eq "rank 1 .*(signal 9|Killed)|process rank 1|rank 0: .*(rank 1|NCCL error)" "$work/out" ||
      fail "the lost rank is not named: $(cat "$work/out")"
    echo "rank 1 killed: job ended with $ended"
    cat "$work/out"
    ;;
  *) fail "unknown mode $mode (equal, dp, ckpt, stop or kill)" ;;
esac

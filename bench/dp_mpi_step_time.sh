#!/usr/bin/env bash
# Step time of (P, D) = (2, 2): `mpirun -np 4` against the same configuration as 4 rank
# threads of one process, and each run's measured gradient all-reduce (AR) times from the
# last step's timeline in --trace (under mpirun, every rank's, gathered to rank 0).
#   bench/dp_mpi_step_time.sh [CONVEYOR] [STEPS] [MORE TRAIN FLAGS...]   (e.g. --shard-optimizer)
# Prints, per run: median step seconds (steps 2.., from --log-json), tokens/s, and the AR
# actions' durations. Not a test: the figures depend on the machine and its load.
set -euo pipefail
cli=${1:-build/tools/conveyor}
steps=${2:-40}
shift $(($# < 2 ? $# : 2))
if ! [[ $steps =~ ^[0-9]+$ ]] || ((10#$steps < 2)); then
  echo "dp_mpi_step_time: STEPS must be a whole number of at least 2 (the first step is left" \
       "out of the median), got '$steps'" >&2
  exit 2
fi
if [[ ! -x $cli || -d $cli ]]; then
  echo "dp_mpi_step_time: CONVEYOR '$cli' is not an executable file (usage:" \
       "bench/dp_mpi_step_time.sh [CONVEYOR] [STEPS] [MORE TRAIN FLAGS...])" >&2
  exit 2
fi
if ! command -v mpirun >/dev/null; then
  echo "dp_mpi_step_time: mpirun not found: install OpenMPI (tools/bootstrap.sh does)" >&2
  exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run=(train --device cpu --stages 2 --dp 2 --microbatches 8 --batch-tokens 4096 --layers 4
     --d-model 128 --hidden 512 --steps "$steps" --seed 7 --quiet --weights-checksum "$@")
report() {  # name, jsonl, trace, out
  python3 - "$@" <<'PY'
import json, statistics, sys
name, jsonl, trace, out = sys.argv[1:]
steps = [json.loads(l) for l in open(jsonl)]
secs = sorted(s["seconds"] for s in steps[1:])
tokens = steps[0]["tokens"]
text = open(trace).read()
ev = json.loads(text) if text.strip() else []  # a run that failed early leaves it empty
ev = ev["traceEvents"] if isinstance(ev, dict) else ev
# Measured ranks only: the trace's simulated ranks (pids from 2000000) draw all-reduces too.
ar = [f'{e["name"]}@pid{e["pid"]} {e["dur"] / 1000:.2f} ms' for e in ev
      if e.get("cat") == "ALLREDUCE_GRAD" and e["pid"] < 1000000]
checksum = [l.split()[-1] for l in open(out) if "weights xxh3" in l]
print(f"{name}: {len(steps)} steps, median step {statistics.median(secs):.4f} s "
      f"(min {secs[0]:.4f}, max {secs[-1]:.4f}), {tokens / statistics.median(secs) / 1e3:.1f}k tok/s; "
      f"AR (last step): {', '.join(ar) or 'not in the trace'}; weights xxh3 {checksum[0] if checksum else '?'}")
PY
}
# A run's output goes to a file the report reads; a failed run shows its last lines, which the
# folder's removal would otherwise take with it.
failed() {  # name, out, status
  echo "dp_mpi_step_time: $1 failed with exit status $3; its last lines:" >&2
  tail -n 5 "$2" >&2
  exit "$3"
}
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
status=0
"$cli" "${run[@]}" --transport inproc --log-json "$work/threads.jsonl" --trace "$work/threads.trace" \
  >"$work/threads.out" 2>&1 || status=$?
((status == 0)) || failed "one process, 4 rank threads" "$work/threads.out" "$status"
report "one process, 4 rank threads" "$work/threads.jsonl" "$work/threads.trace" "$work/threads.out"
echo "load average between: $(cut -d' ' -f1-3 /proc/loadavg)"
mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 "$cli" "${run[@]}" \
  --log-json "$work/mpi.jsonl" --trace "$work/mpi.trace" >"$work/mpi.out" 2>&1 || status=$?
((status == 0)) || failed "mpirun -np 4" "$work/mpi.out" "$status"
report "mpirun -np 4" "$work/mpi.jsonl" "$work/mpi.trace" "$work/mpi.out"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

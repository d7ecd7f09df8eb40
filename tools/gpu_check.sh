#!/usr/bin/env bash
# The one prepared check for the GPU machine (one H200, Ubuntu 24.04, CUDA 13.0, no network,
# 15 minutes of device time in all): build (or reuse a carried build), list the GPU, run the
# `gpu` tests, compute-sanitizer memcheck on short filters, the GPU benchmarks, and print a
# short table last. Every step has a timeout and the script goes on after a failure; the
# whole run stays inside CHECK_BUDGET_S (default 540 s) so one call of at most 600 s fits.
#
#   tools/gpu_check.sh [BUILD_DIR]      run the check; logs under $OUT (or ./gpu_check_out)
#   tools/gpu_check.sh --prepare DIR    here, on the build machine: build the GPU targets in
#                                       DIR, then make DIR-carry: the same without object
#                                       files and static libraries (to fit the 64 MiB that
#                                       travel), plus carried-lib/ with the shared libraries
#                                       the GPU machine lacks (Google Benchmark's soname
#                                       differs between Debian 12 and Ubuntu 24.04). Carry
#                                       DIR-carry and pass it as BUILD_DIR.
#
# Without BUILD_DIR it configures and builds build-gpu there (needs CLI11, nlohmann-json and
# xxhash headers, which that machine may lack). With a carried BUILD_DIR it links the build's
# original path to it, since ctest's generated files name absolute paths.
# At most 8 files come back from $OUT: env.txt, build.log, ctest_gpu.log, sanitizer.log,
# bench.log, bench_kernels_gpu.json, bench_train.json, summary.txt.
set -u

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cuda_lib=/usr/local/cuda-13.0/targets/x86_64-linux/lib
gpu_targets=(kernels_gpu_tests core_gpu_tests pipeline_gpu_tests comm_gpu_tests
             bench_kernels_gpu bench_train)

if [[ "${1:-}" == "--prepare" ]]; then
  dir=${2:?usage: tools/gpu_check.sh --prepare BUILD_DIR}
  cmake -S "$root" -B "$dir" -DCONVEYOR_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DCONVEYOR_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release || exit 1
  for t in "${gpu_targets[@]}"; do
    cmake --build "$dir" -j"$(nproc)" --target "$t" || echo "prepare: target $t not built"
  done
  dir=$(cd "$dir" && pwd)
  slim=$dir-carry
  rm -rf "$slim" && mkdir -p "$slim" && cp -a "$dir/." "$slim/"
  find "$slim" \( -name '*.o' -o -name '*.a' \) -delete
  find "$slim" -type d -name CMakeFiles -prune -exec rm -rf {} +
  mkdir -p "$slim/carried-lib"
  for b in "$slim"/bench/bench_*; do
    [[ -x "$b" ]] || continue
    ldd "$b" | awk '/libbenchmark/ {print $3}' | xargs -r -I{} cp -L {} "$slim/carried-lib/"
  done
  du -sh "$slim"
  exit 0
fi

out=${OUT:-$root/gpu_check_out}
mkdir -p "$out"
budget=${CHECK_BUDGET_S:-540}
start=$SECONDS
summary=()
note() { summary+=("$(printf '%-34s %s' "$1" "$2")"); }
# Seconds a step may take: its own cap, but never past the budget (minus a reserve for the
# table at the end).
allow() {
  local cap=$1 left=$((budget - (SECONDS - start) - 15))
  ((left < cap)) && cap=$left
  ((cap < 1)) && cap=1
  echo "$cap"
}

export PATH="/usr/local/cuda-13.0/bin:/usr/local/cuda-13.0/compute-sanitizer:$PATH"
export LD_LIBRARY_PATH="$cuda_lib:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# --- the build ------------------------------------------------------------------------
build=${1:-}
if [[ -n "$build" ]]; then
  build=$(cd "$build" && pwd) || { echo "no build folder $1"; exit 1; }
  [[ -d "$build/carried-lib" ]] && export LD_LIBRARY_PATH="$build/carried-lib:$LD_LIBRARY_PATH"
  # ctest's files name the build folder (and the sources) by their paths on the build machine.
  original=$(sed -n 's/^CMAKE_CACHEFILE_DIR:INTERNAL=//p' "$build/CMakeCache.txt" 2>/dev/null)
  source_dir=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt" 2>/dev/null)
  for pair in "$source_dir:$root" "$original:$build"; do
    from=${pair%%:*} to=${pair#*:}
    if [[ -n "$from" && "$from" != "$to" && ! -e "$from" ]]; then
      mkdir -p "$(dirname "$from")" && ln -s "$to" "$from"
    fi
  done
  echo "reusing carried build $build (built at ${original:-?})" >"$out/build.log"
  note "build" "carried ($build)"
else
  build=$root/build-gpu
  t=$(allow 330)
  {
    timeout "$t" cmake -S "$root" -B "$build" -G Ninja -DCONVEYOR_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DCONVEYOR_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release &&
    timeout "$(allow 330)" cmake --build "$build" -j16 --target "${gpu_targets[@]:0:5}" &&
    { timeout "$(allow 120)" cmake --build "$build" -j16 --target bench_train || true; }
  } >"$out/build.log" 2>&1
  rc=$?
  note "build" "$([[ $rc == 0 ]] && echo ok || echo "FAILED (rc $rc, see build.log)")"
fi

# --- the machine ----------------------------------------------------------------------
{
  echo "== date"; date -u
  echo "== nvidia-smi -L"; nvidia-smi -L
  echo "== nvidia-smi"; nvidia-smi
  echo "== versions"; nvcc --version 2>&1 | tail -2; cmake --version | head -1
  ls -l /usr/lib/x86_64-linux-gnu/libnccl.so* 2>&1
  echo "== commit"; git -C "$root" log --oneline -1 2>&1
  echo "== missing shared libraries"
  for b in "$build"/tests/*_gpu_tests "$build"/bench/bench_*; do
    [[ -x "$b" ]] && ldd "$b" 2>&1 | grep "not found" | sed "s|^|$(basename "$b"): |"
  done
} >"$out/env.txt" 2>&1
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
nvidia-smi -L 2>&1
note "GPUs" "$gpus"

# --- the gpu tests --------------------------------------------------------------------
t=$(allow 240)
echo "ctest -L gpu (timeout ${t}s)"
timeout "$t" ctest --test-dir "$build" -L gpu --output-on-failure --timeout 200 \
  >"$out/ctest_gpu.log" 2>&1
rc=$?
passed=$(grep -c ' Passed ' "$out/ctest_gpu.log")
skipped=$(grep -c '\*\*\*Skipped' "$out/ctest_gpu.log")
failed=$(grep -cE '\*\*\*(Failed|Timeout|Exception|Not Run)' "$out/ctest_gpu.log")
note "ctest -L gpu" "passed $passed, failed $failed, skipped $skipped (rc $rc)"
grep -E '\*\*\*(Failed|Timeout|Exception)' "$out/ctest_gpu.log" | head -20

# --- compute-sanitizer memcheck on short filters --------------------------------------
: >"$out/sanitizer.log"
sanitize() {  # name binary filter
  local bin="$build/tests/$2"
  if [[ ! -x "$bin" ]]; then note "memcheck $1" "no binary"; return; fi
  if ! command -v compute-sanitizer >/dev/null; then note "memcheck $1" "no compute-sanitizer"; return; fi
  local t
  t=$(allow 100)
  echo "== compute-sanitizer memcheck $2 --gtest_filter=$3 (timeout ${t}s)" >>"$out/sanitizer.log"
  timeout "$t" compute-sanitizer --tool memcheck --error-exitcode 86 --leak-check no \
    "$bin" --gtest_filter="$3" >>"$out/sanitizer.log" 2>&1
  local rc=$?
  local errors
  errors=$(grep -o 'ERROR SUMMARY: [0-9]* error' "$out/sanitizer.log" | tail -1)
  case $rc in
    0) note "memcheck $1" "clean (${errors:-no summary})" ;;
    86) note "memcheck $1" "ERRORS: ${errors}" ;;
    124) note "memcheck $1" "timed out after ${t}s" ;;
    *) note "memcheck $1" "rc $rc (test failure?) ${errors}" ;;
  esac
}
sanitize kernels kernels_gpu_tests \
  'LayerNormGpu.*:ActivationGpu.*:CrossEntropyGpu.*:EmbeddingGpu.*:ReduceGpu.*:OptimizerGpu.SgdMatchesCpu'
sanitize pipeline pipeline_gpu_tests 'ExecutorGpu.OneStageCudaRunAgreesWithTheCpuRun'

# --- benchmarks -----------------------------------------------------------------------
: >"$out/bench.log"
bench() {  # binary cap extra-args...
  local bin="$build/bench/$1" cap=$2
  shift 2
  if [[ ! -x "$bin" ]]; then note "$(basename "$bin")" "not built"; return; fi
  local t
  t=$(allow "$cap")
  echo "== $bin $* (timeout ${t}s)" >>"$out/bench.log"
  timeout "$t" "$bin" --benchmark_out="$out/$(basename "$bin").json" \
    --benchmark_out_format=json "$@" >>"$out/bench.log" 2>&1
  local rc=$?
  note "$(basename "$bin")" "$([[ $rc == 0 ]] && echo ok || echo "rc $rc (124 = timed out)")"
}
bench bench_kernels_gpu 150 ${BENCH_KERNELS_FILTER:+--benchmark_filter=$BENCH_KERNELS_FILTER}
bench bench_train 90 --benchmark_min_time=0.2

# --- the table ------------------------------------------------------------------------
{
  echo
  echo "================ gpu_check summary ($((SECONDS - start)) s of ${budget} s) ================"
  printf '%s\n' "${summary[@]}"
  echo "---------------- benchmarks (median of CUDA-event times) ----------------"
  for j in "$out"/bench_kernels_gpu.json "$out"/bench_train.json; do
    [[ -s "$j" ]] || continue
    python3 - "$j" <<'PY' 2>&1 || echo "(could not read $j)"
import json, sys
data = json.load(open(sys.argv[1]))
keys = ["TFLOP/s", "pct_ceiling", "GB/s", "pct_copy_ceiling", "pct_pytorch", "tokens/s",
        "tok/s", "median_ms"]
for b in data.get("benchmarks", []):
    if b.get("run_type") == "aggregate":
        continue
    shown = [f"{k}={b[k]:.4g}" for k in keys if k in b]
    if not shown:
        shown = [f"time={b.get('real_time', 0):.4g}{b.get('time_unit', '')}"]
    print(f"{b['name'][:58]:58s} " + " ".join(shown))
PY
  done
  echo "logs: $out"
} | tee "$out/summary.txt"

#!/usr/bin/env bash
# The prepared check for the GPU machine (one H200, Ubuntu 24.04, CUDA 13.0, no network,
# 15 minutes of device time in all, at most 10 minutes a call). Two calls, each inside
# CHECK_BUDGET_S (default 360 s with a carried build); every step has a timeout, the script
# goes on after a failure, prints a short table last and exits non-zero if any step failed:
#
#   tools/gpu_check.sh [BUILD_DIR]          first call (about 6 minutes): the `gpu` tests (the
#                                           gtest cases), compute-sanitizer memcheck on short
#                                           filters, then NCCL across processes
#   tools/gpu_check.sh --bench [BUILD_DIR]  optional second call: the GPU benchmarks
#   tools/gpu_check.sh --prepare DIR        here, on the build machine: build the GPU targets
#                                           in DIR (fails if one does not build), then make
#                                           DIR-carry: the same without object files and
#                                           static libraries, plus carried-lib/ with the shared
#                                           libraries the GPU machine lacks (Google Benchmark's
#                                           soname differs between Debian 12 and Ubuntu 24.04)
#                                           and carried-lib/fallback/ with OpenMPI's, used only
#                                           if that machine has none.
#                                           Refused over 60 MiB (64 MiB travel in all). Carry
#                                           DIR-carry and pass it as BUILD_DIR.
#
# A carried BUILD_DIR is relocated: the absolute paths of the build and source folders that
# its CTest files (CTestTestfile.cmake and the gtest discovery files) name are rewritten to
# where those folders are now, and the check stops if a gpu test's binary does not resolve.
# Without BUILD_DIR it configures and builds build-gpu there (needs CLI11, nlohmann-json and
# xxhash headers, which that machine may lack); the build takes most of a 540 s budget.
# Every gpu test must be listed: a test binary that did not build would otherwise drop out of
# `ctest -L gpu` without a word. Each gpu test runs under GPU_TEST_TIMEOUT_S (default 90 s,
# above the 60 s deadline of the tests' NCCL transports, so a hung transfer reports its own
# error first), written over the TIMEOUT property the build gives them, which
# `ctest --timeout` cannot override.
# Files that come back from $OUT: env.txt, build.log, summary.txt, and ctest_gpu.log,
# ctest_nccl_mpi.log and sanitizer.log (tests) or bench.log, bench_kernels_gpu.json,
# bench_train.json and planner.log (--bench).
set -u

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cuda_lib=/usr/local/cuda-13.0/targets/x86_64-linux/lib
gpu_tests=(kernels_gpu_tests core_gpu_tests pipeline_gpu_tests comm_gpu_tests train_gpu_tests)
gpu_benches=(bench_kernels_gpu bench_train)
# The gpu-labelled script tests (nccl_mpi_train) run the command line.
gpu_tools=(conveyor_cli)
carry_limit_mib=60

# ------------------------------------------------------------------------- --prepare DIR
if [[ "${1:-}" == "--prepare" ]]; then
  dir=${2:?usage: tools/gpu_check.sh --prepare BUILD_DIR}
  cmake -S "$root" -B "$dir" -DCONVEYOR_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DCONVEYOR_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release || exit 1
  dir=$(cd "$dir" && pwd) || exit 1
  slim=$dir-carry
  rm -rf "$slim"  # a failed prepare must not leave an older carry that looks ready
  unbuilt=()
  for t in "${gpu_tests[@]}" "${gpu_benches[@]}" "${gpu_tools[@]}"; do
    cmake --build "$dir" -j"$(nproc)" --target "$t" || unbuilt+=("$t")
  done
  if ((${#unbuilt[@]} > 0)); then
    echo "prepare: FAILED: ${unbuilt[*]} did not build (errors above); no carry was made" >&2
    exit 1
  fi
  mkdir -p "$slim" && cp -a "$dir/." "$slim/" || exit 1
  find "$slim" \( -name '*.o' -o -name '*.a' \) -delete
  find "$slim" -type d -name CMakeFiles -prune -exec rm -rf {} +
  mkdir -p "$slim/carried-lib"
  for b in "${gpu_benches[@]}"; do
    ldd "$slim/bench/$b" | awk '/libbenchmark/ {print $3}' | xargs -r -I{} cp -L {} "$slim/carried-lib/"
  done
  # OpenMPI's libraries, used only where that machine lacks them (every test binary links
  # MPI, so without them none would start; a machine whose mpirun is another MPI has none).
  mkdir -p "$slim/carried-lib/fallback"
  ldd "$slim/tools/conveyor" |
    awk '/lib(mpi|mpi_cxx|open-rte|open-pal|hwloc|event_core|event_pthreads)[-.0-9]*so/ {print $3}' |
    xargs -r -I{} cp -L {} "$slim/carried-lib/fallback/"
  missing=()
  for t in "${gpu_tests[@]}"; do
    [[ -x "$slim/tests/$t" && -f "$slim/tests/${t}[1]_tests.cmake" ]] || missing+=("tests/$t")
  done
  for b in "${gpu_benches[@]}"; do [[ -x "$slim/bench/$b" ]] || missing+=("bench/$b"); done
  [[ -x "$slim/tools/conveyor" ]] || missing+=("tools/conveyor")
  if ((${#missing[@]} > 0)); then
    echo "prepare: FAILED: $slim lacks ${missing[*]} (or its gtest list)" >&2
    rm -rf "$slim"
    exit 1
  fi
  bytes=$(du -sb "$slim" | cut -f1)
  mib=$(((bytes + 1048575) / 1048576))
  if ((bytes > carry_limit_mib * 1048576)); then
    echo "prepare: REFUSED: $slim holds $mib MiB, more than the $carry_limit_mib MiB a carried" \
         "build may take (64 MiB travel in all, sources included). Largest files:" >&2
    find "$slim" -type f -printf '%s %p\n' | sort -rn | head -5 |
      awk '{printf "  %8.1f MiB  %s\n", $1 / 1048576, $2}' >&2
    rm -rf "$slim"
    exit 1
  fi
  echo "prepare: $slim is ready ($mib MiB): carry it and pass it as BUILD_DIR"
  exit 0
fi

# ------------------------------------------------------------------------- the check
mode=tests
usage="usage: tools/gpu_check.sh [--bench] [BUILD_DIR] | --prepare DIR"
case "${1:-}" in
  -h | --help) echo "$usage"; exit 0 ;;
  --bench) mode=bench; shift ;;
  -*) echo "$usage" >&2; exit 2 ;;
esac
if (($# > 1)) || [[ "${1:-}" == -* ]]; then
  echo "$usage" >&2
  exit 2
fi
build=${1:-}
out=${OUT:-$root/gpu_check_out}
mkdir -p "$out"
budget=${CHECK_BUDGET_S:-$([[ -n "$build" ]] && echo 360 || echo 540)}
test_timeout=${GPU_TEST_TIMEOUT_S:-90}
if ! [[ $budget =~ ^[0-9]+$ && $test_timeout =~ ^[0-9]+$ ]]; then
  echo "gpu_check: CHECK_BUDGET_S and GPU_TEST_TIMEOUT_S must be whole seconds, got" \
       "'$budget' and '$test_timeout'" >&2
  exit 2
fi
start=$SECONDS
summary=()
failed=0
note() { summary+=("$(printf '%-34s %s' "$1" "$2")"); }
fail() { note "$1" "$2"; failed=1; }
# Seconds a step may take: its own cap, but never past the budget (minus a reserve for the
# table at the end).
allow() {
  local cap=$1 left=$((budget - (SECONDS - start) - 15))
  ((left < cap)) && cap=$left
  ((cap < 1)) && cap=1
  echo "$cap"
}
finish() {
  {
    echo
    echo "================ gpu_check $mode summary ($((SECONDS - start)) s of ${budget} s) ================"
    printf '%s\n' "${summary[@]}"
    if [[ $mode == bench ]]; then
      echo "---------------- benchmarks (median of CUDA-event times) ----------------"
      [[ -s "$out/planner.log" ]] && tail -6 "$out/planner.log"
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
    fi
    echo "result: $([[ $failed == 0 ]] && echo ok || echo FAILED)"
    echo "logs: $out"
  } | tee "$out/summary.txt"
  exit "$failed"
}

# Rewrites, in the CTest files under BUILD, the folders' paths at build time to their paths now.
relocate() {  # build old_build old_source source
  python3 - "$@" <<'PY'
import os, re, sys
build, old_build, old_source, source = sys.argv[1:5]
mapping = {old: new for old, new in ((old_build, build), (old_source, source)) if old and old != new}
if not mapping:
    print("relocation: none needed")
    sys.exit(0)
# One pass, longest path first: the build folder often lies inside the source folder. A
# match must end the path or one of its components (so /a/build never matches /a/build-x).
pattern = re.compile("(" + "|".join(re.escape(p) for p in sorted(mapping, key=len, reverse=True))
                     + r")(?![\w.+-])")
changed = 0
for folder, _, files in os.walk(build):
    for name in files:
        if name == "CTestTestfile.cmake" or name.endswith(("_include.cmake", "_tests.cmake")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            new = pattern.sub(lambda m: mapping[m.group(1)], text)
            if new != text:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
                changed += 1
print(f"relocation: rewrote {changed} CTest file(s): "
      + ", ".join(f"{old} -> {new}" for old, new in mapping.items()))
PY
}

# Checks what `ctest -L gpu` would run: every test's binary and working folder resolve, every
# expected binary has tests, every test has the check's timeout. Exit status 2 when a binary
# or folder does not resolve, 1 for the other problems.
check_gpu_tests() {  # listing.json timeout expected-binaries...
  python3 - "$@" <<'PY'
import json, os, sys
listing, timeout, expected = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
try:
    tests = json.load(open(listing)).get("tests", [])
except (OSError, ValueError) as e:
    print(f"  ctest gave no test list ({e}); see build.log")
    sys.exit(2)
unresolved, problems, per_binary = set(), set(), {}
for t in tests:
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    command = t.get("command") or []
    # ctest leaves out the command of a test whose binary it cannot find; the area prefix of
    # the test's name names the binary (tests/CMakeLists.txt).
    binary = os.path.basename(command[0]) if command else t["name"].split(".")[0] + "_gpu_tests"
    per_binary[binary] = per_binary.get(binary, 0) + 1
    if not command or not (os.path.isfile(command[0]) and os.access(command[0], os.X_OK)):
        where = f"'{command[0]}'" if command else "(ctest finds no file)"
        unresolved.add(f"{binary}: the binary of its tests does not resolve {where}")
    folder = props.get("WORKING_DIRECTORY")
    if folder and not os.path.isdir(folder):
        unresolved.add(f"{binary}: its tests' working folder '{folder}' does not exist")
    if float(props.get("TIMEOUT", 0)) != timeout:
        problems.add(f"{binary}: a test has timeout {props.get('TIMEOUT')} s, not {timeout:g} s")
for b in expected:
    if b not in per_binary:
        problems.add(f"{b}: no gpu tests listed (not built, or its gtest list is missing)")
for line in sorted(unresolved) + sorted(problems):
    print("  " + line)
print(f"{len(tests)} gpu tests: " + ", ".join(f"{b} {n}" for b, n in sorted(per_binary.items())))
sys.exit(2 if unresolved else 1 if problems else 0)
PY
}

export PATH="/usr/local/cuda-13.0/bin:/usr/local/cuda-13.0/compute-sanitizer:$PATH"
export LD_LIBRARY_PATH="$cuda_lib:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NCCL is no part of the CUDA toolkit (the build machine's toolkit folder happens to hold it),
# and the GPU machine may have it only inside a Python package (nvidia-nccl-cu13, PyTorch's),
# as libnccl.so.2 alone. Prints the folder above that lib/ (include/ beside it), if any.
nccl_root() {
  local lib
  lib=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib"))' \
        2>/dev/null)
  if [[ -z "$lib" || ! -e "$lib/libnccl.so.2" ]]; then
    lib=$(find /usr/local /opt /usr/lib -name libnccl.so.2 -print -quit 2>/dev/null)
    lib=${lib%/*}
  fi
  [[ -n "$lib" && -e "$lib/libnccl.so.2" ]] && echo "${lib%/*}"
}

# --- the build ------------------------------------------------------------------------
if [[ -n "$build" ]]; then
  build=$(cd -- "$build" 2>/dev/null && pwd) || { echo "gpu_check: no build folder '$1'" >&2; exit 2; }
  [[ -d "$build/carried-lib" ]] && export LD_LIBRARY_PATH="$build/carried-lib:$LD_LIBRARY_PATH"
  # The carried OpenMPI libraries only when this machine's are missing: searched before the
  # system's, they would otherwise stand in for an installed OpenMPI its mpirun matches.
  if [[ -d "$build/carried-lib/fallback" ]] &&
     ldd "$build/tools/conveyor" 2>/dev/null | grep -q 'lib.*not found'; then
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$build/carried-lib/fallback"
    note "shared libraries" "carried OpenMPI libraries used: $(ldd "$build/tools/conveyor" 2>&1 |
      grep -c 'not found') still missing"
  fi
  # Without NCCL no binary that links it starts (comm, pipeline, train tests, the CLI).
  if ldd "$build/tests/comm_gpu_tests" 2>/dev/null | grep -q 'libnccl.so.2 => not found'; then
    if nccl=$(nccl_root); then
      export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$nccl/lib"
      note "NCCL" "from $nccl/lib"
    else
      fail "NCCL" "no libnccl.so.2 on this machine: the NCCL-linked tests cannot start"
    fi
  fi
  original=$(sed -n 's/^CMAKE_CACHEFILE_DIR:INTERNAL=//p' "$build/CMakeCache.txt" 2>/dev/null)
  source_dir=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt" 2>/dev/null)
  {
    echo "reusing carried build $build (built at ${original:-?} from ${source_dir:-?})"
    relocate "$build" "$original" "$source_dir" "$root"
  } >"$out/build.log" 2>&1
  rc=$?
  if [[ $rc == 0 ]]; then note "build" "carried ($build)"; else fail "build" "relocation FAILED (build.log)"; fi
else
  build=$root/build-gpu
  t=$(allow 330)
  {
    nccl=$(nccl_root) && export NCCL_ROOT=$nccl LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$nccl/lib"
    timeout "$t" cmake -S "$root" -B "$build" -G Ninja -DCONVEYOR_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DCONVEYOR_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release &&
    if [[ $mode == tests ]]; then
      timeout "$(allow 330)" cmake --build "$build" -j16 --target "${gpu_tests[@]}" "${gpu_tools[@]}"
    else
      timeout "$(allow 330)" cmake --build "$build" -j16 --target "${gpu_benches[@]}"
    fi
  } >"$out/build.log" 2>&1
  rc=$?
  if [[ $rc == 0 ]]; then note "build" "ok"; else fail "build" "FAILED (rc $rc, see build.log)"; fi
fi

# --- the machine ----------------------------------------------------------------------
{
  echo "== date"; date -u
  echo "== nvidia-smi -L"; nvidia-smi -L
  echo "== nvidia-smi"; nvidia-smi
  echo "== versions"; nvcc --version 2>&1 | tail -2; cmake --version | head -1
  ls -l /usr/lib/x86_64-linux-gnu/libnccl.so* 2>&1
  echo "== commit"; git -C "$root" log --oneline -1 2>&1
  # Opened by the CUDA backend on its first matrix product (kernels/cublaslt_library.h), so no
  # ldd below names it: where the loader would find it.
  echo "== cuBLASLt"
  for d in ${LD_LIBRARY_PATH//:/ }; do ls "$d"/libcublasLt.so.* 2>/dev/null; done
  ldconfig -p | grep libcublasLt
  echo "== missing shared libraries"
  for b in "$build"/tests/*_gpu_tests "$build"/bench/bench_* "$build"/tools/conveyor; do
    [[ -x "$b" ]] && ldd "$b" 2>&1 | grep "not found" | sed "s|^|$(basename "$b"): |"
  done
} >"$out/env.txt" 2>&1
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if command -v nvidia-smi >/dev/null; then nvidia-smi -L 2>&1; else echo "gpu_check: no nvidia-smi here"; fi
if ((gpus > 0)); then note "GPUs" "$gpus"; else fail "GPUs" "none visible (nvidia-smi): no GPU"; fi
# Where nvidia-smi sees a GPU, a gpu test that finds no usable device fails instead of
# skipping (tests/support/test_util.h): otherwise a runtime the driver cannot serve would
# turn the whole check into skipped tests and an "ok".
((gpus > 0)) && export CONVEYOR_EXPECT_GPU=1

# --- benchmarks (--bench) -------------------------------------------------------------
if [[ $mode == bench ]]; then
  : >"$out/bench.log"
  bench() {  # binary cap extra-args...
    local bin="$build/bench/$1" cap=$2
    shift 2
    if [[ ! -x "$bin" ]]; then fail "$(basename "$bin")" "NOT BUILT"; return; fi
    local t
    t=$(allow "$cap")
    echo "== $bin $* (timeout ${t}s)" >>"$out/bench.log"
    timeout "$t" "$bin" --benchmark_out="$out/$(basename "$bin").json" \
      --benchmark_out_format=json "$@" >>"$out/bench.log" 2>&1
    local rc=$?
    if [[ $rc == 0 ]]; then note "$(basename "$bin")" "ok"
    else fail "$(basename "$bin")" "rc $rc (124 = timed out)"; fi
  }
  if ((gpus > 0)); then
    bench bench_kernels_gpu 160 ${BENCH_KERNELS_FILTER:+--benchmark_filter=$BENCH_KERNELS_FILTER}
    bench bench_train 100 --benchmark_min_time=0.2
    # The planner on the GPU: the medium preset at p = 4 on the one GPU, auto against uniform
    # and params, predicted against measured (docs/PERF.md, "Planner"); TF32, so that it fits.
    t=$(allow 150)
    planner_work=$(mktemp -d)
    echo "== bench/planner_accuracy.py, medium, p=4 (timeout ${t}s)" >>"$out/bench.log"
    timeout "$t" python3 "$root/bench/planner_accuracy.py" "$build/tools/conveyor" "$planner_work" \
      --device cuda --stages 4 --steps 4 --repetitions 3 --preset medium --batch-tokens 16384 --tf32 \
      >"$out/planner.log" 2>&1
    rc=$?
    rm -rf "$planner_work"
    if [[ $rc == 0 ]]; then note "planner, medium p=4" "ok (planner.log)"
    else fail "planner, medium p=4" "rc $rc (124 = timed out; planner.log)"; fi
  else
    note "benchmarks" "skipped: no GPU"
  fi
  finish
fi

# --- the gpu tests --------------------------------------------------------------------
# Every gpu test gets the check's timeout in place of the build's (ctest's own --timeout
# applies only to tests without one).
for f in "$build"/tests/*_gpu_tests\[1\]_tests.cmake; do
  [[ -f "$f" ]] && sed -i -E "s/(LABELS gpu TIMEOUT )[0-9.]+/\1$test_timeout/g" "$f"
done
listing=$(mktemp)
ctest --test-dir "$build" -L gpu --show-only=json-v1 >"$listing" 2>>"$out/build.log"
check_gpu_tests "$listing" "$test_timeout" "${gpu_tests[@]}" | tee -a "$out/build.log"
rc=${PIPESTATUS[0]}
rm -f "$listing"
case $rc in
  0) note "gpu test list" "complete, ${test_timeout} s per test" ;;
  2) fail "gpu test list" "a binary or folder does not resolve (build.log)"
     echo "gpu_check: the build's CTest files name paths that do not resolve here; stopping" >&2
     finish ;;
  *) fail "gpu test list" "INCOMPLETE (build.log)" ;;
esac

# gpu_ctest NAME LOG CAP CTEST-ARGS...: one ctest run over gpu tests, counted in the table.
gpu_ctest() {
  local name=$1 log=$out/$2 t
  t=$(allow "$3")
  shift 3
  echo "$name (timeout ${t}s, ${test_timeout}s per test)"
  timeout "$t" ctest --test-dir "$build" -L gpu --output-on-failure --timeout "$test_timeout" \
    "$@" >"$log" 2>&1
  local rc=$?
  local passed skipped failures
  passed=$(grep -c ' Passed ' "$log")
  skipped=$(grep -c '\*\*\*Skipped' "$log")
  failures=$(grep -cE '\*\*\*(Failed|Timeout|Exception|Not Run)' "$log")
  local counts="passed $passed, failed $failures, skipped $skipped (rc $rc)"
  if [[ $rc == 0 ]]; then note "$name" "$counts"; else fail "$name" "$counts"; fi
  grep -E '\*\*\*(Failed|Timeout|Exception|Not Run)' "$log" | head -20
}
# The gtest cases first, four processes at a time: each case is a process of its own that
# pays for CUDA's start and cuBLASLt's load, which would take most of the step's cap one after
# another, and their time limits are seconds where a shared GPU costs them milliseconds.
gpu_ctest "ctest -L gpu (gtest)" ctest_gpu.log 150 -j4 -E '^nccl_mpi_train_'

# --- compute-sanitizer memcheck on short filters --------------------------------------
: >"$out/sanitizer.log"
sanitize() {  # name binary filter cap
  local bin="$build/tests/$2"
  if ((gpus == 0)); then note "memcheck $1" "skipped: no GPU"; return; fi
  if [[ ! -x "$bin" ]]; then fail "memcheck $1" "NO BINARY"; return; fi
  if ! command -v compute-sanitizer >/dev/null; then fail "memcheck $1" "no compute-sanitizer"; return; fi
  local t
  t=$(allow "$4")
  local log="$out/sanitizer.$1.log"
  echo "== compute-sanitizer memcheck $2 --gtest_filter=$3 (timeout ${t}s)" >"$log"
  timeout "$t" compute-sanitizer --tool memcheck --error-exitcode 86 --leak-check no \
    "$bin" --gtest_filter="$3" >>"$log" 2>&1
  local rc=$?
  local errors reported not_ready
  errors=$(grep -o 'ERROR SUMMARY: [0-9]* error' "$log" | tail -1)
  reported=$(grep -o 'ERROR SUMMARY: [0-9]*' <<<"$errors" | grep -o '[0-9]*$')
  # Polling an event or a stream that has not finished returns cudaErrorNotReady by design
  # (the executor and the NCCL transport poll so that a wait can be bounded); a memcheck that
  # counts those API returns as errors has found nothing else when they are all it reports.
  not_ready=$(grep -c 'Program hit cudaErrorNotReady' "$log")
  cat "$log" >>"$out/sanitizer.log" && rm -f "$log"
  if ((rc == 86)) && [[ -n "$reported" ]] && ((reported == not_ready)); then
    note "memcheck $1" "clean but for ${not_ready} cudaErrorNotReady poll(s)"
    return
  fi
  case $rc in
    0) note "memcheck $1" "clean (${errors:-no summary})" ;;
    86) fail "memcheck $1" "ERRORS: ${errors} (${not_ready} of them cudaErrorNotReady polls)" ;;
    124) fail "memcheck $1" "timed out after ${t}s" ;;
    *) fail "memcheck $1" "rc $rc (test failure?) ${errors}" ;;
  esac
}
sanitize kernels kernels_gpu_tests \
  'LayerNormGpu.*:ActivationGpu.*:CrossEntropyGpu.*:EmbeddingGpu.*:ReduceGpu.*:ElementwiseGpu.*:OptimizerGpu.SgdMatchesCpu' 75
sanitize pipeline pipeline_gpu_tests 'ExecutorGpu.OneStageCudaRunAgreesWithTheCpuRun' 50

# NCCL across processes last (mpirun; with one GPU each process is an NCCL host of its own),
# one test at a time, since each starts several processes that pay for CUDA and NCCL set-up:
# the step most likely to wait out its cap (a hung communicator) gets what the budget has
# left, after the steps above have had theirs.
gpu_ctest "ctest nccl_mpi_train_*" ctest_nccl_mpi.log 180 -R '^nccl_mpi_train_'
finish

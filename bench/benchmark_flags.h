// Google Benchmark's command line, as our benchmark binaries take it. Google Benchmark 1.7
// measures nothing and exits 0 for a filter that matches no benchmark, prints its usage and
// exits 0 for a misspelled --benchmark_format, aborts on --benchmark_repetitions=-1 and exits 1
// for a flag it does not know; here each of these is one sentence on stderr and exit status 2,
// before anything is measured.
#pragma once

#include <optional>

namespace conveyor::bench {

// Takes Google Benchmark's flags out of argv (benchmark::Initialize) after checking their
// values, then checks that nothing else is left and that the filter matches a benchmark.
// Returns the exit status to end with, or nothing when the benchmarks may run. `report`
// false keeps stderr quiet (the ranks of an MPI run other than the first), the status stays.
std::optional<int> take_benchmark_flags(int* argc, char** argv, bool report = true);

// Whether CONVEYOR_EXPECT_GPU is set (to anything but "" or "0"), as tools/gpu_check.sh sets it
// where nvidia-smi sees a GPU: there a GPU benchmark that finds no usable device fails, as the
// gpu tests do, instead of reporting an error row or nothing and exiting 0.
bool gpu_expected();

// The sentence a GPU benchmark ends with, exit status 1, when gpu_expected() and it finds no
// usable device.
inline constexpr const char* kExpectedGpuMissing =
    "no usable CUDA device, but CONVEYOR_EXPECT_GPU says this machine has one";

}  // namespace conveyor::bench

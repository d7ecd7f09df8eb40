// The main of each Google Benchmark binary that needs nothing of its own before the run.
#include <benchmark/benchmark.h>

#include "bench/benchmark_flags.h"

int main(int argc, char** argv) {
  if (const auto status = conveyor::bench::take_benchmark_flags(&argc, argv)) return *status;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

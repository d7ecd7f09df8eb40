// Repositioning the built-in Markov source, as a resume does: seek (a replay of the chain from
// the start, what a checkpoint without data.token costs) against restore (from the position
// and the token there, what the trainer's checkpoints record), at vocab 64 (the tiny preset).
//   bench_data --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <cstdint>

#include "engine/train/data.h"

namespace {

using conveyor::MarkovSource;

void BM_MarkovSeek(benchmark::State& state) {
  MarkovSource source(64, 1);
  const auto position = static_cast<uint64_t>(state.range(0));
  for (auto _ : state) {
    source.seek(position);
    benchmark::DoNotOptimize(source.current_token());
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(position),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_MarkovSeek)->Arg(1 << 20)->Arg(1 << 24)->Unit(benchmark::kMillisecond);

void BM_MarkovRestore(benchmark::State& state) {
  MarkovSource source(64, 1);
  const uint64_t position = uint64_t{1} << 40;
  for (auto _ : state) {
    source.restore(position, 5);
    benchmark::DoNotOptimize(source.current_token());
  }
}
BENCHMARK(BM_MarkovRestore);

}  // namespace

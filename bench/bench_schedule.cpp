// Host cost of the schedule pipeline for large p and m: generate, validate, simulate.
// Reports actions per second; every executor validates its schedule when it is built, and
// `conveyor schedule` each one it generates or loads, so typical sizes should stay well under
// a millisecond.
#include <benchmark/benchmark.h>

#include "engine/schedule/generators.h"
#include "engine/schedule/simulator.h"
#include "engine/schedule/validator.h"

namespace {

namespace sc = conveyor::schedule;

size_t count_actions(const sc::Schedule& s) {
  size_t n = 0;
  for (const auto& list : s.ranks) n += list.size();
  return n;
}

sc::Schedule make(sc::ScheduleKind kind, int p, int m) {
  return sc::generate(kind, p, m, kind == sc::ScheduleKind::kInterleaved ? 2 : 1);
}

void BM_Generate(benchmark::State& state, sc::ScheduleKind kind) {
  const int p = static_cast<int>(state.range(0)), m = static_cast<int>(state.range(1));
  size_t actions = 0;
  for (auto _ : state) {
    auto s = make(kind, p, m);
    actions = count_actions(s);
    benchmark::DoNotOptimize(s);
  }
  state.counters["actions"] = static_cast<double>(actions);
  state.counters["actions/s"] = benchmark::Counter(static_cast<double>(actions),
                                                   benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Validate(benchmark::State& state, sc::ScheduleKind kind) {
  const auto s = make(kind, static_cast<int>(state.range(0)), static_cast<int>(state.range(1)));
  for (auto _ : state) sc::validate(s);
  state.counters["actions/s"] = benchmark::Counter(static_cast<double>(count_actions(s)),
                                                   benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Simulate(benchmark::State& state, sc::ScheduleKind kind) {
  const auto s = make(kind, static_cast<int>(state.range(0)), static_cast<int>(state.range(1)));
  const auto costs = sc::CostModel::uniform(1, 1, 1, 0.1);
  double makespan = 0;
  for (auto _ : state) {
    const auto sim = sc::simulate(s, costs);
    makespan = sim.makespan;
    benchmark::DoNotOptimize(makespan);
  }
  state.counters["actions/s"] = benchmark::Counter(static_cast<double>(count_actions(s)),
                                                   benchmark::Counter::kIsIterationInvariantRate);
}

void sizes(benchmark::internal::Benchmark* b) {
  b->Args({8, 64})
      ->Args({16, 256})
      ->Args({32, 1024})
      ->Args({64, 1024})
      ->Unit(benchmark::kMillisecond);
}

#define CONVEYOR_SCHEDULE_BENCH(fn)                                                    \
  BENCHMARK_CAPTURE(fn, gpipe, sc::ScheduleKind::kGPipe)->Apply(sizes);                \
  BENCHMARK_CAPTURE(fn, one_f_one_b, sc::ScheduleKind::k1F1B)->Apply(sizes);           \
  BENCHMARK_CAPTURE(fn, interleaved_v2, sc::ScheduleKind::kInterleaved)->Apply(sizes); \
  BENCHMARK_CAPTURE(fn, zbh1, sc::ScheduleKind::kZBH1)->Apply(sizes);                  \
  BENCHMARK_CAPTURE(fn, zbv, sc::ScheduleKind::kZBV)->Apply(sizes)

// The scale a large cluster would ask for: p = 1024 ranks, m = 4096 micro-batches of 1F1B
// (about 25M actions), validated and simulated once: in one call, as `conveyor schedule`
// does (validate_and_simulate), and as validate() then simulate().
void BM_ValidateAndSimulateAtScale(benchmark::State& state) {
  const int p = static_cast<int>(state.range(0)), m = static_cast<int>(state.range(1));
  const auto s = make(sc::ScheduleKind::k1F1B, p, m);
  const auto costs = sc::CostModel::uniform(1, 1, 1, 0.1);
  for (auto _ : state) {
    const auto sim = sc::validate_and_simulate(s, costs);
    benchmark::DoNotOptimize(sim.makespan);
  }
  state.counters["actions"] = static_cast<double>(count_actions(s));
}
void BM_ValidateThenSimulateAtScale(benchmark::State& state) {
  const int p = static_cast<int>(state.range(0)), m = static_cast<int>(state.range(1));
  const auto s = make(sc::ScheduleKind::k1F1B, p, m);
  const auto costs = sc::CostModel::uniform(1, 1, 1, 0.1);
  for (auto _ : state) {
    sc::validate(s);
    const auto sim = sc::simulate(s, costs);
    benchmark::DoNotOptimize(sim.makespan);
  }
  state.counters["actions"] = static_cast<double>(count_actions(s));
}
BENCHMARK(BM_ValidateAndSimulateAtScale)
    ->Args({1024, 4096})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1)
    ->MeasureProcessCPUTime();
BENCHMARK(BM_ValidateThenSimulateAtScale)
    ->Args({1024, 4096})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1)
    ->MeasureProcessCPUTime();

CONVEYOR_SCHEDULE_BENCH(BM_Generate);
CONVEYOR_SCHEDULE_BENCH(BM_Validate);
CONVEYOR_SCHEDULE_BENCH(BM_Simulate);

}  // namespace

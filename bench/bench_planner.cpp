// Host cost of plan(): every schedule kind and micro-batch count with the exact partition of
// each, as `conveyor plan` and `--partition auto` run it before training starts. Planning is
// interactive, so the whole plan() should take well under a second. Counted: the rows whose
// partition is not proven the fastest of its layout (the table shows a lower bound for them),
// and whether the chosen pipeline is proven the fastest of every layout.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <iostream>
#include <random>

#include "engine/pipeline/planner.h"

namespace {

using conveyor::PlanOptions;
using conveyor::UnitCost;
using conveyor::UnitCosts;

// Costs shaped like a real model of blocks + 2 units, per micro-batch of 256 tokens, each time
// drawn within ±10 % (seeded) so that no two blocks tie, as measured costs never do:
// - an embedding: 0.1 ms forward and weight gradient, no input gradient, 8 MB of weights;
// - equal blocks: 1 ms each for F, I and W, 6 MB of activations, 3 MB of weights (12 MB of
//   state with gradients and optimizer), a 1 MiB input, 2 MiB workspace, 1 MB left from I to W;
// - a loss head four times a block's time, with 16 MB of activations and 8 MiB workspace.
// A boundary transfer takes 20 µs. CONVEYOR_BENCH_PLANNER_SEED (default 11) seeds the jitter, so
// that other tables of the same shape can be tried.
UnitCosts model_costs(int blocks) {
  const char* seed = std::getenv("CONVEYOR_BENCH_PLANNER_SEED");
  std::mt19937_64 rng(seed ? std::strtoull(seed, nullptr, 10) : 11);
  std::uniform_real_distribution<double> jitter(0.9, 1.1);
  UnitCosts c;
  c.microbatch_tokens = 256;
  c.transfer_seconds = 2e-5;
  const double mib = 1 << 20;
  c.units.push_back({1e-4 * jitter(rng), 0, 1e-4 * jitter(rng), mib, 8e6, 32e6, 16e6, 0, mib, 0});
  for (int b = 0; b < blocks; ++b)
    c.units.push_back({1e-3 * jitter(rng), 1e-3 * jitter(rng), 1e-3 * jitter(rng), 6e6, 3e6, 12e6,
                       6e6, mib, 2 * mib, 1e6});
  c.units.push_back({4e-3 * jitter(rng), 4e-3 * jitter(rng), 4e-3 * jitter(rng), 16e6, 8e6, 32e6,
                     16e6, mib, 8 * mib, 0});
  return c;
}

// Args: ranks p, memory cap in MB per device (0: none), blocks (24: a model of 26 units). The
// batch is 8p micro-batches of the measured size, so the default counts p, 2p, 4p and 8p all
// divide it.
void BM_Plan(benchmark::State& state) {
  const UnitCosts costs = model_costs(static_cast<int>(state.range(2)));
  PlanOptions options;
  options.num_ranks = static_cast<int>(state.range(0));
  options.batch_tokens = costs.microbatch_tokens * 8 * options.num_ranks;
  options.allreduce_bandwidth = 1e9;
  options.memory_cap = static_cast<double>(state.range(1)) * 1e6;
  int64_t candidates = 0, feasible = 0, unproven = 0, fastest_proven = 0;
  for (auto _ : state) {
    const conveyor::Plan plan = conveyor::plan(costs, options);
    candidates = static_cast<int64_t>(plan.candidates.size());
    feasible = unproven = 0;
    for (const auto& c : plan.candidates) {
      feasible += c.rejected.empty();
      unproven += c.rejected.empty() && !c.partition_proven;
    }
    fastest_proven = plan.fastest_pipeline_proven;
    benchmark::DoNotOptimize(plan.candidates.data());
  }
  // CONVEYOR_BENCH_PRINT_PLAN=1 prints the last plan's table: which rows stay unproven.
  if (std::getenv("CONVEYOR_BENCH_PRINT_PLAN"))
    std::cerr << conveyor::format_plan(conveyor::plan(costs, options)) << "\n";
  state.counters["candidates"] = static_cast<double>(candidates);
  state.counters["feasible"] = static_cast<double>(feasible);
  state.counters["unproven"] = static_cast<double>(unproven);
  state.counters["fastest_proven"] = static_cast<double>(fastest_proven);
}

// The model of 26 units, then one of 50, on which no search of a layout of several stages a
// rank ends within its budget: what bounds plan() is then the budget.
BENCHMARK(BM_Plan)
    ->ArgNames({"p", "cap_MB", "blocks"})
    ->Args({4, 0, 24})
    ->Args({4, 400, 24})
    ->Args({8, 0, 24})
    ->Args({8, 400, 24})
    ->Args({8, 0, 48})
    ->Args({16, 0, 48})
    ->Unit(benchmark::kMillisecond);

}  // namespace

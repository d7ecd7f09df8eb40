// What plan() proves: on random small cost tables, every row's step time against brute force
// over every contiguous partition of its layout (exact where the row says so, never below its
// lower bound), and the chosen pipeline against the best of every layout; a search under a
// ceiling stops with a lower bound above it; rows not searched to the end show that bound; a
// search from a slow incumbent, which first walks under lower ceilings, never proves more
// than the optimum.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <string>

#include "engine/core/allocator.h"
#include "engine/pipeline/partition_search.h"
#include "engine/pipeline/planner.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/simulator.h"
#include "support/contiguous_partitions.h"
#include "support/state_only_memory.h"

namespace conveyor {
namespace {

using schedule::ScheduleKind;

double simulated_step(const std::vector<UnitCost>& timed, const std::vector<StageRange>& ranges,
                      const schedule::Schedule& sched, double transfer) {
  return schedule::simulate(sched, planning::cost_model(timed, ranges, transfer)).makespan;
}

UnitCosts random_costs(int n, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> time(0.1, 3.0), bytes(100.0, 1000.0);
  UnitCosts costs;
  costs.microbatch_tokens = 64;
  costs.transfer_seconds = rng() % 2 ? 0.05 : 0.0;
  for (int u = 0; u < n; ++u) {
    UnitCost c;
    c.forward = time(rng), c.backward_input = time(rng), c.backward_weight = time(rng);
    c.activation_bytes = bytes(rng), c.parameter_bytes = bytes(rng);
    c.state_bytes = 4 * c.parameter_bytes, c.input_bytes = bytes(rng) / 4;
    costs.units.push_back(c);
  }
  return costs;
}

// A candidate's units as plan() costs them: times and activations scaled to the micro-batch
// size, and the step's ids on the first unit, its targets and losses on the last (the
// accounting plan() documents).
std::vector<UnitCost> planned_units(const UnitCosts& costs, const PlanOptions& options, int m) {
  const double factor =
      static_cast<double>(options.batch_tokens / m) / static_cast<double>(costs.microbatch_tokens);
  std::vector<UnitCost> units = costs.units;
  for (auto& u : units) {
    u.forward *= factor, u.backward_input *= factor, u.backward_weight *= factor;
    u.activation_bytes *= factor, u.input_bytes *= factor;
  }
  const auto round = [](int64_t bytes) {
    return static_cast<double>(CachingAllocator::round_size(static_cast<size_t>(bytes)));
  };
  const double ids = round(options.batch_tokens * 4);
  units.front().state_bytes += ids;
  units.back().state_bytes += ids + m * round(options.batch_tokens / m * 4);
  return units;
}

// The least simulated step time of any partition of the candidate's layout that fits the cap
// (+inf: none fits), by simulating every one.
double brute_force(const PlanCandidate& c, const UnitCosts& costs, const PlanOptions& options) {
  const auto sched = schedule::generate(c.kind, options.num_ranks, c.microbatches, c.chunks);
  const auto units = planned_units(costs, options, c.microbatches);
  const auto marks = c.recompute.any() ? c.recompute.per_unit(static_cast<int64_t>(units.size()))
                                       : std::vector<bool>{};
  const auto timed = with_recompute_time(units, marks);
  const double factor = static_cast<double>(options.batch_tokens / c.microbatches) /
                        static_cast<double>(costs.microbatch_tokens);
  double best = planning::kInf;
  testing::for_each_contiguous_partition(
      static_cast<int>(units.size()), sched.num_stages(), [&](const std::vector<StageRange>& r) {
        const auto memory = rank_memory(units, r, sched, marks);
        if (options.memory_cap > 0 &&
            *std::max_element(memory.begin(), memory.end()) > options.memory_cap * (1 + 1e-9))
          return;
        best = std::min(best, simulated_step(timed, r, sched, costs.transfer_seconds * factor));
      });
  return best;
}

// Every row of the plan against brute force; the fastest pipeline's step time is the least of
// every layout's. Returns how many rows were exact.
int check_rows(const Plan& result, const UnitCosts& costs, const PlanOptions& options,
               bool all_proven) {
  double fastest = planning::kInf;
  int exact = 0;
  for (const auto& c : result.candidates) {
    if (!c.pipelined) continue;
    SCOPED_TRACE(c.layout + " m=" + std::to_string(c.microbatches) +
                 (c.recompute.any() ? " recomputing" : ""));
    const double best = brute_force(c, costs, options);
    fastest = std::min(fastest, best);
    EXPECT_LE(c.step_lower_bound, best * (1 + 1e-9));
    if (!c.rejected.empty()) {
      if (c.step_lower_bound == planning::kInf) EXPECT_EQ(best, planning::kInf) << c.rejected;
      continue;
    }
    EXPECT_GE(c.step_seconds, best * (1 - 1e-9));
    EXPECT_LE(c.step_lower_bound, c.step_seconds);
    if (c.partition_proven) {
      EXPECT_NEAR(c.step_seconds, best, 1e-9 * best);
      EXPECT_EQ(c.step_lower_bound, c.step_seconds);
      ++exact;
    } else {
      EXPECT_FALSE(all_proven);
    }
  }
  const PlanCandidate* chosen = nullptr;
  for (const auto& c : result.candidates)
    if (c.pipelined && c.rejected.empty()) {
      chosen = &c;
      break;
    }
  if (fastest == planning::kInf) {
    EXPECT_EQ(chosen, nullptr);
    return exact;
  }
  EXPECT_NE(chosen, nullptr);
  if (all_proven) EXPECT_TRUE(result.fastest_pipeline_proven);
  if (chosen && result.fastest_pipeline_proven) {
    EXPECT_TRUE(chosen->partition_proven);
    EXPECT_NEAR(chosen->step_seconds, fastest, 1e-9 * fastest);
  }
  return exact;
}

// With the default budget every row of these small tables is searched to the end: each is the
// brute-force optimum of its layout, and the chosen pipeline the fastest of all, with and
// without a cap that rejects some layouts (and makes others recompute).
TEST(PlannerProof, ChosenPipelineIsTheBruteForceBestOfEveryLayout) {
  std::mt19937_64 rng(4242);
  int plans = 0, capped = 0;
  for (int trial = 0; trial < 24; ++trial) {
    const int p = 2 + trial % 2;
    const int n = 2 * p + 1 + static_cast<int>(rng() % 3);
    const UnitCosts costs = random_costs(n, rng);
    PlanOptions options;
    options.num_ranks = p;
    options.batch_tokens = costs.microbatch_tokens * 2 * p;
    options.microbatch_counts = {p, 2 * p};
    options.include_data_parallel = trial % 3 == 0;
    SCOPED_TRACE("trial " + std::to_string(trial) + " p=" + std::to_string(p) +
                 " n=" + std::to_string(n));
    Plan result = plan(costs, options);
    check_rows(result, costs, options, true);
    // A cap between the leanest fastest row's need and its peak: some layouts no longer fit.
    double least = planning::kInf, most = 0;
    for (const auto& c : result.candidates)
      if (c.pipelined && c.rejected.empty()) {
        const double peak = *std::max_element(c.peak_bytes.begin(), c.peak_bytes.end());
        least = std::min(least, peak), most = std::max(most, peak);
      }
    options.memory_cap = least + 0.3 * (most - least);
    result = plan(costs, options);
    check_rows(result, costs, options, true);
    for (const auto& c : result.candidates) capped += !c.rejected.empty();
    ++plans;
  }
  EXPECT_EQ(plans, 24);
  EXPECT_GT(capped, 24);  // the caps did reject layouts
}

// With a budget too small to search every layout to the end (each search's, or all of them
// together), rows keep a lower bound that brute force confirms, and the table shows it instead
// of a step time.
TEST(PlannerProof, RowsNotSearchedToTheEndShowAProvenLowerBound) {
  std::mt19937_64 rng(99);
  int bounded = 0;
  for (int trial = 0; trial < 8; ++trial) {
    const UnitCosts costs = random_costs(13, rng);
    PlanOptions options;
    options.num_ranks = 3;
    options.batch_tokens = costs.microbatch_tokens * 12;
    options.microbatch_counts = {3, 12};
    options.include_data_parallel = false;
    if (trial % 2 == 0)
      options.max_simulations = 1;
    else
      options.max_search_actions = 1000;
    SCOPED_TRACE("trial " + std::to_string(trial));
    const Plan result = plan(costs, options);
    check_rows(result, costs, options, false);
    const std::string table = format_plan(result);
    for (const auto& c : result.candidates)
      if (c.rejected.empty() && !c.partition_proven) {
        ++bounded;
        char shown[64];
        std::snprintf(shown, sizeof shown, "\u2265 %.3f", c.step_lower_bound * 1e3);
        EXPECT_NE(table.find(shown), std::string::npos) << shown << "\n" << table;
      }
    EXPECT_NE(table.find(result.fastest_pipeline_proven ? "is proven the fastest pipeline"
                                                        : "not proven the fastest"),
              std::string::npos)
        << table;
  }
  EXPECT_GT(bounded, 0);  // the budget did stop some searches
}

// Under a ceiling below the optimum the search proves every partition slower than the
// ceiling (unless what it simulated on the way is proven the fastest); under one above it, it
// proves the optimum. Resumed without the ceiling, it proves the optimum too.
TEST(PlannerProof, SearchUnderACeilingProvesALowerBoundAboveIt) {
  std::mt19937_64 rng(7);
  int checked = 0, proven_anyway = 0;
  for (auto [kind, v] :
       {std::pair{ScheduleKind::k1F1B, 1}, std::pair{ScheduleKind::kZBH1, 1},
        std::pair{ScheduleKind::kInterleaved, 2}, std::pair{ScheduleKind::kZBV, 2}})
    for (int trial = 0; trial < 4; ++trial) {
      const auto sched = schedule::generate(kind, 2, 4, v);
      const int n = sched.num_stages() + 3 + trial;
      const UnitCosts costs = random_costs(n, rng);
      const planning::Sums sums(costs.units);
      const testing::StateOnlyMemory memory(sums, sched);
      double best = planning::kInf;
      testing::for_each_contiguous_partition(
          n, sched.num_stages(), [&](const std::vector<StageRange>& r) {
            best = std::min(best, simulated_step(costs.units, r, sched, 0.0));
          });
      SCOPED_TRACE(std::string(schedule::schedule_kind_name(kind)) + " trial " +
                   std::to_string(trial));
      const planning::SearchBudget budget{100000, 1000000, 1000000};
      planning::PartitionSearcher below(sums, costs.units, memory, sched, 0, 0);
      const double ceiling = 0.97 * best;
      const planning::Searched stopped = below.search(budget, ceiling);
      // What it simulated on the way is kept, and proven the fastest when no bound it dropped
      // was below it; else every partition is proven slower than the ceiling.
      if (stopped.proven) {
        EXPECT_NEAR(stopped.step, best, 1e-9 * best);
        ++proven_anyway;
      } else {
        EXPECT_GT(stopped.lower_bound, ceiling);
      }
      EXPECT_LE(stopped.lower_bound, best * (1 + 1e-9));
      if (!stopped.ranges.empty()) EXPECT_GE(stopped.step, best * (1 - 1e-9));
      const planning::Searched resumed = below.search(budget);
      EXPECT_TRUE(resumed.proven);
      EXPECT_NEAR(resumed.step, best, 1e-9 * best);
      EXPECT_EQ(resumed.lower_bound, resumed.step);

      planning::PartitionSearcher above(sums, costs.units, memory, sched, 0, 0);
      const planning::Searched found = above.search(budget, 1.05 * best);
      EXPECT_TRUE(found.proven);
      EXPECT_NEAR(found.step, best, 1e-9 * best);
      ++checked;
    }
  EXPECT_EQ(checked, 16);
  EXPECT_LT(proven_anyway, checked);  // most stopped at the ceiling
}

// From the slowest partition as the incumbent, the outside-in search of the V walks under
// ceilings below it first (iterative deepening). Resumed with budgets too small to finish,
// which cut those walks and the last one, every lower bound it reports is at most the
// brute-force optimum and never falls (within the slack of sums taken in another order), and
// it ends proving the optimum; under a ceiling below the optimum it proves a bound above the
// ceiling.
TEST(PlannerProof, DeepeningFromASlowIncumbentNeverProvesMoreThanTheOptimum) {
  std::mt19937_64 rng(123);
  int checked = 0, resumed = 0, slow = 0;
  for (int p : {3, 4, 5})
    for (int m : {p, 2 * p + 1})
      for (int trial = 0; trial < 2; ++trial) {
        const auto sched = schedule::generate(ScheduleKind::kZBV, p, m, 2);
        const int n = sched.num_stages() + 3 + static_cast<int>(rng() % 3);
        const UnitCosts costs = random_costs(n, rng);
        const double transfer = costs.transfer_seconds;
        const planning::Sums sums(costs.units);
        const testing::StateOnlyMemory memory(sums, sched);
        double best = planning::kInf, slowest_step = 0;
        std::vector<StageRange> slowest;
        testing::for_each_contiguous_partition(
            n, sched.num_stages(), [&](const std::vector<StageRange>& r) {
              const double step = simulated_step(costs.units, r, sched, transfer);
              best = std::min(best, step);
              if (step > slowest_step) slowest_step = step, slowest = r;
            });
        SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m) +
                     " n=" + std::to_string(n));
        planning::PartitionSearcher searcher(sums, costs.units, memory, sched, 0, transfer);
        // One simulation, counted as work: a short schedule's budget buys the improvement of
        // the slowest partition a few moves of one cut.
        searcher.start_from(slowest, 1);
        ASSERT_FALSE(searcher.found().ranges.empty());
        slow += searcher.found().step > best * (1 + 1e-9);
        double proved = 0;
        for (int64_t visits = 1;; visits += 1 + visits / 8) {
          ASSERT_LE(visits, 1 << 20);
          const planning::Searched found = searcher.search({1 << 20, visits, 1 << 20});
          EXPECT_LE(found.lower_bound, best * (1 + 1e-9));
          EXPECT_GE(found.lower_bound, proved * (1 - 1e-9));
          EXPECT_GE(found.step, best * (1 - 1e-9));
          proved = found.lower_bound;
          if (found.proven) {
            EXPECT_NEAR(found.step, best, 1e-9 * best);
            EXPECT_EQ(found.lower_bound, found.step);
            break;
          }
          ++resumed;
        }
        planning::PartitionSearcher under(sums, costs.units, memory, sched, 0, transfer);
        under.start_from(slowest, 1);
        const planning::Searched bounded = under.search({1 << 20, 1 << 20, 1 << 20}, 0.97 * best);
        if (bounded.proven)  // the incumbent was improved to the optimum before the search
          EXPECT_NEAR(bounded.step, best, 1e-9 * best);
        else
          EXPECT_GT(bounded.lower_bound, 0.97 * best);
        EXPECT_LE(bounded.lower_bound, best * (1 + 1e-9));
        ++checked;
      }
  EXPECT_EQ(checked, 12);
  EXPECT_GT(slow, 2);      // some searches started from a partition slower than the optimum
  EXPECT_GT(resumed, 12);  // the small budgets did stop searches
}

}  // namespace
}  // namespace conveyor

// The bounds the partition search takes from each rank's own stages, against brute force on
// random small tables: OwnStageBound never exceeds the simulated step time of the partition it
// is given, for every schedule kind; for the V of two stages a rank, the paired bound of the
// ranks still to place never exceeds the step time of any partition that completes the outer
// ones; and the search that places pairs from the outside in finds the brute-force optimum,
// with and without a memory cap and a transfer time.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>

#include "engine/pipeline/partition_search.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/simulator.h"
#include "support/contiguous_partitions.h"
#include "support/state_only_memory.h"

namespace conveyor {
namespace {

using schedule::ScheduleKind;

std::vector<UnitCost> random_units(int n, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> time(0.1, 3.0), bytes(100.0, 1000.0);
  std::vector<UnitCost> units;
  for (int u = 0; u < n; ++u) {
    UnitCost c;
    c.forward = time(rng), c.backward_input = time(rng), c.backward_weight = time(rng);
    // Some units without an input gradient, as an embedding has.
    if (rng() % 5 == 0) c.backward_input = 0;
    c.activation_bytes = bytes(rng), c.state_bytes = bytes(rng);
    units.push_back(c);
  }
  return units;
}

double step_of(const std::vector<UnitCost>& units, const std::vector<StageRange>& ranges,
               const schedule::Schedule& sched, double transfer) {
  return schedule::simulate(sched, planning::cost_model(units, ranges, transfer)).makespan;
}

std::vector<StageRange> own_ranges(const schedule::Schedule& sched, int r,
                                   const std::vector<StageRange>& ranges) {
  std::vector<StageRange> own;
  for (int s : sched.placement.stages_of(r)) own.push_back(ranges[s]);
  return own;
}

TEST(OwnStageBound, NeverExceedsThePartitionsStepTime) {
  std::mt19937_64 rng(31);
  int checked = 0;
  for (auto [kind, v] :
       {std::pair{ScheduleKind::kGPipe, 1}, std::pair{ScheduleKind::k1F1B, 1},
        std::pair{ScheduleKind::kZBH1, 1}, std::pair{ScheduleKind::kInterleaved, 2},
        std::pair{ScheduleKind::kInterleaved, 3}, std::pair{ScheduleKind::kZBV, 2}})
    for (int p : {2, 3})
      for (int m : {p, 2 * p + 1, 3 * p}) {
        if (kind == ScheduleKind::kInterleaved && m % p != 0) continue;
        const auto sched = schedule::generate(kind, p, m, v);
        const int n = sched.num_stages() + 3 + static_cast<int>(rng() % 3);
        const auto units = random_units(n, rng);
        const double transfer = rng() % 2 ? 0.05 : 0.0;
        const planning::Sums sums(units);
        const planning::OwnStageBound bound(sched, sums);
        SCOPED_TRACE(sched.name + " p=" + std::to_string(p) + " m=" + std::to_string(m));
        testing::for_each_contiguous_partition(
            n, sched.num_stages(), [&](const std::vector<StageRange>& ranges) {
              const double step = step_of(units, ranges, sched, transfer);
              for (int r = 0; r < p; ++r) {
                const auto own = own_ranges(sched, r, ranges);
                EXPECT_LE(bound.rank(r, own.data()), step * (1 + 1e-9)) << "rank " << r;
              }
              ++checked;
            });
      }
  EXPECT_GT(checked, 1000);
}

// inner(r, c_r, c_{2p-r}) bounds the ranks r .. p-1 of every partition with those cuts, so
// every node of the outside-in search (the outer ranks placed) is bounded below its
// completions' optimum; inner(0, 0, n) below every partition's; after_prefix(k, c_k) below
// that of every partition with that prefix.
TEST(PairedStageBound, NeverExceedsAnyCompletionsStepTime) {
  std::mt19937_64 rng(57);
  int checked = 0, tight = 0;
  for (int p : {2, 3, 4})
    for (int m : {p, 2 * p, 3 * p + 1})
      for (int trial = 0; trial < 3; ++trial) {
        const auto sched = schedule::generate(ScheduleKind::kZBV, p, m, 2);
        ASSERT_TRUE(planning::PairedStageBound::applies(sched.placement));
        const int stages = sched.num_stages();
        const int n = stages + 2 + static_cast<int>(rng() % (p == 4 ? 2 : 4));
        const auto units = random_units(n, rng);
        const double transfer = trial == 1 ? 0.05 : 0.0;
        const planning::Sums sums(units);
        const planning::PairedStageBound paired(sched, sums);
        SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m) +
                     " n=" + std::to_string(n));
        double best = planning::kInf;
        testing::for_each_contiguous_partition(
            n, stages, [&](const std::vector<StageRange>& ranges) {
              const double step = step_of(units, ranges, sched, transfer);
              best = std::min(best, step);
              for (int r = 0; r < p; ++r) {
                const int64_t a = r == 0 ? 0 : ranges[r - 1].end;
                const int64_t b = r == 0 ? n : ranges[stages - r].begin;
                EXPECT_LE(paired.inner(r, a, b), step * (1 + 1e-9)) << "rank " << r;
              }
              // The bound of a left-to-right prefix of k <= p stages.
              for (int k = 0; k <= p; ++k) {
                const int64_t a = k == 0 ? 0 : ranges[k - 1].end;
                EXPECT_LE(paired.after_prefix(k, a), step * (1 + 1e-9)) << "prefix " << k;
              }
              ++checked;
            });
        EXPECT_LE(paired.inner(0, 0, n), best * (1 + 1e-9));
        tight += paired.inner(0, 0, n) >= 0.9 * best;
      }
  EXPECT_GT(checked, 1000);
  EXPECT_GT(tight, 0);  // the bound is not trivially low
}

// The looped pairs' bound (interleaved, two stages a rank) against every partition's step.
TEST(LoopedPairBound, NeverExceedsTheOptimum) {
  std::mt19937_64 rng(73);
  int checked = 0, tight = 0;
  for (int p : {2, 3, 4})
    for (int m : {p, 2 * p, 4 * p})
      for (int trial = 0; trial < 3; ++trial) {
        const auto sched = schedule::generate(ScheduleKind::kInterleaved, p, m, 2);
        ASSERT_TRUE(planning::looped_pair_bound_applies(sched.placement));
        const int stages = sched.num_stages();
        const int n = stages + 1 + static_cast<int>(rng() % (p == 4 ? 2 : 4));
        const auto units = random_units(n, rng);
        const double transfer = trial == 1 ? 0.05 : 0.0;
        const planning::Sums sums(units);
        double best = planning::kInf;
        testing::for_each_contiguous_partition(
            n, stages, [&](const std::vector<StageRange>& ranges) {
              best = std::min(best, step_of(units, ranges, sched, transfer));
            });
        const double bound = planning::looped_pair_bound(sched, sums);
        SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m) +
                     " n=" + std::to_string(n));
        EXPECT_LE(bound, best * (1 + 1e-9));
        ++checked, tight += bound >= 0.9 * best;
      }
  EXPECT_EQ(checked, 27);
  EXPECT_GT(tight, 0);
}

TEST(PairedStageBound, OutsideInSearchFindsTheBruteForceOptimum) {
  std::mt19937_64 rng(91);
  int searched = 0, capped = 0;
  for (int p : {2, 3, 4})
    for (int m : {p, 2 * p})
      for (int trial = 0; trial < 3; ++trial) {
        const auto sched = schedule::generate(ScheduleKind::kZBV, p, m, 2);
        const int stages = sched.num_stages();
        const int n = stages + 1 + static_cast<int>(rng() % (p == 4 ? 2 : 4));
        const auto units = random_units(n, rng);
        const double transfer = trial == 1 ? 0.05 : 0.0;
        const planning::Sums sums(units);
        const testing::StateOnlyMemory memory(sums, sched);
        // Trial 2: a cap between the leanest partition's largest rank and the most's.
        double cap = 0;
        if (trial == 2) {
          double least = planning::kInf, most = 0;
          testing::for_each_contiguous_partition(
              n, stages, [&](const std::vector<StageRange>& ranges) {
                const auto bytes = memory(ranges);
                const double peak = *std::max_element(bytes.begin(), bytes.end());
                least = std::min(least, peak), most = std::max(most, peak);
              });
          cap = least + 0.2 * (most - least);
        }
        double best = planning::kInf;
        testing::for_each_contiguous_partition(
            n, stages, [&](const std::vector<StageRange>& ranges) {
              const auto bytes = memory(ranges);
              if (cap > 0 && *std::max_element(bytes.begin(), bytes.end()) > cap * (1 + 1e-9))
                return;
              best = std::min(best, step_of(units, ranges, sched, transfer));
            });
        SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m) +
                     " trial=" + std::to_string(trial));
        planning::SearchBudget budget;
        budget.simulations = 1 << 20, budget.visits = 1 << 20, budget.relaxed = 1 << 20;
        planning::PartitionSearcher searcher(sums, units, memory, sched, cap, transfer);
        EXPECT_LE(searcher.root_bound(), best * (1 + 1e-9));
        const planning::Searched found = searcher.search(budget);
        ASSERT_TRUE(found.proven);
        EXPECT_NEAR(found.step, best, 1e-9 * best);
        // Under a ceiling below the optimum, a fresh search proves a bound above the ceiling
        // and no higher than the optimum.
        planning::PartitionSearcher under(sums, units, memory, sched, cap, transfer);
        const planning::Searched bounded = under.search(budget, 0.97 * best);
        EXPECT_LE(bounded.lower_bound, best * (1 + 1e-9));
        if (!bounded.proven) EXPECT_GE(bounded.lower_bound, 0.97 * best * (1 - 1e-9));
        ++searched, capped += cap > 0;
      }
  EXPECT_EQ(searched, 18);
  EXPECT_EQ(capped, 6);
}

}  // namespace
}  // namespace conveyor

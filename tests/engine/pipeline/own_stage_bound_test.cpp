// The bounds the partition search takes from each rank's own stages, against brute force on
// random small tables: OwnStageBound never exceeds the simulated step time of the partition it
// is given, and its relay terms never exceed the simulated times of the last micro-batch's
// gradient steps, for every schedule kind; for the V and the loop of two stages a rank, the
// bound of every node of the search that places pairs from the outside in never exceeds the
// step time of any partition that completes it; the loop's tables under a cap are the exact
// ones cut at the cap; and both pair searches find the brute-force optimum (the V's with and
// without a memory cap and a transfer time; the loop's under a ceiling, where it runs).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>

#include "engine/pipeline/partition_search.h"
#include "engine/pipeline/stage_bounds.h"
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

// For each of `kinds` (kind, stages per rank) at p = 2 and 3 and m = p, 2p + 1 and 3p (where
// the kind is defined), a table of a few more random units than stages and a transfer time of 0
// or 0.05, drawn from `rng`: fn(schedule, units, transfer), under a trace naming the case.
template <typename Fn>
void for_each_random_case(std::mt19937_64& rng,
                          std::initializer_list<std::pair<ScheduleKind, int>> kinds, Fn&& fn) {
  for (auto [kind, v] : kinds)
    for (int p : {2, 3})
      for (int m : {p, 2 * p + 1, 3 * p}) {
        if (kind == ScheduleKind::kInterleaved && m % p != 0) continue;
        const auto sched = schedule::generate(kind, p, m, v);
        const int n = sched.num_stages() + 3 + static_cast<int>(rng() % 3);
        const auto units = random_units(n, rng);
        const double transfer = rng() % 2 ? 0.05 : 0.0;
        SCOPED_TRACE(sched.name + " p=" + std::to_string(p) + " m=" + std::to_string(m));
        fn(sched, units, transfer);
      }
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
  for_each_random_case(
      rng,
      {{ScheduleKind::kGPipe, 1},
       {ScheduleKind::k1F1B, 1},
       {ScheduleKind::kZBH1, 1},
       {ScheduleKind::kInterleaved, 2},
       {ScheduleKind::kInterleaved, 3},
       {ScheduleKind::kZBV, 2}},
      [&](const schedule::Schedule& sched, const std::vector<UnitCost>& units, double transfer) {
        const planning::Sums sums(units);
        const planning::OwnStageBound bound(sched, sums);
        testing::for_each_contiguous_partition(
            static_cast<int>(units.size()), sched.num_stages(),
            [&](const std::vector<StageRange>& ranges) {
              const double step = step_of(units, ranges, sched, transfer);
              for (int r = 0; r < sched.num_ranks(); ++r) {
                const auto own = own_ranges(sched, r, ranges);
                EXPECT_LE(bound.rank(r, own.data()), step * (1 + 1e-9)) << "rank " << r;
              }
              ++checked;
            });
      });
  EXPECT_GT(checked, 1000);
}

// The relay terms against the simulator's times of the action they are about: the gradient
// step of the last micro-batch on each own stage ends no earlier than its relay end, and the
// step time is at least its start plus its relay rest.
TEST(OwnStageBound, RelayTermsNeverExceedTheSimulatedTimes) {
  std::mt19937_64 rng(37);
  int checked = 0, relays = 0;
  for_each_random_case(
      rng,
      {{ScheduleKind::kGPipe, 1},
       {ScheduleKind::k1F1B, 1},
       {ScheduleKind::kZBH1, 1},
       {ScheduleKind::kInterleaved, 2},
       {ScheduleKind::kZBV, 2}},
      [&](const schedule::Schedule& sched, const std::vector<UnitCost>& units, double transfer) {
        const int m = sched.num_microbatches;
        const planning::Sums sums(units);
        const planning::OwnStageBound bound(sched, sums);
        schedule::Replay replay(sched);
        testing::for_each_contiguous_partition(
            static_cast<int>(units.size()), sched.num_stages(),
            [&](const std::vector<StageRange>& ranges) {
              const double step = replay.run(planning::cost_model(units, ranges, transfer));
              for (int r = 0; r < sched.num_ranks(); ++r) {
                const auto own = own_ranges(sched, r, ranges);
                const auto stages = sched.placement.stages_of(r);
                EXPECT_LE(bound.busy(r, own.data()), step * (1 + 1e-9));
                for (int k = 0; k < static_cast<int>(stages.size()); ++k) {
                  const auto t = bound.terms(r, own.data(), k);
                  EXPECT_EQ(t.bound, bound.rank(r, own.data()));
                  const auto& list = sched.ranks[r];
                  int at = -1;
                  for (int j = 0; j < static_cast<int>(list.size()); ++j)
                    if ((list[j].kind == schedule::ActionKind::kBackward ||
                         list[j].kind == schedule::ActionKind::kBackwardInput) &&
                        list[j].stage == stages[k] && list[j].microbatch == m - 1)
                      at = j;
                  ASSERT_GE(at, 0);
                  const schedule::ActionTiming& timing = replay.timing(r, at);
                  EXPECT_LE(t.relay_end, timing.end * (1 + 1e-9) + 1e-12) << "rank " << r;
                  EXPECT_LE(timing.start + t.relay_rest, step * (1 + 1e-9)) << "rank " << r;
                  ++relays;
                }
              }
              ++checked;
            });
      });
  EXPECT_GT(checked, 1000);
  EXPECT_GT(relays, 5000);
}

// inner(r, c_r, c_{2p-r}) bounds the ranks r .. p-1 of every partition with those cuts, so
// every node of the outside-in search (the outer ranks placed) is bounded below its
// completions' optimum; inner(0, 0, n) below every partition's; after_prefix(k, c_k) below
// that of every partition with that prefix.
TEST(PairedStageBound, NeverExceedsAnyCompletionsStepTime) {
  std::mt19937_64 rng(57);
  int checked = 0, tight = 0, relayed = 0;
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
              // Every node of the outside-in search this partition completes: the ranks
              // 0 .. r placed, with the relays between them and into the ranks inside.
              planning::PairedStageBound::Outer outer;
              for (int r = 0; r < p; ++r) {
                const int64_t a = r == 0 ? 0 : ranges[r - 1].end;
                const int64_t b = r == 0 ? n : ranges[stages - r].begin;
                const auto placed =
                    paired.place(r, outer, a, ranges[r].end, ranges[stages - 1 - r].begin, b);
                EXPECT_LE(placed.bound, step * (1 + 1e-9)) << "node of rank " << r;
                // The relays add to the ranks' own bounds and the inner table.
                relayed += r + 1 < p &&
                           placed.bound > std::max(placed.next.placed,
                                                   paired.inner(r + 1, ranges[r].end,
                                                                ranges[stages - 1 - r].begin)) *
                                              (1 + 1e-9);
                outer = placed.next;
              }
              EXPECT_LE(outer.placed, step * (1 + 1e-9));
              ++checked;
            });
        EXPECT_LE(paired.inner(0, 0, n), best * (1 + 1e-9));
        tight += paired.inner(0, 0, n) >= 0.9 * best;
      }
  EXPECT_GT(checked, 1000);
  EXPECT_GT(tight, 0);    // the bound is not trivially low
  EXPECT_GT(relayed, 0);  // nor are the relays
}

// The loop's tables (interleaved, two stages a rank) against every partition's step: the
// least over middle cuts, each node of the search that places the pairs from the outside in
// under the partition's middle cut, and the prefixes of the stage-by-stage search; under a
// cap, each table is the exact one cut at the cap.
TEST(LoopedPairBound, NeverExceedsAnyCompletionsStepTime) {
  std::mt19937_64 rng(73);
  int checked = 0, partitions = 0, tight = 0;
  for (int p : {2, 3, 4})
    for (int m : {p, 2 * p, 4 * p})
      for (int trial = 0; trial < 3; ++trial) {
        const auto sched = schedule::generate(ScheduleKind::kInterleaved, p, m, 2);
        ASSERT_TRUE(planning::LoopedPairBound::applies(sched.placement));
        const int stages = sched.num_stages();
        const int n = stages + 2 + static_cast<int>(rng() % (p == 4 ? 2 : 4));
        const auto units = random_units(n, rng);
        const double transfer = trial == 1 ? 0.05 : 0.0;
        const planning::Sums sums(units);
        planning::LoopedPairBound looped(sched, sums);
        looped.prepare(planning::kInf);
        SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m) +
                     " n=" + std::to_string(n));
        double best = planning::kInf;
        testing::for_each_contiguous_partition(
            n, stages, [&](const std::vector<StageRange>& ranges) {
              const double step = step_of(units, ranges, sched, transfer);
              best = std::min(best, step);
              const int64_t middle = ranges[p - 1].end;
              EXPECT_LE(looped.middle(middle), step * (1 + 1e-9));
              double placed = 0;
              for (int r = 0; r < p; ++r) {
                const int64_t a = r == 0 ? 0 : ranges[r - 1].end;
                const int64_t b = r == 0 ? middle : ranges[p + r - 1].end;
                const double node = looped.place(middle, r, placed, a, ranges[r].end, b,
                                                 ranges[p + r].end, &placed);
                EXPECT_LE(node, step * (1 + 1e-9)) << "node of rank " << r;
              }
              for (int k = 1; k <= p; ++k)
                EXPECT_LE(looped.after_prefix(k, ranges[k - 1].end), step * (1 + 1e-9))
                    << "prefix " << k;
              for (int j = 1; j < p; ++j)
                EXPECT_LE(looped.inner(middle, j, ranges[j - 1].end, ranges[p + j - 1].end),
                          step * (1 + 1e-9))
                    << "second stages from rank " << j;
              ++partitions;
            });
        EXPECT_LE(looped.least(), best * (1 + 1e-9));
        // The partition it is least for attains it.
        const auto least = looped.least_partition();
        ASSERT_EQ(static_cast<int>(least.size()), stages);
        double largest = 0;
        for (int r = 0; r < p; ++r) {
          const StageRange own[2] = {least[r], least[p + r]};
          largest = std::max({largest, looped.own().rank(r, own), looped.own().busy(r, own)});
        }
        EXPECT_NEAR(largest, looped.least(), 1e-9 * largest);
        // Under a cap between the least and the optimum, every middle cut's bound is the
        // exact one cut at the cap.
        const double cap = 0.5 * (looped.least() + best);
        planning::LoopedPairBound capped(sched, sums);
        capped.prepare(cap);
        for (int64_t middle = p; middle <= n - p; ++middle)
          EXPECT_NEAR(capped.middle(middle), std::min(looped.middle(middle), cap), 1e-12 * cap);
        ++checked, tight += looped.least() >= 0.9 * best;
      }
  EXPECT_EQ(checked, 27);
  EXPECT_GT(partitions, 1000);
  EXPECT_GT(tight, 0);
}

// The loop's pairs are searched from the outside in under a ceiling below the best found:
// fresh searchers, one under a ceiling just above the brute-force optimum (which it must find
// and prove), one under a ceiling below it (which it proves a lower bound above).
TEST(LoopedPairBound, SearchUnderACeilingFindsTheBruteForceOptimum) {
  std::mt19937_64 rng(79);
  int searched = 0;
  for (int p : {2, 3, 4})
    for (int m : {p, 2 * p})
      for (int trial = 0; trial < 2; ++trial) {
        const auto sched = schedule::generate(ScheduleKind::kInterleaved, p, m, 2);
        const int stages = sched.num_stages();
        const int n = stages + 1 + static_cast<int>(rng() % (p == 4 ? 2 : 4));
        const auto units = random_units(n, rng);
        const double transfer = trial == 1 ? 0.05 : 0.0;
        const planning::Sums sums(units);
        const testing::StateOnlyMemory memory(sums, sched);
        double best = planning::kInf;
        testing::for_each_contiguous_partition(
            n, stages, [&](const std::vector<StageRange>& ranges) {
              best = std::min(best, step_of(units, ranges, sched, transfer));
            });
        SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m) +
                     " trial=" + std::to_string(trial));
        planning::SearchBudget budget;
        budget.simulations = 1 << 20, budget.visits = 1 << 20, budget.relaxed = 1 << 20;
        planning::PartitionSearcher searcher(sums, units, memory, sched, 0, transfer);
        const planning::Searched found = searcher.search(budget, best * (1 + 1e-6));
        ASSERT_TRUE(found.proven);
        EXPECT_NEAR(found.step, best, 1e-9 * best);
        planning::PartitionSearcher under(sums, units, memory, sched, 0, transfer);
        const planning::Searched bounded = under.search(budget, 0.97 * best);
        EXPECT_FALSE(bounded.proven && bounded.step < best * (1 - 1e-9));
        EXPECT_LE(bounded.lower_bound, best * (1 + 1e-9));
        EXPECT_GE(bounded.lower_bound, 0.97 * best * (1 - 1e-9));
        ++searched;
      }
  EXPECT_EQ(searched, 12);
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

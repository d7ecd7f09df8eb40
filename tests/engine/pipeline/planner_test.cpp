// The planner's partition: the optimum of brute-force enumeration on random cost tables, with
// and without a memory cap, for every schedule kind; its bounds never exceed a completion; an
// impossible cap says what fits. plan() itself: planner_plan_test.cpp.
#include "engine/pipeline/planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <utility>

#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/partition_search.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/simulator.h"
#include "support/contiguous_partitions.h"

namespace conveyor {
namespace {

using schedule::ScheduleKind;

std::vector<UnitCost> random_units(int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> time(0.1, 3.0), bytes(100.0, 1000.0);
  std::vector<UnitCost> units(n);
  for (auto& u : units) {
    u.forward = time(rng);
    u.backward_input = time(rng);
    u.backward_weight = time(rng);
    u.activation_bytes = bytes(rng);
    u.parameter_bytes = bytes(rng);
    u.state_bytes = 4 * u.parameter_bytes;
  }
  return units;
}

struct Evaluated {
  double bottleneck = 0;
  double peak = 0;  // largest rank memory
};

// Reference objective, written from the definitions: per-rank sums of F + I + W, and per-rank
// state plus the IR's peak held activation bytes.
Evaluated evaluate(const std::vector<UnitCost>& units, const std::vector<StageRange>& ranges,
                   const schedule::Schedule& sched) {
  std::vector<double> time(sched.num_ranks(), 0.0), memory(sched.num_ranks(), 0.0);
  std::vector<double> activation;
  for (int s = 0; s < static_cast<int>(ranges.size()); ++s) {
    double a = 0;
    for (int64_t u = ranges[s].begin; u < ranges[s].end; ++u) {
      time[sched.placement.rank_of(s)] += units[u].compute();
      memory[sched.placement.rank_of(s)] += units[u].state_bytes;
      a += units[u].activation_bytes;
    }
    activation.push_back(a);
  }
  const auto held = schedule::in_flight_per_rank(sched, activation);
  for (int r = 0; r < sched.num_ranks(); ++r) memory[r] += held[r].peak_held_bytes;
  return {*std::max_element(time.begin(), time.end()),
          *std::max_element(memory.begin(), memory.end())};
}

// The simulator's step time of a partition, written out here: per stage, the sums of its
// units' (recompute-adjusted) times.
double simulated_step(const std::vector<UnitCost>& units, const std::vector<StageRange>& ranges,
                      const schedule::Schedule& sched, double transfer = 0) {
  schedule::CostModel model;
  model.forward.clear(), model.backward_input.clear(), model.backward_weight.clear();
  for (const auto& r : ranges) {
    double f = 0, i = 0, w = 0;
    for (int64_t u = r.begin; u < r.end; ++u)
      f += units[u].forward, i += units[u].backward_input, w += units[u].backward_weight;
    model.forward.push_back(f), model.backward_input.push_back(i),
        model.backward_weight.push_back(w);
  }
  model.latency = transfer;
  return schedule::simulate(sched, model).makespan;
}

PartitionSearch unbounded(double cap = 0, std::vector<bool> recomputed = {}, double transfer = 0) {
  PartitionSearch search;
  search.memory_cap = cap;
  search.recomputed = std::move(recomputed);
  search.transfer_seconds = transfer;
  search.max_simulations = 1000000;  // enough to prove every optimum of these sizes
  return search;
}

// The planner's partition has the smallest simulated step time of every contiguous partition
// that fits (brute force: each one simulated), for every schedule kind, awkward sizes, with a
// cap that binds and without, with and without recomputation and transfer time.
TEST(Planner, PartitionEqualsBruteForceWithAndWithoutCap) {
  int checked = 0, capped = 0, not_balanced = 0;
  uint64_t seed = 1;
  std::mt19937_64 coin(12345);
  for (auto [kind, v] :
       {std::pair{ScheduleKind::kGPipe, 1}, std::pair{ScheduleKind::k1F1B, 1},
        std::pair{ScheduleKind::kZBH1, 1}, std::pair{ScheduleKind::kInterleaved, 2},
        std::pair{ScheduleKind::kZBV, 2}})
    for (int p = 1; p <= 3; ++p)
      for (int m : {2, 3, 5, 6}) {
        schedule::Schedule sched;
        try {
          sched = schedule::generate(kind, p, m, v);
        } catch (const schedule::ScheduleError&) {
          continue;
        }
        for (int trial = 0; trial < 4; ++trial) {
          const int n = sched.num_stages() + 1 + trial * 2;
          const auto units = random_units(n, seed++);
          std::vector<bool> recomputed;
          if (trial % 2 == 1)
            for (int u = 0; u < n; ++u) recomputed.push_back(coin() % 2 == 0);
          const double transfer = trial == 2 ? 0.3 : 0.0;
          const auto timed = with_recompute_time(units, recomputed);
          SCOPED_TRACE(std::string(schedule::schedule_kind_name(kind)) + " p=" + std::to_string(p) +
                       " m=" + std::to_string(m) + " n=" + std::to_string(n) +
                       (recomputed.empty() ? "" : " recomputing"));
          struct Tried {
            double step, peak, bottleneck;
          };
          std::vector<Tried> all;
          testing::for_each_contiguous_partition(
              n, sched.num_stages(), [&](const std::vector<StageRange>& r) {
                const auto memory = rank_memory(units, r, sched, recomputed);
                all.push_back({simulated_step(timed, r, sched, transfer),
                               *std::max_element(memory.begin(), memory.end()),
                               evaluate(timed, r, sched).bottleneck});
              });
          auto fastest_within = [&](double cap) {
            double best = 1e300;
            for (const auto& t : all)
              if (cap <= 0 || t.peak <= cap) best = std::min(best, t.step);
            return best;
          };
          const double best = fastest_within(0);
          const auto free = best_partition(units, sched, unbounded(0, recomputed, transfer));
          EXPECT_TRUE(free.proven);
          EXPECT_NEAR(simulated_step(timed, free.ranges, sched, transfer), best, 1e-9 * best);
          EXPECT_NEAR(free.step_seconds, best, 1e-9 * best);
          double least_bottleneck = 1e300;
          for (const auto& t : all) least_bottleneck = std::min(least_bottleneck, t.bottleneck);
          if (free.bottleneck > least_bottleneck * (1 + 1e-12)) ++not_balanced;
          ++checked;

          // A cap between the leanest partition's need and the fastest one's, so it binds.
          double lean = 1e300;
          for (const auto& t : all) lean = std::min(lean, t.peak);
          const auto free_memory = rank_memory(units, free.ranges, sched, recomputed);
          const double cap =
              lean + 0.5 * (*std::max_element(free_memory.begin(), free_memory.end()) - lean);
          const double best_capped = fastest_within(cap);
          const auto choice = best_partition(units, sched, unbounded(cap, recomputed, transfer));
          const auto memory = rank_memory(units, choice.ranges, sched, recomputed);
          EXPECT_LE(*std::max_element(memory.begin(), memory.end()), cap * (1 + 1e-9));
          EXPECT_NEAR(simulated_step(timed, choice.ranges, sched, transfer), best_capped,
                      1e-9 * best_capped);
          EXPECT_EQ(choice.rank_bytes, memory);
          if (best_capped > best * (1 + 1e-12)) ++capped;
        }
      }
  EXPECT_GT(checked, 60);
  EXPECT_GT(capped, 5);  // the cap changed the answer in some cases, so it was really applied
  // The fastest partition is not always the most balanced one: a search over the bottleneck
  // alone would have failed those cases.
  EXPECT_GT(not_balanced, 0);
}

// The relaxed simulation of a prefix (later stages at the least costs they can have) never
// exceeds the simulated step time of any partition that begins with it: the search drops
// prefixes on that bound, so one that overshot would lose the optimum. Every prefix of every
// partition, for every schedule kind, with recomputation and transfer time; the simulation
// alone and with the remaining work spread over the ranks.
TEST(Planner, RelaxedPrefixBoundNeverExceedsACompletion) {
  int checked = 0, tight = 0, raised = 0;
  uint64_t seed = 501;
  std::mt19937_64 coin(77);
  for (auto [kind, v] :
       {std::pair{ScheduleKind::kGPipe, 1}, std::pair{ScheduleKind::k1F1B, 1},
        std::pair{ScheduleKind::kZBH1, 1}, std::pair{ScheduleKind::kInterleaved, 2},
        std::pair{ScheduleKind::kZBV, 2}})
    for (int p = 2; p <= 3; ++p)
      for (int m : {3, 6}) {
        schedule::Schedule sched;
        try {
          sched = schedule::generate(kind, p, m, v);
        } catch (const schedule::ScheduleError&) {
          continue;
        }
        for (int trial = 0; trial < 2; ++trial) {
          const int n = sched.num_stages() + 2 + trial;
          std::vector<bool> recomputed;
          for (int u = 0; u < n; ++u) recomputed.push_back(coin() % 2 == 0);
          const auto timed = with_recompute_time(random_units(n, seed++), recomputed);
          const double transfer = trial == 1 ? 0.2 : 0.0;
          SCOPED_TRACE(std::string(schedule::schedule_kind_name(kind)) + " p=" + std::to_string(p) +
                       " m=" + std::to_string(m) + " n=" + std::to_string(n));
          testing::for_each_contiguous_partition(
              n, sched.num_stages(), [&](const std::vector<StageRange>& r) {
                const double step = simulated_step(timed, r, sched, transfer);
                for (size_t known = 0; known < r.size(); ++known) {
                  const std::vector<StageRange> prefix(r.begin(), r.begin() + known);
                  const double simulated =
                      planning::relaxed_step_bound(timed, sched, prefix, transfer, false);
                  const double bound = planning::relaxed_step_bound(timed, sched, prefix, transfer);
                  EXPECT_LE(simulated, step * (1 + 1e-12)) << known << " stages known";
                  EXPECT_LE(bound, step * (1 + 1e-12)) << known << " stages known, rank work";
                  EXPECT_GE(bound, simulated);
                  if (bound >= step * (1 - 1e-12)) ++tight;
                  if (bound > simulated * (1 + 1e-9)) ++raised;
                  ++checked;
                }
              });
        }
      }
  EXPECT_GT(checked, 1000);
  // Not a trivial bound: with the prefix long enough it often is the step time itself.
  EXPECT_GT(tight, checked / 50);
  // The remaining units' work spread over the ranks often says more than the least units.
  EXPECT_GT(raised, checked / 20);
}

// The memory model the brute force above uses is the one every test of rank_memory checks;
// here it is checked against the IR's held activations, written from the definitions.
TEST(Planner, RankMemoryIsStatePlusHeldActivations) {
  const auto units = random_units(7, 77);
  for (auto [kind, v] : {std::pair{ScheduleKind::k1F1B, 1}, std::pair{ScheduleKind::kZBV, 2}}) {
    const auto sched = schedule::generate(kind, 2, 4, v);
    testing::for_each_contiguous_partition(
        7, sched.num_stages(), [&](const std::vector<StageRange>& r) {
          const auto memory = rank_memory(units, r, sched);
          const double peak = *std::max_element(memory.begin(), memory.end());
          EXPECT_NEAR(peak, evaluate(units, r, sched).peak, 1e-9 * peak);
        });
  }
}

// 1F1B, p = 2, m = 4: the cut with the smallest bottleneck (14 per micro-batch) takes 67 time
// units a step, another cut 66; the planner must pick the faster one.
TEST(Planner, PicksTheFasterCutOverTheMoreBalancedOne) {
  std::vector<UnitCost> units(4);
  const double fiw[4][3] = {{2, 1, 1}, {4, 1, 2}, {1, 1, 3}, {1, 4, 4}};
  for (int u = 0; u < 4; ++u) {
    units[u].forward = fiw[u][0], units[u].backward_input = fiw[u][1];
    units[u].backward_weight = fiw[u][2];
    units[u].activation_bytes = 1, units[u].state_bytes = 1;
  }
  const auto sched = schedule::generate(ScheduleKind::k1F1B, 2, 4);
  double best = 1e300, balanced_step = 0, least_bottleneck = 1e300;
  for (int64_t cut = 1; cut < 4; ++cut) {
    const std::vector<StageRange> r{{0, cut}, {cut, 4}};
    const double step = simulated_step(units, r, sched);
    const double bottleneck = evaluate(units, r, sched).bottleneck;
    best = std::min(best, step);
    if (bottleneck < least_bottleneck) least_bottleneck = bottleneck, balanced_step = step;
  }
  ASSERT_EQ(least_bottleneck, 14);
  ASSERT_EQ(balanced_step, 67);
  ASSERT_EQ(best, 66);
  const auto choice = best_partition(units, sched);
  EXPECT_EQ(choice.step_seconds, 66);
  EXPECT_EQ(simulated_step(units, choice.ranges, sched), 66);
  EXPECT_TRUE(choice.proven);
}

// With a budget of one simulation the search cannot prove its answer, and says so.
TEST(Planner, ABudgetTooSmallToProveTheOptimumIsReported) {
  const auto units = random_units(12, 5);
  // Long enough (over 4096 actions) that the budget counts whole simulations.
  const auto sched = schedule::generate(ScheduleKind::kInterleaved, 2, 256, 2);
  PartitionSearch search;
  search.max_simulations = 1;
  const auto choice = best_partition(units, sched, search);
  EXPECT_FALSE(choice.proven);
  EXPECT_EQ(choice.simulated, 1);
  EXPECT_EQ(choice.ranges.size(), 4u);
  EXPECT_TRUE(best_partition(units, sched, unbounded()).proven);
}

// The smallest largest rank memory of any partition under `sched`.
double leanest_need(const std::vector<UnitCost>& units, const schedule::Schedule& sched) {
  double lean = 1e300;
  testing::for_each_contiguous_partition(
      static_cast<int>(units.size()), sched.num_stages(), [&](const std::vector<StageRange>& r) {
        const auto memory = rank_memory(units, r, sched);
        lean = std::min(lean, *std::max_element(memory.begin(), memory.end()));
      });
  return lean;
}

std::string no_fit_message(const std::vector<UnitCost>& units, const schedule::Schedule& sched,
                           double cap) {
  try {
    best_partition(units, sched, unbounded(cap));
  } catch (const PlanError& e) {
    return e.what();
  }
  ADD_FAILURE() << "a cap below every partition's need was accepted";
  return {};
}

TEST(Planner, ImpossibleCapNamesTheOverflowAndWhatFits) {
  const auto units = random_units(6, 99);
  const auto sched = schedule::generate(ScheduleKind::kGPipe, 2, 4);
  const double lean = leanest_need(units, sched);
  const std::string what = no_fit_message(units, sched, lean * 0.9);
  EXPECT_NE(what.find("rank "), std::string::npos) << what;
  EXPECT_NE(what.find(" over"), std::string::npos) << what;
  EXPECT_NE(what.find("smallest cap any partition fits"), std::string::npos) << what;
  EXPECT_NE(what.find("4 micro-batches held"), std::string::npos) << what;  // GPipe holds m
  EXPECT_NO_THROW(best_partition(units, sched, unbounded(lean)));
}

// With several stages per rank the message names the rank and each of its stages.
TEST(Planner, ImpossibleCapNamesTheStagesOfTheRank) {
  const auto units = random_units(8, 31);
  const auto sched = schedule::generate(ScheduleKind::kInterleaved, 2, 4, 2);
  const std::string what = no_fit_message(units, sched, leanest_need(units, sched) * 0.9);
  const bool rank0 = what.find("rank 0 (stages 0 and 2)") != std::string::npos;
  const bool rank1 = what.find("rank 1 (stages 1 and 3)") != std::string::npos;
  EXPECT_TRUE(rank0 || rank1) << what;
}

// When more stages would let every rank fit, the message says how many; when none would, it
// does not suggest them.
TEST(Planner, ImpossibleCapSaysHowManyStagesWouldFit) {
  const auto units = random_units(8, 47);
  const auto two = schedule::generate(ScheduleKind::k1F1B, 2, 4);
  const auto three = schedule::generate(ScheduleKind::k1F1B, 3, 4);
  const double lean2 = leanest_need(units, two), lean3 = leanest_need(units, three);
  ASSERT_LT(lean3, lean2);  // a third of the state per rank instead of a half
  const std::string what = no_fit_message(units, two, 0.5 * (lean2 + lean3));
  EXPECT_NE(what.find("with 3 stages every rank fits"), std::string::npos) << what;
  EXPECT_NE(what.find("recompute activations"), std::string::npos) << what;
  EXPECT_NE(what.find("fewer micro-batches"), std::string::npos) << what;

  const std::string hopeless = no_fit_message(units, two, 1.0);
  EXPECT_EQ(hopeless.find("every rank fits"), std::string::npos) << hopeless;
}

// When the cap is the ranks' shares of one device (the CPU), more stages divide it further:
// the count suggested is one whose ranks fit their smaller shares, or none is suggested.
TEST(Planner, ImpossibleSharedCapCountsStagesAgainstTheirShares) {
  const auto units = random_units(8, 47);
  const auto two = schedule::generate(ScheduleKind::k1F1B, 2, 4);
  const auto three = schedule::generate(ScheduleKind::k1F1B, 3, 4);
  const double lean2 = leanest_need(units, two), lean3 = leanest_need(units, three);
  const double cap = 0.5 * (lean2 + lean3);
  for (const double reserve : {0.0, 0.1 * lean3}) {
    SCOPED_TRACE("reserve " + std::to_string(reserve));
    PartitionSearch shared = unbounded(cap);
    shared.cap_shared_by_ranks = true;
    shared.cap_reserve = reserve;
    std::string what;
    try {
      best_partition(units, two, shared);
      ADD_FAILURE() << "a cap below every partition's need was accepted";
    } catch (const PlanError& e) {
      what = e.what();
    }
    // Three ranks' shares are two thirds of two ranks' (the reserve aside), too little here.
    ASSERT_GT(lean3, (cap + reserve) * 2 / 3 - reserve);
    EXPECT_EQ(what.find("with 3 stages"), std::string::npos) << what;
    const auto with = what.find("; with ");
    if (with == std::string::npos) continue;
    const int more = std::stoi(what.substr(with + 7));
    const auto sched = schedule::generate(ScheduleKind::k1F1B, more, 4);
    EXPECT_LE(leanest_need(units, sched), (cap + reserve) * 2 / more - reserve) << what;
  }
}

TEST(Planner, TooFewUnitsForTheStagesIsAnError) {
  EXPECT_THROW(best_partition(random_units(3, 5), schedule::generate(ScheduleKind::k1F1B, 4, 4)),
               PlanError);
}

TEST(Planner, BlocksOfRangesLeaveOutTheFirstAndLastUnit) {
  EXPECT_EQ(blocks_of({{0, 3}, {3, 7}, {7, 10}}), (std::vector<int64_t>{2, 4, 2}));
  EXPECT_EQ(blocks_of({{0, 5}}), (std::vector<int64_t>{3}));
}

}  // namespace
}  // namespace conveyor

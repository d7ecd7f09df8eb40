// The planner with recomputation, on small cost tables: the rebuilt forward counts in the
// backward the simulator times, recomputed stages keep only their input, and a layout that
// does not fit a cap is offered again recomputing every unit.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include "engine/pipeline/planner.h"
#include "engine/schedule/simulator.h"

namespace conveyor {
namespace {

using schedule::ScheduleKind;

// Embedding, `blocks` blocks and a head; activations dominate the memory.
UnitCosts activation_heavy(int blocks) {
  UnitCosts costs;
  costs.microbatch_tokens = 256;
  costs.transfer_seconds = 1e-5;
  //            F      I      W      saved    params state  input
  UnitCost embedding{1e-4, 0, 1e-4, 2048, 1000, 4000, 0};
  UnitCost block{1e-3, 2e-3, 1e-3, 40960, 1000, 4000, 4096};
  UnitCost head{2e-3, 3e-3, 2e-3, 65536, 2000, 8000, 4096};
  costs.units.push_back(embedding);
  for (int b = 0; b < blocks; ++b) costs.units.push_back(block);
  costs.units.push_back(head);
  return costs;
}

TEST(PlannerRecompute, TheRebuiltForwardIsPartOfTheBackwardTheSimulatorTimes) {
  const UnitCosts costs = activation_heavy(4);
  const std::vector<bool> every(costs.units.size(), true);
  const auto timed = with_recompute_time(costs.units, every);
  for (size_t u = 0; u < costs.units.size(); ++u) {
    EXPECT_EQ(timed[u].backward_input, costs.units[u].backward_input + costs.units[u].forward);
    EXPECT_EQ(timed[u].forward, costs.units[u].forward);
    EXPECT_EQ(timed[u].backward_weight, costs.units[u].backward_weight);
  }
  // Only marked units pay.
  std::vector<bool> two(costs.units.size(), false);
  two[2] = true;
  const auto partly = with_recompute_time(costs.units, two);
  EXPECT_EQ(partly[1].backward_input, costs.units[1].backward_input);
  EXPECT_EQ(partly[2].backward_input, costs.units[2].backward_input + costs.units[2].forward);

  // plan() times a recomputing candidate with B = I + F + W per stage.
  PlanOptions options;
  options.num_ranks = 2;
  options.batch_tokens = 1024;  // 4 micro-batches of the measured 256 tokens
  options.microbatch_counts = {4};
  options.include_data_parallel = false;
  options.recompute = RecomputeSpec::every_unit();
  const Plan result = plan(costs, options);
  const PlanCandidate* onef1b = nullptr;
  for (const auto& c : result.candidates)
    if (c.kind == ScheduleKind::k1F1B) onef1b = &c;
  ASSERT_NE(onef1b, nullptr);
  ASSERT_TRUE(onef1b->rejected.empty()) << onef1b->rejected;
  EXPECT_EQ(to_string(onef1b->recompute), "stage");
  schedule::CostModel model;
  model.forward.clear(), model.backward_input.clear(), model.backward_weight.clear();
  for (const auto& r : onef1b->ranges) {
    double f = 0, i = 0, w = 0;
    for (int64_t u = r.begin; u < r.end; ++u)
      f += costs.units[u].forward, i += costs.units[u].backward_input + costs.units[u].forward,
          w += costs.units[u].backward_weight;
    model.forward.push_back(f);
    model.backward_input.push_back(i);
    model.backward_weight.push_back(w);
  }
  model.latency = costs.transfer_seconds;
  const auto sched = schedule::generate(ScheduleKind::k1F1B, 2, 4);
  EXPECT_DOUBLE_EQ(onef1b->step_seconds, schedule::simulate(sched, model).makespan);
}

TEST(PlannerRecompute, RecomputedStagesHoldTheirInputsAndOneRebuild) {
  const UnitCosts costs = activation_heavy(4);
  const std::vector<bool> every(costs.units.size(), true);
  const auto sched = schedule::generate(ScheduleKind::k1F1B, 2, 4);
  const std::vector<StageRange> ranges = {{0, 3}, {3, 6}};
  const auto plain = rank_memory(costs.units, ranges, sched);
  const auto recomputed = rank_memory(costs.units, ranges, sched, every);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const StageRange& st = ranges[r];
    double state = 0, saved = 0;
    for (int64_t u = st.begin; u < st.end; ++u)
      state += costs.units[u].state_bytes, saved += costs.units[u].activation_bytes;
    const double input = costs.units[st.begin].input_bytes;
    const int in_flight = 2 - r;  // 1F1B: p - r micro-batches on rank r
    // Every micro-batch in flight keeps the stage's input instead of its activations; the
    // backward of one rebuilds the rest (its first unit saves the kept input again). State,
    // tensors in transit and workspace are the same both ways.
    EXPECT_DOUBLE_EQ(plain[r] - recomputed[r], (in_flight - 1) * (saved - input));
    EXPECT_GT(recomputed[r], state + in_flight * input + (saved - input) - 1);
    if (in_flight > 1) EXPECT_LT(recomputed[r], plain[r]);
  }
}

TEST(PlannerRecompute, ALayoutShortOfMemoryIsOfferedRecomputingAndTheTableSaysSo) {
  const UnitCosts costs = activation_heavy(6);
  PlanOptions options;
  options.num_ranks = 2;
  options.batch_tokens = 2048;
  options.microbatch_counts = {8};
  options.include_data_parallel = false;
  // Below what any layout needs while keeping activations, above what one needs recomputing:
  // the leanest partition of every schedule the planner tries, found by trying them all.
  const std::vector<bool> every(costs.units.size(), true);
  const auto n = static_cast<int64_t>(costs.units.size());
  double smallest_plain = 1e300, smallest_recomputed = 1e300;
  for (auto [kind, v] : {std::pair{ScheduleKind::kGPipe, 1}, std::pair{ScheduleKind::k1F1B, 1},
                         std::pair{ScheduleKind::kZBH1, 1}, std::pair{ScheduleKind::kZBV, 2},
                         std::pair{ScheduleKind::kInterleaved, 2}}) {
    const auto sched = schedule::generate(kind, 2, 8, v);
    std::vector<StageRange> ranges;
    std::function<void(int64_t)> each = [&](int64_t begin) {
      if (static_cast<int>(ranges.size()) == sched.num_stages() - 1) {
        ranges.push_back({begin, n});
        const auto a = rank_memory(costs.units, ranges, sched);
        const auto b = rank_memory(costs.units, ranges, sched, every);
        smallest_plain = std::min(smallest_plain, *std::max_element(a.begin(), a.end()));
        smallest_recomputed = std::min(smallest_recomputed, *std::max_element(b.begin(), b.end()));
        ranges.pop_back();
        return;
      }
      const int left = sched.num_stages() - static_cast<int>(ranges.size()) - 1;
      for (int64_t end = begin + 1; end <= n - left; ++end) {
        ranges.push_back({begin, end});
        each(end);
        ranges.pop_back();
      }
    };
    each(0);
  }
  ASSERT_LT(smallest_recomputed, smallest_plain);
  options.memory_cap = 0.5 * (smallest_plain + smallest_recomputed);

  const Plan result = plan(costs, options);
  const std::string table = format_plan(result);
  int plain = 0, recomputing = 0;
  for (const auto& c : result.candidates) {
    EXPECT_TRUE(c.pipelined);
    if (!c.recompute.any()) {
      ++plain;
      EXPECT_FALSE(c.rejected.empty()) << table;
      EXPECT_NE(c.rejected.find("or recompute activations"), std::string::npos) << c.rejected;
    } else {
      ++recomputing;
    }
  }
  // Every layout that did not fit was tried again recomputing, listed next to it.
  EXPECT_EQ(plain, recomputing);
  const PlanCandidate& best = result.best();
  EXPECT_TRUE(best.recompute.any()) << table;
  for (double bytes : best.peak_bytes) EXPECT_LE(bytes, options.memory_cap);
  EXPECT_NE(table.find("recompute  peak memory"), std::string::npos) << table;
  EXPECT_NE(table.find("%  stage "), std::string::npos) << table;
  EXPECT_NE(table.find("does not fit recomputing stage: "), std::string::npos) << table;

  // Asked not to, the planner offers no recomputing layout.
  options.recompute_when_short = false;
  for (const auto& c : plan(costs, options).candidates) EXPECT_FALSE(c.recompute.any());
}

}  // namespace
}  // namespace conveyor

// Ties between pipelines: step times the measurements do not tell apart (within two standard
// errors of their difference) are decided by keys free of the clock's noise, so that costs
// measured again within their error choose the same pipeline, where the fastest alone flips.
#include "engine/pipeline/plan_ties.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>

#include "engine/pipeline/planner.h"

namespace conveyor {
namespace {

// Embedding, `blocks` blocks (one group) and a head whose three times are each `head`
// blocks', all known to `error` (relative), as profile_units reports them.
UnitCosts measured_model(int blocks, double error, double head = 1.5) {
  UnitCosts costs;
  costs.microbatch_tokens = 256;
  costs.transfer_seconds = 1e-5;
  UnitCost embedding{1e-4, 0, 1e-4, 1024, 8000, 32000};
  UnitCost block{1e-3, 1e-3, 1e-3, 4096, 1000, 4000};
  UnitCost last{1e-3 * head, 1e-3 * head, 1e-3 * head, 16384, 8000, 32000};
  embedding.group = 0, block.group = 1, last.group = blocks + 1;
  for (UnitCost* u : {&embedding, &block, &last}) u->time_error = error;
  costs.units.push_back(embedding);
  for (int b = 0; b < blocks; ++b) costs.units.push_back(block);
  costs.units.push_back(last);
  return costs;
}

// The same costs measured again: each group's times drawn within `share` of its error.
UnitCosts measured_again(const UnitCosts& costs, double share, std::mt19937_64& rng) {
  UnitCosts out = costs;
  std::uniform_real_distribution<double> draw(-share, share);
  std::map<int64_t, double> factor;
  for (UnitCost& u : out.units) {
    if (!factor.count(u.group)) factor[u.group] = 1 + draw(rng) * u.time_error;
    u.forward *= factor[u.group], u.backward_input *= factor[u.group];
    u.backward_weight *= factor[u.group];
  }
  return out;
}

PlanOptions two_ranks() {
  PlanOptions options;
  options.num_ranks = 2;
  options.batch_tokens = 4096;
  options.include_data_parallel = false;
  return options;
}

// What a plan chose, as the table names it.
std::tuple<std::string, int, std::vector<int64_t>> choice(const Plan& plan) {
  const PlanCandidate* c = plan.fastest_pipeline();
  EXPECT_NE(c, nullptr);
  if (c == nullptr) return {};
  return {c->layout, c->microbatches, blocks_of(c->ranges)};
}

// What sixteen plans of the costs measured again choose, with their errors and taken as exact.
struct Choices {
  std::set<std::tuple<std::string, int, std::vector<int64_t>>> chosen, fastest;
};
Choices plan_again(const UnitCosts& truth, double share, const PlanOptions& options) {
  std::mt19937_64 rng(20261202);
  Choices out;
  for (int k = 0; k < 16; ++k) {
    const UnitCosts again = measured_again(truth, share, rng);
    out.chosen.insert(choice(plan(again, options)));
    PlanOptions exact = options;
    exact.time_error = 0;
    out.fastest.insert(choice(plan(again, exact)));
  }
  return out;
}

// One layout (1f1b, 8 micro-batches), a head a little lighter than a block: two partitions
// one cut apart come so close that which is faster flips with the draws; they are tied every
// time, and the same one (less memory on its fullest rank) is chosen every time.
TEST(PlanTies, APartitionTiedWithTheFastestIsChosenTheSameEveryTime) {
  PlanOptions options = two_ranks();
  options.schedule = schedule::ScheduleKind::k1F1B;
  options.microbatch_counts = {8};
  const Choices seen = plan_again(measured_model(8, 0.05, 0.9), 0.25, options);
  EXPECT_EQ(seen.chosen.size(), 1u);
  EXPECT_GT(seen.fastest.size(), 1u) << "the draws never moved the fastest; the test shows nothing";
}

// Over every layout: the draws move the fastest between pipelines, the choice stays.
TEST(PlanTies, CostsMeasuredAgainWithinTheirErrorChooseTheSamePipeline) {
  const Choices seen = plan_again(measured_model(8, 0.02), 0.25, two_ranks());
  EXPECT_EQ(seen.chosen.size(), 1u);
  EXPECT_GT(seen.fastest.size(), 1u) << "the draws never moved the fastest; the test shows nothing";
}

// Every tied pipeline is within two standard errors of the fastest, every other one beyond;
// the one chosen needs the least memory on its fullest rank of the tied ones, stands where
// the fastest would, and the fastest's time is kept.
TEST(PlanTies, TheTiedOneNeedingTheLeastMemoryIsChosen) {
  const Plan result = plan(measured_model(8, 0.05, 2), two_ranks());
  const PlanCandidate* chosen = result.fastest_pipeline();
  ASSERT_NE(chosen, nullptr);
  ASSERT_TRUE(chosen->tied);
  const PlanCandidate* fastest = nullptr;
  for (const PlanCandidate& c : result.candidates)
    if (c.pipelined && c.rejected.empty() && (!fastest || c.step_seconds < fastest->step_seconds))
      fastest = &c;
  ASSERT_NE(fastest, nullptr);
  auto peak = [](const PlanCandidate& c) {
    return *std::max_element(c.peak_bytes.begin(), c.peak_bytes.end());
  };
  int tied = 0;
  for (const PlanCandidate& c : result.candidates) {
    if (!c.pipelined || !c.rejected.empty()) continue;
    const double gap = c.step_seconds - fastest->step_seconds;
    const double error = planning::difference_error(c, *fastest);
    if (c.tied) {
      ++tied;
      EXPECT_LE(gap, 2 * error) << c.layout << " m=" << c.microbatches;
      EXPECT_LE(peak(*chosen), peak(c)) << c.layout << " m=" << c.microbatches;
    } else if (!c.step_errors.empty()) {
      EXPECT_GT(gap, 2 * error) << c.layout << " m=" << c.microbatches;
    }
  }
  EXPECT_GE(tied, 2);
  if (chosen != fastest) {
    EXPECT_EQ(result.fastest_pipeline_seconds, fastest->step_seconds);
    const std::string table = format_plan(result);
    EXPECT_NE(table.find(") is chosen: "), std::string::npos) << table;
    EXPECT_NE(table.find("~"), std::string::npos) << table;
  }
}

// Costs known exactly (no time_error, as tables written by hand) tie nothing: the fastest is
// chosen, as it always was.
TEST(PlanTies, ExactCostsTieNothing) {
  const Plan result = plan(measured_model(8, 0), two_ranks());
  for (const PlanCandidate& c : result.candidates) {
    EXPECT_FALSE(c.tied) << c.layout;
    EXPECT_TRUE(c.step_errors.empty()) << c.layout;
  }
  EXPECT_EQ(result.fastest_pipeline_seconds, 0.0);
  const PlanCandidate* chosen = result.fastest_pipeline();
  ASSERT_NE(chosen, nullptr);
  for (const PlanCandidate& c : result.candidates)
    if (c.pipelined && c.rejected.empty()) EXPECT_LE(chosen->step_seconds, c.step_seconds);
  EXPECT_EQ(format_plan(result).find("~"), std::string::npos);
}

// An error past 100 % (a few runs, most of them slowed) moves the times down to 0, never
// below: planning does not fail on it, and the pipelines tie.
TEST(PlanTies, ErrorsPastAHundredPercentPlan) {
  const Plan result = plan(measured_model(8, 1.5), two_ranks());
  const PlanCandidate* chosen = result.fastest_pipeline();
  ASSERT_NE(chosen, nullptr);
  EXPECT_TRUE(chosen->tied);
  for (const PlanCandidate& c : result.candidates)
    for (const StepError& e : c.step_errors) EXPECT_GE(e.down, -c.step_seconds) << c.layout;
}

// One table's groups move both step times together, so only the difference of their
// sensitivities counts; two tables' errors add in quadrature.
TEST(PlanTies, DifferenceErrorsByHand) {
  PlanCandidate a, b;
  a.costs_tokens = b.costs_tokens = 512;
  // Each group counts the larger of its moves up and down.
  a.step_errors = {{1, 0.3, -0.3}, {9, 0.4, -0.2}};
  b.step_errors = {{1, 0.3, -0.3}, {9, 0.1, -0.1}, {0, 0.4, -0.1}};
  EXPECT_DOUBLE_EQ(planning::difference_error(a, b), 0.5);  // (0, 0.3, -0.4)
  b.costs_tokens = 256;
  EXPECT_DOUBLE_EQ(planning::difference_error(a, b), std::sqrt(0.09 + 0.16 + 0.09 + 0.01 + 0.16));
}

}  // namespace
}  // namespace conveyor

// validate_and_simulate proves progress with the timed run instead of a zero-cost run of its
// own: on generated and randomly perturbed schedules, under several cost models, it must throw
// exactly what validate() throws and otherwise return exactly what simulate() returns.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "engine/schedule/generators.h"
#include "engine/schedule/text_format.h"
#include "engine/schedule/validator.h"
#include "support/schedule_perturbation.h"

namespace conveyor::schedule {
namespace {

using testing::Perturbation;

// What a call leaves to compare: the error, or the whole result.
struct Outcome {
  bool failed = false;
  std::string what, rule;
  int rank = -1, index = -1;
  SimResult result;
};

Outcome separately(const Schedule& s, const CostModel& costs) {
  Outcome out;
  try {
    validate(s);
  } catch (const ValidationError& e) {
    return {true, e.what(), e.rule(), e.rank(), e.index(), {}};
  }
  out.result = simulate(s, costs);
  return out;
}

Outcome together(const Schedule& s, const CostModel& costs) {
  Outcome out;
  try {
    out.result = validate_and_simulate(s, costs);
  } catch (const ValidationError& e) {
    return {true, e.what(), e.rule(), e.rank(), e.index(), {}};
  }
  return out;
}

// Bitwise: the same operations in the same order give the same doubles.
void expect_same(const Outcome& got, const Outcome& want) {
  ASSERT_EQ(got.failed, want.failed) << (got.failed ? got.what : want.what);
  if (want.failed) {
    EXPECT_EQ(got.what, want.what);
    EXPECT_EQ(got.rule, want.rule);
    EXPECT_EQ(got.rank, want.rank);
    EXPECT_EQ(got.index, want.index);
    return;
  }
  const SimResult &g = got.result, &w = want.result;
  EXPECT_EQ(g.makespan, w.makespan);
  EXPECT_EQ(g.bubble_fraction, w.bubble_fraction);
  ASSERT_EQ(g.timing.size(), w.timing.size());
  for (size_t r = 0; r < w.timing.size(); ++r) {
    ASSERT_EQ(g.timing[r].size(), w.timing[r].size());
    for (size_t i = 0; i < w.timing[r].size(); ++i) {
      EXPECT_EQ(g.timing[r][i].start, w.timing[r][i].start) << "rank " << r << " position " << i;
      EXPECT_EQ(g.timing[r][i].end, w.timing[r][i].end) << "rank " << r << " position " << i;
    }
  }
  ASSERT_EQ(g.ranks.size(), w.ranks.size());
  for (size_t r = 0; r < w.ranks.size(); ++r) {
    const RankStats &a = g.ranks[r], &b = w.ranks[r];
    EXPECT_EQ(a.busy, b.busy);
    EXPECT_EQ(a.reduce, b.reduce);
    EXPECT_EQ(a.idle, b.idle);
    EXPECT_EQ(a.end, b.end);
    EXPECT_EQ(a.memory.peak_in_flight, b.memory.peak_in_flight);
    EXPECT_EQ(a.memory.peak_held, b.memory.peak_held);
    EXPECT_EQ(a.memory.peak_in_flight_bytes, b.memory.peak_in_flight_bytes);
    EXPECT_EQ(a.memory.peak_held_bytes, b.memory.peak_held_bytes);
  }
}

// Costs that differ by kind and stage, with transfers, activation bytes and all-reduces that
// take time: every part of the timed run is exercised.
std::vector<CostModel> cost_models(int stages) {
  std::vector<CostModel> models = {CostModel::uniform(1, 1, 1), CostModel::uniform(1, 2, 0.5, 0.3)};
  CostModel varied = CostModel::uniform(1, 1, 1, 0.0);
  varied.forward.clear(), varied.backward_input.clear(), varied.backward_weight.clear();
  for (int s = 0; s < stages; ++s) {
    varied.forward.push_back(1.0 + 0.25 * s);
    varied.backward_input.push_back(1.5 + 0.125 * (s % 3));
    varied.backward_weight.push_back(0.75 + 0.5 * (s % 2));
    varied.message_bytes.push_back(64.0 * (s + 1));
    varied.activation_bytes.push_back(100.0 + 7 * s);
    varied.gradient_bytes.push_back(1000.0 * (s + 1));
  }
  varied.latency = 0.05, varied.bandwidth = 512;
  varied.reduce_latency = 0.2, varied.reduce_bandwidth = 2000;
  models.push_back(varied);
  return models;
}

// `s` with two computes of one rank swapped and the transfers placed again for the new order
// (insert_transfers): every such schedule has its transfers where the rules want them, so
// the run decides, and a compute moved ahead of the backward it waits on deadlocks.
Schedule swap_computes(const Schedule& s, std::mt19937_64& rng) {
  Schedule out = s;
  for (auto& list : out.ranks)
    std::erase_if(list, [](const Action& a) { return !is_compute(a.kind); });
  auto& list = out.ranks[testing::uniform(rng, 0, out.num_ranks() - 1)];
  if (list.size() >= 2) {
    const int last = static_cast<int>(list.size()) - 1;
    const int a = testing::uniform(rng, 0, last);
    int b = testing::uniform(rng, std::max(0, a - 4), std::min(last, a + 4));
    if (b == a) b = a == last ? a - 1 : a + 1;
    std::swap(list[a], list[b]);
  }
  insert_transfers(&out);
  if (s.replicas > 1) add_gradient_all_reduces(&out, s.replicas);
  return out;
}

TEST(ValidateAndSimulate, EqualsValidateThenSimulateOnGeneratedAndPerturbedSchedules) {
  std::mt19937_64 rng(20261201);
  const Perturbation kAll[] = {Perturbation::kMoveWithinRank,
                               Perturbation::kMoveAcrossRanks,
                               Perturbation::kSwapSendAndReceive,
                               Perturbation::kSwapReceives,
                               Perturbation::kDrop,
                               Perturbation::kDuplicate};
  int compared = 0, accepted = 0, deadlocks = 0;
  for (const auto& [kind, name] : schedule_kinds())
    for (int p = 1; p <= 4; ++p)
      for (int m = 1; m <= 5; ++m)
        for (int replicas : {1, 2}) {
          const int v = kind == ScheduleKind::kInterleaved || kind == ScheduleKind::kZBV ? 2 : 1;
          Schedule base;
          try {
            base = generate(kind, p, m, v, replicas);
          } catch (const ScheduleError&) {
            continue;  // not defined for these values
          }
          const auto models = cost_models(base.num_stages());
          for (int draw = 0; draw < 25; ++draw) {
            Schedule s = base;
            // The first draw is the generated schedule; the others one to three perturbations,
            // half of them reorderings only (which keep every action, so that more of them
            // pass the structural checks).
            // A third of them swap two computes and place the transfers again.
            const int kinds = draw % 2 ? 3 : 6;
            if (draw % 3 == 2)
              s = swap_computes(s, rng);
            else
              for (int n = draw == 0 ? 0 : testing::uniform(rng, 1, 3); n > 0; --n)
                testing::perturb(s, kAll[testing::uniform(rng, 0, kinds - 1)], rng);
            SCOPED_TRACE(std::string(name) + " p=" + std::to_string(p) + " m=" + std::to_string(m) +
                         " replicas=" + std::to_string(replicas) + ":\n" + dump_text(s));
            for (const CostModel& costs : models) {
              const Outcome want = separately(s, costs);
              expect_same(together(s, costs), want);
              ++compared, accepted += !want.failed, deadlocks += want.rule == "deadlock";
            }
          }
        }
  std::cout << compared << " compared: " << accepted << " accepted, " << compared - accepted
            << " rejected, " << deadlocks << " of them deadlocks\n";
  // Not vacuous: both outcomes, deadlocks among the rejections, were compared many times.
  EXPECT_GT(accepted, 1000);
  EXPECT_GT(compared - accepted, 1000);
  EXPECT_GT(deadlocks, 50);
}

TEST(ValidateAndSimulate, ADeadlockIsRejectedWithValidatesError) {
  // FIFO holds on every link, but rank 1's receive stream first waits for the gradient from
  // rank 2, which needs the activation that rank 1 can only receive after it.
  const Schedule s = parse_text(
      "r0: F0.0 SA0.0>1 RG0.0<1 B0.0\n"
      "r1: RG1.0<2 RA1.0<0 F1.0 SA1.0>2 B1.0 SG1.0>0\n"
      "r2: RA2.0<1 F2.0 B2.0 SG2.0>1\n");
  const Outcome want = separately(s, CostModel::uniform(1, 2, 3, 0.5));
  ASSERT_EQ(want.rule, "deadlock");
  expect_same(together(s, CostModel::uniform(1, 2, 3, 0.5)), want);
}

}  // namespace
}  // namespace conveyor::schedule

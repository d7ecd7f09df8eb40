// A measured timeline in the simulator's terms: the mean cost of each action kind per stage,
// and the busy / idle / bubble figures, checked on timelines whose answers are known (the
// simulator's own, and hand-made ones).
#include "engine/schedule/measured_timing.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/schedule/generators.h"
#include "support/test_util.h"

namespace conveyor::schedule {
namespace {

// Seeded per-stage costs in [0.5, 2), a different draw for each kind.
CostModel random_costs(int stages, bool split, uint64_t seed) {
  auto draw = [&](uint64_t k) {
    const auto v = testing::random_floats(stages, seed + k, 0.5f, 2.0f);
    return std::vector<double>(v.begin(), v.end());
  };
  CostModel costs;
  costs.forward = draw(1);
  costs.backward_input = draw(2);
  costs.backward_weight = draw(3);
  if (!split) costs.backward = draw(4);
  costs.latency = draw(5)[0];
  return costs;
}

void expect_near(const std::vector<double>& got, const std::vector<double>& want,
                 const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t s = 0; s < want.size(); ++s)
    EXPECT_NEAR(got[s], want[s], 1e-12 * want[s]) << what << " of stage " << s;
}

TEST(MeasuredTiming, TheSimulatorsOwnTimelineGivesBackItsCostsAndBubble) {
  for (ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kGPipe, ScheduleKind::kZBH1})
    for (int p : {1, 2, 4}) {
      SCOPED_TRACE(std::string(schedule_kind_name(kind)) + " p=" + std::to_string(p));
      const Schedule sched = generate(kind, p, 6);
      const CostModel want = random_costs(sched.num_stages(), sched.splits_backward(), 40 + p);
      const SimResult sim = simulate(sched, want);

      const CostModel got = measured_costs(sched, sim.timing);
      expect_near(got.forward, want.forward, "forward");
      if (sched.splits_backward()) {
        expect_near(got.backward_input, want.backward_input, "backward_input");
        expect_near(got.backward_weight, want.backward_weight, "backward_weight");
        EXPECT_TRUE(got.backward.empty());
      } else {
        expect_near(got.backward, want.backward, "backward");
      }
      if (p > 1)
        EXPECT_NEAR(got.latency, want.latency, 1e-12 * want.latency);
      else
        EXPECT_EQ(got.latency, 0.0);  // no transfers at all

      const SimResult summary = summarize_timing(sched, sim.timing);
      EXPECT_NEAR(summary.makespan, sim.makespan, 1e-12 * sim.makespan);
      EXPECT_NEAR(summary.bubble_fraction, sim.bubble_fraction, 1e-12);
      ASSERT_EQ(summary.ranks.size(), sim.ranks.size());
      for (size_t r = 0; r < sim.ranks.size(); ++r) {
        EXPECT_NEAR(summary.ranks[r].busy, sim.ranks[r].busy, 1e-12 * sim.makespan);
        EXPECT_NEAR(summary.ranks[r].idle, sim.ranks[r].idle, 1e-12 * sim.makespan);
      }
    }
}

TEST(MeasuredTiming, MeansPerStageAndATimelineShiftedToStartAtZero) {
  // One rank, one stage, two micro-batches: F F B B, measured from 100 µs on. The two
  // forwards take 1 and 3 (mean 2), the backwards 4 and 6 (mean 5), with a gap of 2.
  const Schedule sched = generate(ScheduleKind::kGPipe, 1, 2);
  ASSERT_EQ(sched.ranks[0].size(), 4u);
  std::vector<std::vector<ActionTiming>> timing = {
      {{100, 101}, {101, 104}, {106, 110}, {110, 116}}};
  const CostModel costs = measured_costs(sched, timing);
  EXPECT_EQ(costs.forward, (std::vector<double>{2.0}));
  EXPECT_EQ(costs.backward, (std::vector<double>{5.0}));
  EXPECT_EQ(costs.latency, 0.0);

  const SimResult summary = summarize_timing(sched, timing);
  EXPECT_EQ(summary.makespan, 16.0);
  EXPECT_EQ(summary.ranks[0].busy, 14.0);
  EXPECT_EQ(summary.ranks[0].idle, 2.0);
  EXPECT_EQ(summary.ranks[0].end, 16.0);
  EXPECT_EQ(summary.bubble_fraction, 2.0 / 16.0);
  EXPECT_EQ(summary.timing[0][0].start, 0.0);
  EXPECT_EQ(summary.timing[0][3].end, 16.0);
}

TEST(MeasuredTiming, AReceivesWaitForItsSenderIsNotTransferTime) {
  // 1F1B, p = 2, m = 1, as an executor records it: each receive is posted long before its
  // message is sent (rank 1's at 0, rank 0's right after its send) and ends when the message
  // is in, so its duration is mostly waiting for the other rank's compute. Each message takes
  // 2 from its send's start. Given the costs read from this step, the simulator must give it
  // back: the same makespan and bubble.
  const Schedule sched = generate(ScheduleKind::k1F1B, 2, 1);
  auto actions = [](std::initializer_list<const char*> tokens) {
    std::vector<Action> out;
    for (const char* t : tokens) out.push_back(parse_action(t));
    return out;
  };
  ASSERT_EQ(sched.ranks[0], actions({"F0.0", "SA0.0>1", "RG0.0<1", "B0.0"}));
  ASSERT_EQ(sched.ranks[1], actions({"RA1.0<0", "F1.0", "B1.0", "SG1.0>0"}));
  const std::vector<std::vector<ActionTiming>> timing = {
      {{0, 10}, {10, 12}, {12, 41}, {41, 56}},  // F0 SA0 RG0 (waits 27) B0
      {{0, 12}, {12, 22}, {22, 39}, {39, 41}},  // RA1 (waits 10) F1 B1 SG1
  };
  const CostModel costs = measured_costs(sched, timing);
  EXPECT_EQ(costs.latency, 2.0);
  const SimResult measured = summarize_timing(sched, timing);
  const SimResult predicted = simulate(sched, costs);
  EXPECT_EQ(measured.makespan, 56.0);
  EXPECT_EQ(predicted.makespan, measured.makespan);
  EXPECT_EQ(predicted.bubble_fraction, measured.bubble_fraction);
}

TEST(MeasuredTiming, ATimelineThatDoesNotFitTheScheduleIsAClearError) {
  const Schedule sched = generate(ScheduleKind::k1F1B, 2, 2);
  std::vector<std::vector<ActionTiming>> timing(1);  // one rank short
  EXPECT_THROW(measured_costs(sched, timing), std::invalid_argument);
  timing.assign(2, {});
  for (int r = 0; r < 2; ++r) timing[r].resize(sched.ranks[r].size());
  timing[1].pop_back();  // one action short
  try {
    summarize_timing(sched, timing);
    FAIL() << "a short timeline was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
  }
}

// Brute force: the all-reduce time during which some rank computes, summed over fine slices.
double hidden_by_sweep(const Schedule& s, const SimResult& r, double dt) {
  double hidden = 0;
  for (int a = 0; a < s.num_ranks(); ++a)
    for (size_t k = 0; k < s.ranks[a].size(); ++k) {
      if (!is_reduce(s.ranks[a][k].kind)) continue;
      for (double t = r.timing[a][k].start + dt / 2; t < r.timing[a][k].end; t += dt) {
        bool busy = false;
        for (int b = 0; b < s.num_ranks() && !busy; ++b)
          for (size_t j = 0; j < s.ranks[b].size() && !busy; ++j)
            busy = is_compute(s.ranks[b][j].kind) && r.timing[b][j].start <= t &&
                   t < r.timing[b][j].end;
        if (busy) hidden += dt;
      }
    }
  return hidden;
}

// 1F1B on two ranks: the last stage's all-reduce runs while rank 0 does its last backward
// (2 units, longer than the reduction), the first stage's comes after all compute.
TEST(MeasuredTiming, TheLastStagesAllReduceHidesBehindRankZerosLastBackward) {
  const Schedule s = generate(ScheduleKind::k1F1B, 2, 4, 1, 2);
  CostModel costs = CostModel::uniform(1, 1, 1, 0);
  costs.reduce_latency = 1;
  const ReductionOverlap o = reduction_overlap(s, simulate(s, costs));
  // The lists are one replica's (the others run the same): one all-reduce per stage.
  EXPECT_DOUBLE_EQ(o.reduce_time, 2.0);
  EXPECT_DOUBLE_EQ(o.hidden_time, 1.0);
  EXPECT_DOUBLE_EQ(o.hidden_fraction(), 0.5);
}

TEST(MeasuredTiming, HiddenAllReduceTimeAgreesWithASweepOverTime) {
  for (auto kind : {ScheduleKind::k1F1B, ScheduleKind::kZBH1, ScheduleKind::kGPipe}) {
    SCOPED_TRACE(schedule_kind_name(kind));
    const Schedule s = generate(kind, 3, 6, 1, 2);
    CostModel costs = random_costs(3, s.splits_backward(), 41);
    costs.reduce_latency = 1.7;
    const SimResult r = simulate(s, costs);
    const ReductionOverlap o = reduction_overlap(s, r);
    EXPECT_NEAR(o.reduce_time, 3 * 1.7, 1e-9);
    EXPECT_NEAR(o.hidden_time, hidden_by_sweep(s, r, 1e-3), 3 * 2e-3);
    EXPECT_GT(o.hidden_time, 0.0);
  }
  const Schedule plain = generate(ScheduleKind::k1F1B, 2, 4);
  const ReductionOverlap none =
      reduction_overlap(plain, simulate(plain, CostModel::uniform(1, 1, 1, 0)));
  EXPECT_EQ(none.reduce_time, 0.0);
  EXPECT_EQ(none.hidden_fraction(), 0.0);
}

// Every receive of `world` (replicas of `s`, as the executor numbers its ranks) ends at or
// after its send began; every all-reduce ends on each replica at or after it began on all.
void expect_causal(const Schedule& s, const std::vector<std::vector<ActionTiming>>& world) {
  const int p = s.num_ranks();
  for (int d = 0; d < s.replicas; ++d)
    for (int r = 0; r < p; ++r)
      for (size_t k = 0; k < s.ranks[r].size(); ++k) {
        const Action& a = s.ranks[r][k];
        if (is_recv(a.kind)) {
          const int from = d * p + a.peer;
          for (size_t j = 0; j < s.ranks[a.peer].size(); ++j)
            if (is_send(s.ranks[a.peer][j].kind) &&
                message_key(s.ranks[a.peer][j]) == message_key(a))
              EXPECT_GE(world[d * p + r][k].end, world[from][j].start)
                  << "replica " << d << " rank " << r << " " << to_string(a);
        }
        if (is_reduce(a.kind))
          for (int e = 0; e < s.replicas; ++e)
            EXPECT_GE(world[d * p + r][k].end, world[e * p + r][k].start)
                << "replica " << d << " rank " << r << " " << to_string(a);
      }
}

// Processes that start a step some microseconds apart, each counting from its own start: a
// rank's whole timeline is early by its skew. The least shifts that make every transfer
// causal again are at most those skews, and a timeline on one clock is left as it is.
TEST(MeasuredTiming, AlignmentToTheTransfersUndoesEachProcesssOwnStart) {
  for (auto kind : {ScheduleKind::k1F1B, ScheduleKind::kInterleaved, ScheduleKind::kZBV})
    for (int replicas : {1, 3}) {
      SCOPED_TRACE(std::string(schedule_kind_name(kind)) + " x" + std::to_string(replicas));
      const int v = kind == ScheduleKind::kInterleaved ? 2 : 1;
      const Schedule s = generate(kind, 4, 8, v, replicas);
      CostModel costs = random_costs(s.num_stages(), s.splits_backward(), 43);
      costs.reduce_latency = 0.3;
      const SimResult sim = simulate(s, costs);
      std::vector<std::vector<ActionTiming>> truth;
      for (int d = 0; d < replicas; ++d)
        truth.insert(truth.end(), sim.timing.begin(), sim.timing.end());

      std::vector<std::vector<ActionTiming>> same = truth;
      const std::vector<double> none = align_to_transfers(s, same);
      ASSERT_EQ(none.size(), truth.size());
      for (double shift : none) EXPECT_EQ(shift, 0.0);
      for (size_t r = 0; r < truth.size(); ++r)
        for (size_t k = 0; k < truth[r].size(); ++k) {
          EXPECT_EQ(same[r][k].start, truth[r][k].start);
          EXPECT_EQ(same[r][k].end, truth[r][k].end);
        }

      // Skews of several transfer times, so that arrows point back in time.
      const auto skews = testing::random_floats(truth.size(), 44 + replicas, 0.0f, 6.0f);
      std::vector<std::vector<ActionTiming>> world = truth;
      for (size_t r = 0; r < world.size(); ++r)
        for (ActionTiming& t : world[r]) t.start -= skews[r], t.end -= skews[r];
      const std::vector<double> shifts = align_to_transfers(s, world);
      ASSERT_EQ(shifts.size(), world.size());
      double moved = 0;
      for (size_t r = 0; r < world.size(); ++r) {
        EXPECT_GE(shifts[r], 0.0) << "rank " << r;
        EXPECT_LE(shifts[r], skews[r] + 1e-9) << "rank " << r;
        moved = std::max(moved, shifts[r]);
        for (size_t k = 0; k < world[r].size(); ++k)
          EXPECT_DOUBLE_EQ(world[r][k].start, truth[r][k].start - skews[r] + shifts[r]);
      }
      EXPECT_GT(moved, 0.0);
      expect_causal(s, world);
    }
}

// Two receives that each end before their send began, one each way: no shift of one clock
// against the other explains both, and the timeline is left as measured.
TEST(MeasuredTiming, TransfersThatContradictEachOtherMoveNothing) {
  const Schedule s = generate(ScheduleKind::k1F1B, 2, 1);  // r0: F SA RG B, r1: RA F B SG
  std::vector<std::vector<ActionTiming>> world = {
      {{0, 1}, {1, 2}, {2, 9}, {9, 10}},
      {{0, 0.5}, {3, 4}, {4, 5}, {12, 13}},
  };
  const auto measured = world;
  EXPECT_TRUE(align_to_transfers(s, world).empty());
  for (size_t r = 0; r < world.size(); ++r)
    for (size_t k = 0; k < world[r].size(); ++k) EXPECT_EQ(world[r][k].end, measured[r][k].end);
}

}  // namespace
}  // namespace conveyor::schedule

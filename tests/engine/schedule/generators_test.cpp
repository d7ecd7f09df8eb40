// Generators: defined for every p, m where the schedule exists, clear errors elsewhere,
// weight gradients in ascending micro-batch order, placement queries.
#include "engine/schedule/generators.h"

#include <gtest/gtest.h>

#include <array>
#include <set>

#include "engine/schedule/simulator.h"
#include "engine/schedule/validator.h"

namespace conveyor::schedule {
namespace {

std::string error_of(ScheduleKind kind, int p, int m, int v = 1) {
  try {
    generate(kind, p, m, v);
  } catch (const ScheduleError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Generators, WeightGradientsAscendInEveryStage) {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 24; ++m) {
      std::vector<Schedule> all = {generate_gpipe(p, m), generate_1f1b(p, m), generate_zbh1(p, m),
                                   generate_zbv(p, m)};
      if (m % p == 0)
        all.push_back(generate_interleaved(p, m, 2)), all.push_back(generate_interleaved(p, m, 4));
      for (const auto& s : all) {
        std::string why;
        EXPECT_TRUE(weight_grads_ascending(s, &why))
            << s.name << " p=" << p << " m=" << m << ": " << why;
      }
    }
}

TEST(Generators, AscendingCheckCatchesDescendingOrder) {
  Schedule s = generate_gpipe(1, 3);
  std::swap(s.ranks[0][3], s.ranks[0][4]);  // B0.1 before B0.0
  std::string why;
  EXPECT_FALSE(weight_grads_ascending(s, &why));
  EXPECT_NE(why.find("B0.0"), std::string::npos) << why;
}

// ZB-H1's list scheduling under costs whose sums double precision cannot tell apart: a pass
// of 1 after 1e16 ends at the time it starts, and infinite times after 1e308 + 1e308. Either
// way the passes still get an order; an infinite makespan is the simulator's to refuse.
TEST(Generators, ZbH1OrdersPassesWhoseTimesDoNotAdvance) {
  for (const auto& c : {std::array{1e16, 1.0, 1.0}, std::array{1e300, 1e-300, 1e-300},
                        std::array{1e308, 1e308, 1e308}}) {
    Schedule s;
    ASSERT_NO_THROW(s = generate_zbh1(4, 8, c[0], c[1], c[2])) << c[0] << "," << c[1];
    EXPECT_NO_THROW(validate(s)) << c[0] << "," << c[1];
  }
  try {
    simulate(generate_zbh1(4, 8, 1e308, 1e308, 1e308), CostModel::uniform(1e308, 1e308, 1e308));
    ADD_FAILURE() << "an infinite makespan was simulated";
  } catch (const ScheduleError& e) {
    EXPECT_NE(std::string(e.what()).find("times overflow"), std::string::npos) << e.what();
  }
}

TEST(Generators, EveryActionExactlyOnce) {
  const Schedule s = generate_zbh1(4, 6);
  std::set<std::tuple<int, int, int>> seen;
  size_t compute = 0;
  for (const auto& list : s.ranks)
    for (const auto& a : list)
      if (is_compute(a.kind)) {
        ++compute;
        EXPECT_TRUE(seen.insert({static_cast<int>(a.kind), a.stage, a.microbatch}).second)
            << to_string(a);
      }
  EXPECT_EQ(compute, 3u * 4 * 6);
  EXPECT_TRUE(s.splits_backward());
  EXPECT_FALSE(generate_1f1b(4, 6).splits_backward());
}

TEST(Generators, ErrorsSayWhichValuesWork) {
  EXPECT_NE(error_of(ScheduleKind::kInterleaved, 4, 6, 2).find("try m=4 or m=8"),
            std::string::npos);
  EXPECT_NE(error_of(ScheduleKind::kInterleaved, 4, 3, 2).find("try m=4"), std::string::npos);
  EXPECT_NE(error_of(ScheduleKind::k1F1B, 0, 4).find("at least 1 stage"), std::string::npos);
  EXPECT_NE(error_of(ScheduleKind::kGPipe, 2, 0).find("at least 1 micro-batch"), std::string::npos);
  EXPECT_NE(error_of(ScheduleKind::kZBH1, 2, 4, 2).find("only for 'interleaved'"),
            std::string::npos);
  EXPECT_NE(error_of(ScheduleKind::kInterleaved, 2, 4, 0).find("at least 1 chunk"),
            std::string::npos);
  EXPECT_NE(error_of(ScheduleKind::k1F1B, 5000, 4).find("too large"), std::string::npos);
  EXPECT_NE(error_of(ScheduleKind::kGPipe, 4096, 8192).find("too large"), std::string::npos);
  for (const auto& [kind, name] : schedule_kinds()) {
    EXPECT_STREQ(schedule_kind_name(kind), name);
    EXPECT_EQ(parse_schedule_kind(schedule_kind_name(kind)), kind);
    EXPECT_NE(schedule_kind_choices().find(schedule_kind_name(kind)), std::string::npos);
  }
  EXPECT_EQ(parse_schedule_kind("ZB"), std::nullopt);
  // A kind made by a cast: the refusal said "unknown schedule kind" without the value.
  EXPECT_EQ(error_of(static_cast<ScheduleKind>(99), 2, 4),
            "the schedule kind 99 is none of ScheduleKind::kGPipe, k1F1B, kInterleaved, kZBH1 or "
            "kZBV");
  EXPECT_EQ(error_of(static_cast<ScheduleKind>(99), 2, 4, 2),
            "the schedule kind 99 is none of ScheduleKind::kGPipe, k1F1B, kInterleaved, kZBH1 or "
            "kZBV");
}

TEST(Generators, ZBVIsDefinedForSmallM) {
  // Fewer micro-batches than the V needs to fill: still complete, valid and deadlock-free.
  for (int p = 1; p <= 6; ++p)
    for (int m = 1; m < 2 * p; ++m) {
      const Schedule s = generate_zbv(p, m);
      EXPECT_EQ(s.placement.layout, Layout::kVShape);
      EXPECT_NO_THROW(validate(s)) << "p=" << p << " m=" << m;
    }
}

// The chunks a caller counts before generating are those the schedule holds, for every kind
// and every chunk count it takes (zbv's 1 included, which still runs its V of 2).
TEST(Generators, ChunksPerRankAreThoseGenerated) {
  for (const auto& [kind, name] : schedule_kinds())
    for (int v = 1; v <= 4; ++v) {
      if (!takes_chunks(kind, v)) continue;
      EXPECT_EQ(chunks_per_rank(kind, v), generate(kind, 2, 4, v).placement.chunks)
          << name << " v=" << v;
    }
}

TEST(Generators, InterleavedWithOneChunkIs1F1B) {
  EXPECT_EQ(generate_interleaved(4, 8, 1), generate_1f1b(4, 8));
}

TEST(Generators, InterleavedOnTwoRanksSharesLinksInFifoOrder) {
  // With p=2 the link 0->1 carries activations of stages 0 and 2 and gradients of stage 2.
  for (int v : {2, 3, 4})
    for (int m : {2, 4, 6}) {
      const Schedule s = generate_interleaved(2, m, v);
      EXPECT_NO_THROW(validate(s)) << "v=" << v << " m=" << m;
    }
}

TEST(Placement, LoopedAndVShape) {
  const Placement looped{4, 3, Layout::kLooped};
  EXPECT_EQ(looped.num_stages(), 12);
  EXPECT_EQ(looped.rank_of(9), 1);
  EXPECT_EQ(looped.stages_of(1), (std::vector<int>{1, 5, 9}));
  const Placement v{4, 2, Layout::kVShape};
  EXPECT_EQ(v.stages_of(0), (std::vector<int>{0, 7}));
  EXPECT_EQ(v.stages_of(3), (std::vector<int>{3, 4}));
  for (int s = 0; s < v.num_stages(); ++s) EXPECT_EQ(v.stage_of(v.rank_of(s), v.chunk_of(s)), s);
}

TEST(Placement, VShapeScheduleValidatesAndSimulates) {
  // GPipe order over a V layout: stages 0,3 on rank 0 and 1,2 on rank 1; stage 1 -> 2 is
  // local on rank 1, so that hand-over has no transfer.
  Schedule s;
  s.name = "gpipe-v";
  s.placement = {2, 2, Layout::kVShape};
  s.num_microbatches = 3;
  s.ranks.resize(2);
  for (int r = 0; r < 2; ++r) {
    for (int k = 0; k < 3; ++k)
      for (int st : s.placement.stages_of(r)) s.ranks[r].push_back(forward(st, k));
    for (int k = 0; k < 3; ++k) {
      auto stages = s.placement.stages_of(r);
      for (auto it = stages.rbegin(); it != stages.rend(); ++it)
        s.ranks[r].push_back(backward(*it, k));
    }
  }
  insert_transfers(&s);
  ASSERT_NO_THROW(validate(s));
  for (const auto& a : s.ranks[1]) EXPECT_FALSE(is_transfer(a.kind) && a.peer == 1);
  const SimResult sim = simulate(s, CostModel::uniform(1, 1, 1));
  // Critical path of micro-batch 0 alone: 4 forwards + 4 backwards (1 + 2) = 12.
  EXPECT_GE(sim.makespan, 12);
}

TEST(Queries, MessageKeyIsTheSameAtBothEnds) {
  const Schedule s = generate_interleaved(3, 3, 2);
  size_t matched = 0;
  for (const auto& list : s.ranks)
    for (const auto& a : list) {
      if (!is_send(a.kind)) continue;
      const MessageKey key = message_key(a);
      const ActionKind recv =
          a.kind == ActionKind::kSendAct ? ActionKind::kRecvAct : ActionKind::kRecvGrad;
      const int stage = a.kind == ActionKind::kSendAct ? a.stage + 1 : a.stage - 1;
      const ActionRef r = find_action(s, recv, stage, a.microbatch);
      ASSERT_TRUE(r.found()) << to_string(a);
      EXPECT_EQ(r.rank, a.peer);
      EXPECT_EQ(message_key(s.ranks[r.rank][r.index]), key) << to_string(a);
      ++matched;
    }
  EXPECT_EQ(matched, 2u * (6 - 1) * 3);  // every stage boundary crosses ranks, both directions
  EXPECT_THROW(message_key(forward(0, 0)), ScheduleError);
}

TEST(Queries, LastActivationUse) {
  const Schedule one = generate_1f1b(2, 2);
  const Schedule zb = generate_zbh1(2, 2);
  const int b = last_activation_use(one, 0, 1);
  ASSERT_GE(b, 0);
  EXPECT_EQ(one.ranks[0][b], backward(0, 1));
  const int w = last_activation_use(zb, 1, 0);
  ASSERT_GE(w, 0);
  EXPECT_EQ(zb.ranks[1][w], backward_weight(1, 0));
  const ActionRef ref = find_action(zb, ActionKind::kBackwardInput, 1, 0);
  EXPECT_EQ(ref.rank, 1);
  EXPECT_LT(ref.index, w);
  EXPECT_FALSE(find_action(zb, ActionKind::kBackward, 1, 0).found());
}

}  // namespace
}  // namespace conveyor::schedule

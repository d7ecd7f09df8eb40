// The validator accepts every generated schedule and rejects hand-made broken ones, naming
// rank, position, action and rule, with the offending action marked in the grid.
#include "engine/schedule/validator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "engine/schedule/generators.h"
#include "engine/schedule/text_format.h"

namespace conveyor::schedule {
namespace {

// 2 ranks, 2 micro-batches, 1F1B with transfers; the base of the broken variants.
constexpr const char* kGood =
    "# conveyor schedule: ranks=2 chunks=1 layout=looped microbatches=2\n"
    "r0: F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 RG0.1<1 B0.1\n"
    "r1: RA1.0<0 F1.0 B1.0 SG1.0>0 RA1.1<0 F1.1 B1.1 SG1.1>0\n";

ValidationError rejection(const std::string& text) {
  try {
    validate(parse_text(text));
  } catch (const ValidationError& e) {
    return e;
  }
  ADD_FAILURE() << "accepted:\n" << text;
  return ValidationError("accepted", -1, -1, "none");
}

std::string replace(std::string text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return text.replace(at, from.size(), to);
}

TEST(Validator, AcceptsEveryGeneratedSchedule) {
  EXPECT_NO_THROW(validate(parse_text(kGood)));
  for (int p = 1; p <= 6; ++p)
    for (int m = 1; m <= 12; ++m)
      for (auto kind :
           {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZBH1, ScheduleKind::kZBV}) {
        EXPECT_NO_THROW(validate(generate(kind, p, m)))
            << schedule_kind_name(kind) << " p=" << p << " m=" << m;
        if (m % p == 0)
          for (int v : {2, 3})
            EXPECT_NO_THROW(validate(generate_interleaved(p, m, v))) << "p=" << p << " m=" << m;
      }
}

TEST(Validator, MissingBackward) {
  const auto e = rejection(replace(kGood, " B1.1", ""));
  EXPECT_EQ(e.rule(), "missing");
  EXPECT_EQ(e.rank(), 1);
  EXPECT_EQ(e.index(), 5);  // marks F1.1, whose backward is missing
  const std::string msg = e.what();
  EXPECT_NE(msg.find("rank 1, position 5, F1.1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("backward of stage 1 micro-batch 1 is missing"), std::string::npos) << msg;
  EXPECT_NE(msg.find(">>F1.1<<"), std::string::npos) << msg;  // the grid marks it
}

TEST(Validator, TheGridOfALargeScheduleShowsOnlyTheRanksAroundTheMark) {
  auto s = generate(ScheduleKind::k1F1B, 64, 64);
  auto& list = s.ranks[40];
  const auto b = std::find_if(list.begin(), list.end(), [](const Action& a) {
    return a.kind == ActionKind::kBackward && a.microbatch == 3;
  });
  ASSERT_NE(b, list.end());
  list.erase(b);
  try {
    validate(s);
    FAIL() << "a missing backward was accepted";
  } catch (const ValidationError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.rank(), 40);
    size_t rows = 0;
    for (int r = 0; r < 64; ++r)
      if (msg.find("\nr" + std::to_string(r) + ":") != std::string::npos) ++rows;
    EXPECT_EQ(rows, 16u) << msg;
    EXPECT_NE(msg.find("\nr40:"), std::string::npos) << msg;
    EXPECT_NE(msg.find("... ranks 0..31 not shown"), std::string::npos) << msg;
    EXPECT_NE(msg.find("... ranks 48..63 not shown"), std::string::npos) << msg;
    EXPECT_LT(msg.size(), 4000u) << msg;
  }
}

TEST(Validator, WBeforeI) {
  std::string text = replace(kGood, "B1.0", "W1.0 I1.0");
  text = replace(text, "B1.1", "I1.1 W1.1");
  const auto e = rejection(text);
  EXPECT_EQ(e.rule(), "order");
  EXPECT_EQ(e.rank(), 1);
  EXPECT_NE(std::string(e.what()).find("W of stage 1 micro-batch 0 comes before its I"),
            std::string::npos)
      << e.what();
}

TEST(Validator, IWithoutW) {
  const auto e = rejection(replace(kGood, "B1.0", "I1.0"));
  EXPECT_EQ(e.rule(), "missing");
}

TEST(Validator, BackwardBeforeForward) {
  const auto e = rejection(replace(kGood, "F1.0 B1.0", "B1.0 F1.0"));
  EXPECT_EQ(e.rule(), "order");
}

TEST(Validator, SwappedSendsWouldDeadlockNccl) {
  // Rank 0 sends micro-batch 1 before 0; rank 1 receives 0 first: an in-order transport
  // would hand micro-batch 1's activation to F1.0.
  const auto e =
      rejection(replace(kGood, "F0.0 SA0.0>1 F0.1 SA0.1>1", "F0.0 F0.1 SA0.1>1 SA0.0>1"));
  EXPECT_EQ(e.rule(), "fifo");
  EXPECT_EQ(e.rank(), 1);
  EXPECT_EQ(e.index(), 0);
  EXPECT_NE(std::string(e.what()).find("link rank 0 -> rank 1"), std::string::npos) << e.what();
}

TEST(Validator, StageOnTwoRanks) {
  const auto e = rejection(replace(kGood, "RG0.1<1 B0.1", "RG0.1<1 B0.1 F1.1"));
  EXPECT_EQ(e.rule(), "placement");
  EXPECT_EQ(e.rank(), 0);
  EXPECT_NE(std::string(e.what()).find("stage 1 belongs to rank 1"), std::string::npos) << e.what();
}

TEST(Validator, DuplicateForward) {
  const auto e = rejection(replace(kGood, "F0.1 SA0.1>1", "F0.1 F0.1 SA0.1>1"));
  EXPECT_EQ(e.rule(), "duplicate");
}

TEST(Validator, MissingReceive) {
  const auto e = rejection(replace(kGood, "RA1.1<0 ", ""));
  EXPECT_EQ(e.rule(), "missing");
  EXPECT_NE(std::string(e.what()).find("RECV_ACT"), std::string::npos);
}

TEST(Validator, WrongPeer) {
  const Schedule s = generate_1f1b(3, 2);
  std::string text = replace(dump_text(s), "SA0.0>1", "SA0.0>2");
  EXPECT_EQ(rejection(text).rule(), "peer");
}

TEST(Validator, ReceiveAfterItsConsumer) {
  const auto e = rejection(replace(kGood, "RA1.0<0 F1.0", "F1.0 RA1.0<0"));
  EXPECT_EQ(e.rule(), "order");
}

// Each rule of a cell's transfers, halves of a split backward and stages on one rank, broken
// alone: named by its own rule and sentence (left out, each check's schedule was refused by a
// later one under another rule, or not at all).
TEST(Validator, EachCellRuleIsNamed) {
  // One rank holding stages 0 and 1 (two chunks): hand-overs between them are local.
  const std::string one_rank =
      "# conveyor schedule: ranks=1 chunks=2 layout=looped microbatches=1\n";
  struct Case {
    std::string text, rule, says;
  };
  const Case cases[] = {
      {replace(kGood, "SA0.1>1 ", ""), "missing",
       "no SEND_ACT sends this output of stage 0 micro-batch 1 to rank 1"},
      {replace(kGood, "F0.0 SA0.0>1", "SA0.0>1 F0.0"), "order",
       "SEND_ACT of stage 0 micro-batch 0 comes before the F that produces it"},
      {replace(kGood, "RG0.0<1 ", ""), "missing",
       "no RECV_GRAD receives the output gradient of stage 0 micro-batch 0 from rank 1"},
      {replace(kGood, "RG0.0<1 B0.0", "B0.0 RG0.0<1"), "order",
       "RECV_GRAD of stage 0 micro-batch 0 comes after the backward that needs it"},
      {replace(kGood, " SG1.0>0", ""), "missing",
       "no SEND_GRAD sends the input gradient of stage 1 micro-batch 0 to rank 0"},
      {replace(kGood, "B1.0 SG1.0>0", "SG1.0>0 B1.0"), "order",
       "SEND_GRAD of stage 1 micro-batch 0 comes before the backward that produces it"},
      {replace(kGood, "B1.0", "B1.0 I1.0 W1.0"), "duplicate",
       "stage 1 micro-batch 0 has both a full backward B and a split backward (I/W)"},
      {replace(kGood, "B1.0", "W1.0"), "missing",
       "W of stage 1 micro-batch 0 has no I (input-gradient backward)"},
      {one_rank + "r0: F0.0 SA0.0>0 F1.0 B1.0 B0.0\n", "peer",
       "stage 1 is on the same rank; hand the data over locally, without a transfer"},
      {one_rank + "r0: F1.0 F0.0 B1.0 B0.0\n", "order",
       "F of stage 1 micro-batch 0 comes before F of stage 0"},
      {one_rank + "r0: F0.0 F1.0 B0.0 B1.0\n", "order",
       "the backward of stage 0 micro-batch 0 comes before the backward of stage 1"},
  };
  EXPECT_NO_THROW(validate(parse_text(one_rank + "r0: F0.0 F1.0 B1.0 B0.0\n")));
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    const auto e = rejection(c.text);
    EXPECT_EQ(e.rule(), c.rule);
    EXPECT_NE(std::string(e.what()).find(c.says), std::string::npos) << e.what();
  }
}

// Indices a parsed file cannot hold but a Schedule built in code can: refused by name before
// any table is indexed with them.
TEST(Validator, OutOfRangeMicroBatchesAndReplicasAreNamed) {
  for (int mb : {2, -1}) {
    Schedule s = parse_text(kGood);
    s.ranks[0][2].microbatch = mb;  // F0.1
    try {
      validate(s);
      ADD_FAILURE() << "micro-batch " << mb << " of 2 was accepted";
    } catch (const ValidationError& e) {
      EXPECT_EQ(e.rule(), "placement");
      EXPECT_EQ(e.rank(), 0);
      EXPECT_EQ(e.index(), 2);
      EXPECT_NE(std::string(e.what()).find("micro-batch " + std::to_string(mb) +
                                           " does not exist (micro-batches 0..1)"),
                std::string::npos)
          << e.what();
    }
  }
  Schedule s = parse_text(kGood);
  s.replicas = 0;
  try {
    validate(s);
    ADD_FAILURE() << "replicas=0 was accepted";
  } catch (const ValidationError& e) {
    EXPECT_EQ(e.rule(), "shape");
    EXPECT_NE(std::string(e.what()).find("replicas must be at least 1 (got 0)"), std::string::npos)
        << e.what();
  }
}

TEST(Validator, DeadlockIsFoundBySimulation) {
  // FIFO holds on every link, but rank 1's receive stream first waits for the gradient from
  // rank 2, which needs the activation that rank 1 can only receive after it.
  const auto e = rejection(
      "r0: F0.0 SA0.0>1 RG0.0<1 B0.0\n"
      "r1: RG1.0<2 RA1.0<0 F1.0 SA1.0>2 B1.0 SG1.0>0\n"
      "r2: RA2.0<1 F2.0 B2.0 SG2.0>1\n");
  EXPECT_EQ(e.rank(), 1);
  EXPECT_EQ(e.rule(), "deadlock");
  EXPECT_NE(std::string(e.what()).find("deadlock"), std::string::npos);
}

TEST(Validator, DeadlockSaysASendWaitsForItsTensorWhenItsComputeHasNotRun) {
  // Rank 0 needs the gradient of micro-batch 0 before its F0.1; rank 1 needs micro-batch 1's
  // activation before its B1.0. Both receivers stand at the receives of the stuck sends, so
  // the sends wait for the computes that make their tensors, not for a receive.
  const auto e = rejection(
      "r0: F0.0 SA0.0>1 RG0.0<1 B0.0 F0.1 SA0.1>1 RG0.1<1 B0.1\n"
      "r1: RA1.0<0 F1.0 RA1.1<0 F1.1 B1.0 SG1.0>0 B1.1 SG1.1>0\n");
  EXPECT_EQ(e.rule(), "deadlock");
  const std::string what = e.what();
  EXPECT_NE(what.find("rank 0 position 5 SA0.1>1 waits for its tensor from F0.1 (position 4), "
                      "which has not run"),
            std::string::npos)
      << what;
  EXPECT_NE(what.find("rank 1 position 5 SG1.0>0 waits for its tensor from B1.0 (position 4), "
                      "which has not run"),
            std::string::npos)
      << what;
  EXPECT_EQ(what.find("post the matching receive"), std::string::npos) << what;
}

TEST(Validator, DeadlockSaysASendWaitsForTheReceiverWhenItsTensorIsMade) {
  // SA0.0's tensor is made, but rank 1's receive stream waits first for RG1.0 from rank 2.
  const auto e = rejection(
      "r0: F0.0 SA0.0>1 RG0.0<1 B0.0\n"
      "r1: RG1.0<2 RA1.0<0 F1.0 SA1.0>2 B1.0 SG1.0>0\n"
      "r2: RA2.0<1 F2.0 B2.0 SG2.0>1\n");
  const std::string what = e.what();
  EXPECT_NE(what.find("SA0.0>1 waits for rank 1 to post the matching receive"), std::string::npos)
      << what;
  EXPECT_NE(what.find("SA1.0>2 waits for its tensor from F1.0 (position 2), which has not run"),
            std::string::npos)
      << what;
}

TEST(Validator, WrongRankCount) {
  Schedule s = generate_1f1b(2, 2);
  s.ranks.pop_back();
  try {
    validate(s);
    FAIL() << "accepted";
  } catch (const ValidationError& e) {
    EXPECT_EQ(e.rule(), "shape");
  }
}

TEST(Validator, TablesGrowWithTheLinksNotWithPairsOfRanks) {
  // 30000 ranks: tables per pair of ranks would need 9e8 entries (tens of GB); the links that
  // exist are 2 per rank.
  const int R = 30000;
  Schedule s;
  s.placement.num_ranks = R;
  s.num_microbatches = 1;
  s.ranks.resize(R);
  for (int r = 0; r < R; ++r) {
    auto& list = s.ranks[r];
    if (r > 0) list.push_back({ActionKind::kRecvAct, r, 0, r - 1});
    list.push_back(forward(r, 0));
    if (r + 1 < R) list.push_back({ActionKind::kSendAct, r, 0, r + 1});
    if (r + 1 < R) list.push_back({ActionKind::kRecvGrad, r, 0, r + 1});
    list.push_back(backward(r, 0));
    if (r > 0) list.push_back({ActionKind::kSendGrad, r, 0, r - 1});
  }
  EXPECT_NO_THROW(validate(s));
}

}  // namespace
}  // namespace conveyor::schedule

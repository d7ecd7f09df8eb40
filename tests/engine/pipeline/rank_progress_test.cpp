// Positions of ranks held by other processes: they travel as bytes to rank 0's process
// after a failure, come back exactly, and bytes that are not a position of this run are
// refused rather than drawn; the grid marks every rank whose position is known.
#include "engine/pipeline/rank_progress.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "engine/schedule/generators.h"

namespace conveyor {
namespace {

using Phase = RankProgress::Phase;

constexpr int kStages = 3, kReplicas = 2, kWorld = kStages * kReplicas;

const schedule::Schedule& two_replica_1f1b() {
  static const schedule::Schedule s =
      schedule::generate(schedule::ScheduleKind::k1F1B, kStages, 4, 1, kReplicas);
  return s;
}

RankPosition random_position(std::mt19937& rng) {
  const schedule::Schedule& s = two_replica_1f1b();
  RankPosition p;
  p.index = static_cast<int>(rng() % kWorld);
  p.pipeline_rank = p.index % kStages;
  p.replica = p.index / kStages;
  p.replica_group = {p.pipeline_rank, p.pipeline_rank + kStages};
  const size_t size = s.ranks[p.pipeline_rank].size();
  p.progress.phase = static_cast<Phase>(rng() % (static_cast<int>(Phase::kDone) + 1));
  p.progress.action = rng() % size;
  p.progress.compute = rng() % (size + 1);
  p.progress.send = rng() % (size + 1);
  p.progress.recv = rng() % (size + 1);
  p.progress.reduce = rng() % (size + 1);
  return p;
}

void expect_same(const RankPosition& a, const RankPosition& b) {
  EXPECT_EQ(a.index, b.index);
  EXPECT_EQ(a.pipeline_rank, b.pipeline_rank);
  EXPECT_EQ(a.replica, b.replica);
  EXPECT_EQ(a.replica_group, b.replica_group);
  EXPECT_EQ(a.progress.phase, b.progress.phase);
  EXPECT_EQ(a.progress.action, b.progress.action);
  EXPECT_EQ(a.progress.compute, b.progress.compute);
  EXPECT_EQ(a.progress.send, b.progress.send);
  EXPECT_EQ(a.progress.recv, b.progress.recv);
  EXPECT_EQ(a.progress.reduce, b.progress.reduce);
}

TEST(RankPositionBytes, RoundTripExactly) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int i = 0; i < 200; ++i) {
    const RankPosition p = random_position(rng);
    const auto decoded = decode_position(encode_position(p), two_replica_1f1b(), kWorld);
    ASSERT_TRUE(decoded.has_value());
    expect_same(*decoded, p);
  }
}

// Overwrites field `field` (of the encoding's 64-bit fields) with `value`.
std::vector<std::byte> with_field(const RankPosition& p, size_t field, int64_t value) {
  std::vector<std::byte> bytes = encode_position(p);
  std::memcpy(bytes.data() + field * sizeof(int64_t), &value, sizeof value);
  return bytes;
}

TEST(RankPositionBytes, WhatIsNotAPositionOfThisRunIsRefused) {
  const schedule::Schedule& s = two_replica_1f1b();
  RankPosition p;
  p.index = 4;
  p.pipeline_rank = 1;
  p.replica = 1;
  p.replica_group = {1, 4};
  p.progress = {Phase::kWaitingForReceive, 3, 3, 2, 3, 0};
  ASSERT_TRUE(decode_position(encode_position(p), s, kWorld).has_value());
  const auto size = static_cast<int64_t>(s.ranks[1].size());
  std::vector<std::byte> bytes = encode_position(p);
  EXPECT_FALSE(decode_position({}, s, kWorld));
  EXPECT_FALSE(decode_position({bytes.begin(), bytes.begin() + 8 * 8}, s, kWorld));  // short
  EXPECT_FALSE(decode_position({bytes.begin(), bytes.end() - 3}, s, kWorld));        // not whole
  EXPECT_FALSE(decode_position(with_field(p, 0, kWorld), s, kWorld));                // rank
  EXPECT_FALSE(decode_position(with_field(p, 0, -1), s, kWorld));
  EXPECT_FALSE(decode_position(with_field(p, 1, kStages), s, kWorld));  // pipeline rank
  EXPECT_FALSE(decode_position(with_field(p, 2, kReplicas), s, kWorld));
  EXPECT_FALSE(decode_position(with_field(p, 3, 99), s, kWorld));        // phase
  EXPECT_FALSE(decode_position(with_field(p, 4, size), s, kWorld));      // waits past its list
  EXPECT_FALSE(decode_position(with_field(p, 5, size + 1), s, kWorld));  // a stream head
  EXPECT_FALSE(decode_position(with_field(p, 10, kWorld), s, kWorld));   // its group
  // Past its last action a rank names the end of its list.
  p.progress = {Phase::kEndOfStep,         static_cast<size_t>(size), static_cast<size_t>(size),
                static_cast<size_t>(size), static_cast<size_t>(size), 0};
  EXPECT_TRUE(decode_position(encode_position(p), s, kWorld).has_value());
}

TEST(RankPositions, AReportedRankIsMarkedAndDescribedLikeALocalOne) {
  const schedule::Schedule s = schedule::generate(schedule::ScheduleKind::k1F1B, 3, 4);
  RankPosition local{0, 0, 0, {0}, {Phase::kWaitingForReceive, 6, 7, 9, 6, 0}};
  RankPosition reported{1, 1, 0, {1}, {Phase::kWaitingForReceive, 6, 7, 8, 6, 0}};
  const auto decoded = decode_position(encode_position(reported), s, 3);
  ASSERT_TRUE(decoded.has_value());
  const std::string text = format_positions(s, {local, *decoded}, 0, 3);
  EXPECT_NE(text.find(">>" + schedule::to_string(s.ranks[1][6]) + "<<"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 1: at action 6"), std::string::npos) << text;
  EXPECT_NE(text.find("waiting for a message from rank 2"), std::string::npos) << text;
  EXPECT_NE(text.find("rank(s) 2: held by other processes"), std::string::npos) << text;
}

TEST(RankPositions, ARunOfManyRanksListsTheSixteenNearestTheFocus) {
  constexpr int kRanks = 40, kFocus = 35;
  const schedule::Schedule s = schedule::generate(schedule::ScheduleKind::k1F1B, kRanks, kRanks);
  std::vector<RankPosition> known;
  for (int r = 0; r < kRanks; ++r)
    known.push_back({r, r, 0, {r}, {Phase::kWaitingForReceive, 0, 0, 0, 0, 0}});
  const std::string text = format_positions(s, known, kFocus, kRanks);
  int lines = 0;
  for (int r = 0; r < kRanks; ++r) {
    const bool listed = text.find("\nrank " + std::to_string(r) + ": ") != std::string::npos;
    EXPECT_EQ(listed, r >= 24) << "rank " << r << "\n" << text;  // 24..39: within 11 of 35
    lines += listed;
  }
  EXPECT_EQ(lines, 16);
  EXPECT_NE(text.find("rank(s) 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, ... (24 in "
                      "all): known here, not listed (the 16 nearest rank 35 are)"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("held by other processes"), std::string::npos) << text;
}

}  // namespace
}  // namespace conveyor

// Which NCCL unique id each communicator of a multi-process clique uses, and which ends each
// rank makes: every process must derive the same answer from (rank, ranks) alone, or two
// processes would join different communicators and wait for each other forever.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <stdexcept>
#include <utility>

#include "comm/nccl.h"

namespace conveyor::comm {
namespace {

TEST(NcclSlots, EveryOrderedLinkAndTheWorldHaveASlotOfTheirOwn) {
  for (int p = 1; p <= 9; ++p) {
    const int count = nccl_slot_count(p);
    EXPECT_EQ(count, p * (p - 1) + 1);
    std::set<int> seen;
    for (int src = 0; src < p; ++src)
      for (int dst = 0; dst < p; ++dst) {
        if (src == dst) continue;
        const int slot = nccl_link_slot(src, dst, p);
        EXPECT_GE(slot, 0);
        EXPECT_LT(slot, count);
        EXPECT_TRUE(seen.insert(slot).second) << "link " << src << " -> " << dst << " at p=" << p;
      }
    const int world = nccl_world_slot(p);
    EXPECT_TRUE(seen.insert(world).second) << "world slot shared at p=" << p;
    EXPECT_EQ(static_cast<int>(seen.size()), count);
    // The two directions of a pair are different communicators (the per-link property).
    if (p >= 2) EXPECT_NE(nccl_link_slot(0, 1, p), nccl_link_slot(1, 0, p));
  }
}

TEST(NcclSlots, EachLinkHasOneSenderAndOneReceiverAmongTheRanksMemberships) {
  for (int p = 1; p <= 7; ++p) {
    // slot -> (comm size, the comm ranks that join it)
    std::map<int, std::pair<int, std::multiset<int>>> joined;
    for (int rank = 0; rank < p; ++rank) {
      const std::vector<NcclMembership> mine = nccl_memberships(rank, p);
      ASSERT_EQ(static_cast<int>(mine.size()), 1 + 2 * (p - 1)) << "rank " << rank;
      EXPECT_EQ(mine.front().slot, nccl_world_slot(p));
      EXPECT_EQ(mine.front().comm_size, p);
      EXPECT_EQ(mine.front().comm_rank, rank);
      for (size_t i = 1; i < mine.size(); ++i) {
        const NcclMembership& m = mine[i];
        EXPECT_EQ(m.comm_size, 2);
        EXPECT_EQ(m.slot, nccl_link_slot(m.src, m.dst, p));
        EXPECT_EQ(m.comm_rank, m.src == rank ? 0 : 1);
        EXPECT_TRUE(m.src == rank || m.dst == rank);
        // Ascending (src, dst): the order every process walks them in.
        if (i > 1) {
          const NcclMembership& prev = mine[i - 1];
          EXPECT_LT(std::make_pair(prev.src, prev.dst), std::make_pair(m.src, m.dst));
        }
      }
      for (const NcclMembership& m : mine) {
        auto& [size, ranks] = joined[m.slot];
        if (ranks.empty()) size = m.comm_size;
        EXPECT_EQ(size, m.comm_size) << "slot " << m.slot << " joined with two sizes";
        ranks.insert(m.comm_rank);
      }
    }
    EXPECT_EQ(static_cast<int>(joined.size()), nccl_slot_count(p));
    for (const auto& [slot, entry] : joined) {
      const auto& [size, ranks] = entry;
      // Every communicator is joined once by each of its ranks 0..size-1.
      std::multiset<int> expected;
      for (int r = 0; r < size; ++r) expected.insert(r);
      EXPECT_EQ(ranks, expected) << "slot " << slot << " at p=" << p;
    }
  }
}

TEST(NcclSlots, OutOfRangeRanksAreRefusedWithTheValue) {
  EXPECT_THROW(nccl_slot_count(0), std::invalid_argument);
  EXPECT_THROW(nccl_link_slot(1, 1, 3), std::invalid_argument);
  EXPECT_THROW(nccl_memberships(3, 3), std::invalid_argument);
  try {
    nccl_link_slot(0, 4, 3);
    FAIL() << "link to rank 4 of 3 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("link destination 4 is out of range for 3"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace conveyor::comm

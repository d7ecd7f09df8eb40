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

// The executor's replica groups: {r + d * p : d < replicas} for each pipeline rank r.
NcclGroups replica_groups(int p, int replicas) {
  NcclGroups out(p);
  for (int r = 0; r < p; ++r)
    for (int d = 0; d < replicas; ++d) out[r].push_back(r + d * p);
  return out;
}

TEST(NcclSlots, GroupsComeAfterTheWorldAndLeaveEveryOtherSlotWhereItWas) {
  for (int p = 1; p <= 4; ++p)
    for (int replicas = 2; replicas <= 3; ++replicas) {
      const int ranks = p * replicas;
      const NcclGroups groups = replica_groups(p, replicas);
      const int count = nccl_slot_count(ranks, p);
      EXPECT_EQ(count, nccl_slot_count(ranks) + p);
      EXPECT_EQ(nccl_world_slot(ranks), nccl_slot_count(ranks) - 1);
      std::set<int> seen;
      for (int g = 0; g < p; ++g) {
        const int slot = nccl_group_slot(g, ranks, p);
        EXPECT_GT(slot, nccl_world_slot(ranks));
        EXPECT_LT(slot, count);
        EXPECT_TRUE(seen.insert(slot).second) << "group " << g << " at p=" << p;
      }
      // The links and the world keep the slots they have without groups.
      for (int rank = 0; rank < ranks; ++rank) {
        const auto plain = nccl_memberships(rank, ranks);
        const auto mine = nccl_memberships(rank, ranks, groups);
        ASSERT_EQ(mine.size(), plain.size() + 1) << "rank " << rank << " is in one group";
        for (size_t i = 0; i < plain.size(); ++i) {
          EXPECT_EQ(mine[i].slot, plain[i].slot);
          EXPECT_EQ(mine[i].group, -1);
        }
        const NcclMembership& m = mine.back();
        EXPECT_EQ(m.group, rank % p);
        EXPECT_EQ(m.slot, nccl_group_slot(rank % p, ranks, p));
        EXPECT_EQ(m.comm_size, replicas);
        EXPECT_EQ(m.comm_rank, rank / p);  // its position in the group: its replica
        EXPECT_EQ(m.src, -1);
        EXPECT_EQ(m.dst, -1);
      }
    }
}

TEST(NcclSlots, EveryGroupIsJoinedOnceAtEachPositionEvenWhenGroupsOverlap) {
  const int ranks = 5;
  const NcclGroups groups = {{0, 2, 4}, {1, 3}, {0, 1, 2, 3, 4}, {2, 3}};
  std::map<int, std::pair<int, std::multiset<int>>> joined;  // slot -> (size, comm ranks)
  for (int rank = 0; rank < ranks; ++rank) {
    int previous = -1;
    for (const NcclMembership& m : nccl_memberships(rank, ranks, groups)) {
      if (m.group < 0) continue;
      EXPECT_GT(m.group, previous) << "groups out of order for rank " << rank;
      previous = m.group;
      EXPECT_EQ(groups[m.group][m.comm_rank], rank);
      auto& [size, comm_ranks] = joined[m.slot];
      size = m.comm_size;
      comm_ranks.insert(m.comm_rank);
    }
  }
  ASSERT_EQ(joined.size(), groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& [size, comm_ranks] = joined.at(nccl_group_slot(static_cast<int>(g), ranks, 4));
    EXPECT_EQ(size, static_cast<int>(groups[g].size()));
    std::multiset<int> expected;
    for (int r = 0; r < size; ++r) expected.insert(r);
    EXPECT_EQ(comm_ranks, expected) << "group " << g;
  }
}

TEST(NcclSlots, BadGroupsAreRefusedByName) {
  auto refused = [](const NcclGroups& groups, const std::string& expected) {
    try {
      nccl_memberships(0, 4, groups);
      ADD_FAILURE() << "accepted " << expected;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  refused({{0}}, "at least two ascending ranks in 0..3, got {0}");
  refused({{2, 1}}, "got {2,1}");
  refused({{0, 4}}, "got {0,4}");
  refused({{0, 0}}, "got {0,0}");
  refused({{0, 2}, {1, 3}, {0, 2}}, "the NCCL group {0,2} is listed twice");
  EXPECT_THROW(nccl_slot_count(3, -1), std::invalid_argument);
  EXPECT_THROW(nccl_group_slot(2, 3, 2), std::invalid_argument);
  EXPECT_THROW(nccl_group_slot(-1, 3, 2), std::invalid_argument);
}

TEST(NcclSlots, AGroupIsFoundByItsRanksAndAnUnknownOneIsNamed) {
  const NcclGroups groups = {{0, 2}, {1, 3}};
  EXPECT_EQ(find_nccl_group(groups, {0, 2}), 0);
  EXPECT_EQ(find_nccl_group(groups, {1, 3}), 1);
  try {
    find_nccl_group(groups, {0, 1});
    ADD_FAILURE() << "found a group that is not there";
  } catch (const TransportError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("no communicator for the group {0,1}"), std::string::npos) << what;
    EXPECT_NE(what.find("{0,2}, {1,3}"), std::string::npos) << what;
  }
  EXPECT_THROW(find_nccl_group({}, {0, 1}), TransportError);
}

}  // namespace
}  // namespace conveyor::comm

// How messages list ranks (comm::rank_list): every transport's timeouts and the executor's
// stall report name ranks the same way, and a list of many stays one short line.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "comm/transport.h"

namespace conveyor::comm {
namespace {

TEST(RankList, NamesEveryRankOfAShortList) {
  EXPECT_EQ(rank_list({}), "");
  EXPECT_EQ(rank_list({7}), "7");
  EXPECT_EQ(rank_list({0, 2, 5}), "0, 2, 5");
}

TEST(RankList, ShowsTheFirstSixteenAndCountsTheRest) {
  std::vector<int> sixteen(16);
  std::iota(sixteen.begin(), sixteen.end(), 0);
  EXPECT_EQ(rank_list(sixteen), "0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15");
  std::vector<int> many(1000);
  std::iota(many.begin(), many.end(), 3);
  EXPECT_EQ(rank_list(many),
            "3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, ... (1000 in all)");
}

}  // namespace
}  // namespace conveyor::comm

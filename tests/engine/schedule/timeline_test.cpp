// The rank x time timeline that `conveyor schedule` prints: at most max_rows ranks drawn, the
// first ones exactly as in the picture of every rank, and a line naming those left out.
#include <gtest/gtest.h>

#include <string>

#include "engine/schedule/ascii.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/simulator.h"

namespace conveyor::schedule {
namespace {

size_t count_lines(const std::string& text) {
  size_t n = 0;
  for (char c : text) n += c == '\n';
  return n;
}

TEST(Timeline, DrawsTheFirstMaxRowsRanksAndSaysHowManyAreLeftOut) {
  const Schedule s = generate(ScheduleKind::k1F1B, 9, 12);
  const SimResult sim = simulate(s, CostModel::uniform(1, 1, 1, 0.25));
  const std::string all = format_timeline(s, sim, 160, 0);
  const std::string first = format_timeline(s, sim, 160, 4);
  EXPECT_EQ(count_lines(all), 9u) << all;
  EXPECT_EQ(count_lines(first), 5u) << first;
  // The rows drawn are those of the whole picture: the same scale and columns.
  const size_t rows_end = all.find("r4:");
  ASSERT_NE(rows_end, std::string::npos) << all;
  EXPECT_EQ(first.substr(0, rows_end), all.substr(0, rows_end)) << first;
  EXPECT_EQ(first.substr(rows_end), "(ranks 4..8 not drawn: the first 4 of 9)\n") << first;
  // No line when every rank fits.
  EXPECT_EQ(format_timeline(s, sim, 160, 9), all);
  EXPECT_EQ(format_timeline(s, sim, 160, 64), all);
}

TEST(Timeline, CapsTheAllReduceRowsWithTheirRanks) {
  const Schedule s = generate(ScheduleKind::k1F1B, 4, 4, 1, /*replicas=*/2);
  CostModel costs = CostModel::uniform(1, 1, 1);
  costs.gradient_bytes = {2};
  costs.reduce_bandwidth = 1;
  const std::string first = format_timeline(s, simulate(s, costs), 160, 2);
  EXPECT_NE(first.find("r1:"), std::string::npos) << first;
  EXPECT_EQ(first.find("r2:"), std::string::npos) << first;
  EXPECT_EQ(count_lines(first), 5u) << first;  // r0, ar, r1, ar, and the note
}

}  // namespace
}  // namespace conveyor::schedule

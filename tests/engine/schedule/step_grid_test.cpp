// The rank x list-position grid with several positions marked: every mark drawn, the columns
// around them, and the one-mark grid that validation errors show unchanged by it.
#include <gtest/gtest.h>

#include <string>

#include "engine/schedule/ascii.h"
#include "engine/schedule/generators.h"

namespace conveyor::schedule {
namespace {

TEST(StepGrid, MarksEveryGivenPositionWithinTheColumnsShown) {
  // 1F1B, 4 ranks, 16 micro-batches: lists of about 64 actions, far more than 12 columns.
  const Schedule s = generate(ScheduleKind::k1F1B, 4, 16);
  const std::vector<GridMark> marks = {{2, 30}, {0, 25}, {3, 34}};
  const std::string grid = format_step_grid(s, marks, 12, 16);
  for (const GridMark& m : marks)
    EXPECT_NE(grid.find(">>" + to_string(s.ranks[m.rank][m.index]) + "<<"), std::string::npos)
        << grid;
  // Columns 23..34: the 12 around the middle of marks 25..34.
  EXPECT_EQ(grid.rfind("step  ... 23 ", 0), 0u) << grid;
  // Rank 1 has no mark: the first one after its row head is rank 2's.
  EXPECT_EQ(grid.find(">>", grid.find("r1:")), grid.find(">>", grid.find("r2:"))) << grid;
}

TEST(StepGrid, MarksTooFarApartCentreOnTheFirst) {
  const Schedule s = generate(ScheduleKind::k1F1B, 4, 16);
  const std::string grid = format_step_grid(s, {{1, 40}, {0, 2}}, 12, 16);
  EXPECT_NE(grid.find(">>" + to_string(s.ranks[1][40]) + "<<"), std::string::npos) << grid;
  EXPECT_EQ(grid.find(">>" + to_string(s.ranks[0][2]) + "<<"), std::string::npos) << grid;
  EXPECT_EQ(grid.rfind("step  ... 34 ", 0), 0u) << grid;
}

TEST(StepGrid, OneMarkDrawsAsTheSingleMarkGrid) {
  const Schedule s = generate(ScheduleKind::k1F1B, 3, 8);
  EXPECT_EQ(format_step_grid(s, {{1, 13}}, 10, 16), format_step_grid(s, 1, 13, 10, 16));
  EXPECT_EQ(format_step_grid(s, std::vector<GridMark>{}, 10, 16),
            format_step_grid(s, -1, -1, 10, 16));
}

}  // namespace
}  // namespace conveyor::schedule

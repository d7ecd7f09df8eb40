// The rank x time timeline that `conveyor schedule` prints: at most max_rows ranks drawn, the
// first ones exactly as in the picture of every rank, and a line naming those left out; a
// picture scaled to fit its columns says so, and every cell of it tells the truth about the
// simulated times.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/schedule/ascii.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/simulator.h"

namespace conveyor::schedule {
namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Checks every cell of `picture` (compute rows only: no replicas) against the simulation,
// cell by cell: the cell size is the one the scale line names, else the shortest compute
// action; a cell where actions start shows the earliest of them, with '+' when there are
// more; else '~' where an action runs on, '.' where none runs. Forward inputs come first: a
// cell showing F of stage s > 0 lies where the F of stage s-1 it reads has ended.
void expect_picture_is_the_simulation(const Schedule& s, const SimResult& sim,
                                      const std::string& picture) {
  ASSERT_EQ(s.replicas, 1);
  double unit = 0;
  for (size_t r = 0; r < s.ranks.size(); ++r)
    for (size_t i = 0; i < s.ranks[r].size(); ++i) {
      const double d = sim.timing[r][i].end - sim.timing[r][i].start;
      if (is_compute(s.ranks[r][i].kind) && d > 0 && (unit == 0 || d < unit)) unit = d;
    }
  double cell = unit;
  const std::vector<std::string> lines = lines_of(picture);
  ASSERT_FALSE(lines.empty());
  const std::string scaled = "(one cell = ";
  const std::string uncounted = "being too short to count cells in, to fit ";
  if (const size_t at = lines[0].find(uncounted); at != std::string::npos) {
    // Cells of the makespan over the columns, when the shortest action is too short to count
    // them in.
    cell = sim.makespan / std::stod(lines[0].substr(at + uncounted.size()));
  } else if (lines[0].rfind(scaled, 0) == 0) {
    // "(one cell = 2.5 time units, 5 x the shortest compute action, ...": the multiple, as
    // the time is rounded for reading.
    const size_t comma = lines[0].find(", ");
    ASSERT_NE(comma, std::string::npos) << lines[0];
    const double scale = std::stod(lines[0].substr(comma + 2));
    EXPECT_EQ(scale, std::round(scale)) << lines[0];
    EXPECT_NEAR(std::stod(lines[0].substr(scaled.size())), unit * scale, 1e-5 * unit * scale);
    cell = unit * scale;
  }
  const int columns = static_cast<int>(std::ceil(sim.makespan / cell - 1e-9));
  // Where each forward ends, for the inputs of the next stage's.
  std::vector<std::vector<double>> forward_end(s.num_stages(),
                                               std::vector<double>(s.num_microbatches, -1));
  for (size_t r = 0; r < s.ranks.size(); ++r)
    for (size_t i = 0; i < s.ranks[r].size(); ++i)
      if (s.ranks[r][i].kind == ActionKind::kForward)
        forward_end[s.ranks[r][i].stage][s.ranks[r][i].microbatch] = sim.timing[r][i].end;
  size_t rows = 0;
  for (const std::string& line : lines) {
    if (line.rfind("r", 0) != 0) continue;
    const size_t r = std::stoul(line.substr(1));
    ++rows;
    std::istringstream in(line.substr(line.find(':') + 1));
    std::vector<std::string> cells;
    for (std::string c; in >> c;) cells.push_back(c);
    ASSERT_EQ(cells.size(), static_cast<size_t>(columns)) << "r" << r << "\n" << picture;
    for (int c = 0; c < columns; ++c) {
      const double lo = c * cell, hi = (c + 1) * cell;
      std::string first;
      double first_start = 0;
      int starts = 0;
      bool runs = false;
      for (size_t i = 0; i < s.ranks[r].size(); ++i) {
        const Action& a = s.ranks[r][i];
        if (!is_compute(a.kind)) continue;
        const ActionTiming& t = sim.timing[r][i];
        const int at =
            std::clamp(static_cast<int>(std::floor(t.start / cell + 1e-9)), 0, columns - 1);
        if (at == c) {
          if (starts++ == 0 || t.start < first_start) {
            first = compute_label(s, a);
            first_start = t.start;
          }
          if (a.kind == ActionKind::kForward && a.stage > 0)
            EXPECT_LT(forward_end[a.stage - 1][a.microbatch], hi + 1e-9)
                << "r" << r << " shows " << first << " in a cell before its input exists";
        }
        runs = runs || (t.start < hi - 1e-9 && t.end > lo + 1e-9);
      }
      const std::string want = starts > 0 ? first + (starts > 1 ? "+" : "") : runs ? "~" : ".";
      EXPECT_EQ(cells[c], want) << "r" << r << " cell " << c << " [" << lo << ", " << hi << ")\n"
                                << picture;
      if (cells[c] != want) return;  // one cell is enough to read the picture by
    }
  }
  EXPECT_GT(rows, 0u) << picture;
}

TEST(Timeline, AScaledPictureSaysSoAndShowsEveryCellAsSimulated) {
  // 1F1B pictures past 160 columns at costs 1,1,1: r0 starts with F0, no rank computes
  // before its input exists, and a line states the scale.
  for (const auto& [p, m] : {std::pair{4, 64}, std::pair{2, 80}, std::pair{70, 2}}) {
    const Schedule s = generate(ScheduleKind::k1F1B, p, m);
    const SimResult sim = simulate(s, CostModel::uniform(1, 1, 1));
    const std::string picture = format_timeline(s, sim, 160, 0);
    SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
    const std::vector<std::string> lines = lines_of(picture);
    ASSERT_GE(lines.size(), 2u) << picture;
    EXPECT_EQ(lines[0].rfind("(one cell = 2 time units, 2 x the shortest compute action", 0), 0u)
        << picture;
    EXPECT_EQ(lines[1].rfind("r0:   F0", 0), 0u) << picture;
    expect_picture_is_the_simulation(s, sim, picture);
  }
  // Random costs and transfer times, whose actions start anywhere in a cell, several chunks.
  std::mt19937 rng(2024);
  std::uniform_real_distribution<double> cost(0.3, 2.0);
  for (const ScheduleKind kind :
       {ScheduleKind::k1F1B, ScheduleKind::kZBH1, ScheduleKind::kZBV, ScheduleKind::kInterleaved})
    for (const int max_columns : {17, 60, 160, 100000}) {
      const Schedule s = generate(kind, 4, 12, kind == ScheduleKind::kInterleaved ? 2 : 1);
      const SimResult sim =
          simulate(s, CostModel::uniform(cost(rng), cost(rng), cost(rng), cost(rng) / 3));
      const std::string picture = format_timeline(s, sim, max_columns, 0);
      SCOPED_TRACE(s.name + " in " + std::to_string(max_columns) + " columns");
      // Labels of at most 6 characters and '+', a space after each.
      EXPECT_LE(lines_of(picture)[1].size(), 6 + max_columns * 8u) << picture;
      expect_picture_is_the_simulation(s, sim, picture);
    }
}

TEST(Timeline, AnUnscaledPictureHasNoScaleLine) {
  const Schedule s = generate(ScheduleKind::k1F1B, 4, 8);
  const SimResult sim = simulate(s, CostModel::uniform(1, 1, 1));
  EXPECT_EQ(timeline_columns_unscaled(s, sim), 33);
  EXPECT_EQ(
      format_timeline(s, sim, 33, 0),
      "r0:   F0 F1 F2 F3 .  .  .  .  .  .  B0 ~  F4 B1 ~  F5 B2 ~  F6 B3 ~  F7 B4 ~  .  B5 ~  "
      ".  B6 ~  .  B7 ~\n"
      "r1:   .  F0 F1 F2 .  .  .  .  B0 ~  F3 B1 ~  F4 B2 ~  F5 B3 ~  F6 B4 ~  F7 B5 ~  .  B6 "
      "~  .  B7 ~  .  .\n"
      "r2:   .  .  F0 F1 .  .  B0 ~  F2 B1 ~  F3 B2 ~  F4 B3 ~  F5 B4 ~  F6 B5 ~  F7 B6 ~  .  "
      "B7 ~  .  .  .  .\n"
      "r3:   .  .  .  F0 B0 ~  F1 B1 ~  F2 B2 ~  F3 B3 ~  F4 B4 ~  F5 B5 ~  F6 B6 ~  F7 B7 ~  "
      ".  .  .  .  .  .\n");
  // One column fewer: two units a cell, said in the first line.
  const std::string scaled = format_timeline(s, sim, 32, 0);
  EXPECT_EQ(lines_of(scaled)[0],
            "(one cell = 2 time units, 2 x the shortest compute action, to fit 32 columns "
            "(unscaled: 33); a cell shows the first action that starts in it, with + when others "
            "start there too)");
  expect_picture_is_the_simulation(s, sim, scaled);
}

// A compute action so short beside the makespan that the count of its lengths passes a
// double (a subnormal F beside ordinary costs, or a transfer of 1e300 beside compute of
// 1e-300): the picture took 0 columns and wrote past them.
TEST(Timeline, AnActionTooShortToCountCellsInGivesEqualCellsOverTheMakespan) {
  for (const CostModel& costs :
       {CostModel::uniform(1e-310, 1, 1), CostModel::uniform(1e-300, 1e-300, 1e-300, 1e300),
        CostModel::uniform(1e-320, 1e-320, 1e-320, 1)}) {
    const Schedule s = generate(ScheduleKind::k1F1B, 2, 2);
    const SimResult sim = simulate(s, costs);
    const std::string picture = format_timeline(s, sim, 40, 0);
    const std::vector<std::string> lines = lines_of(picture);
    ASSERT_EQ(lines.size(), 3u) << picture;
    EXPECT_NE(lines[0].find("being too short to count cells in, to fit 40 columns (unscaled: inf)"),
              std::string::npos)
        << picture;
    EXPECT_EQ(lines[1].rfind("r0:   F0", 0), 0u) << picture;
    expect_picture_is_the_simulation(s, sim, picture);
  }
}

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

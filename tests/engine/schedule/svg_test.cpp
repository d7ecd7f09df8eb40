// What the SVG timeline draws, read back from its boxes' titles: "F2.5 [3, 4)".
#include "engine/schedule/svg.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "engine/schedule/generators.h"
#include "engine/schedule/simulator.h"

namespace conveyor::schedule {
namespace {

struct Box {
  std::string action;
  double start = 0, end = 0;
  double y = 0, height = 0;  // of its rectangle, in pixels
};

std::vector<Box> boxes_of(const std::string& svg) {
  static const std::regex box(
      R"re(<title>(\S+) \[([^,]+), ([^)]+)\)</title><rect x="[^"]+" y="([^"]+)" )re"
      R"re(width="[^"]+" height="([^"]+)")re");
  std::vector<Box> out;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), box); it != std::sregex_iterator();
       ++it)
    out.push_back({(*it)[1], std::stod((*it)[2]), std::stod((*it)[3]), std::stod((*it)[4]),
                   std::stod((*it)[5])});
  return out;
}

// Over the box cap, the picture shows the first part of the step on every rank, not the
// first ranks' whole step next to bare rows that read as idle.
TEST(Svg, BoxCapCutsEveryRankAtTheSameTime) {
  const Schedule s = generate(ScheduleKind::k1F1B, 4, 8);
  const SimResult sim = simulate(s, CostModel::uniform(1, 1, 1));
  SvgOptions options;
  options.max_boxes = 20;
  const std::string svg = render_svg(s, sim, options);
  const std::vector<Box> drawn = boxes_of(svg);
  ASSERT_LE(drawn.size(), options.max_boxes);
  double horizon = 0;            // the latest start drawn
  std::map<char, int> per_rank;  // by the stage's digit: stage r is on rank r
  for (const Box& b : drawn) {
    horizon = std::max(horizon, b.start);
    ++per_rank[b.action[1]];
  }
  EXPECT_EQ(per_rank.size(), 4u) << svg;
  // Every compute action that starts by then is drawn.
  size_t started = 0;
  for (size_t r = 0; r < s.ranks.size(); ++r)
    for (size_t i = 0; i < s.ranks[r].size(); ++i)
      started += is_compute(s.ranks[r][i].kind) && sim.timing[r][i].start <= horizon;
  EXPECT_EQ(drawn.size(), started);
  EXPECT_NE(svg.find("drawn: 4 of 4 ranks, the first "), std::string::npos) << svg;
  EXPECT_NE(svg.find(" of 33 time units, " + std::to_string(drawn.size()) + " of 64 actions"),
            std::string::npos)
      << svg;
}

// A rank sends, receives and all-reduces at the same time (three streams): no strip may cover
// another, or the picture hides a transfer.
TEST(Svg, StripsThatRunTogetherDoNotCoverEachOther) {
  for (const ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kZBV}) {
    const Schedule s = generate(kind, 4, 8, kind == ScheduleKind::kZBV ? 2 : 1, 2);
    CostModel costs = CostModel::uniform(1, 1, 1, 0.7);
    costs.gradient_bytes = {3.0};
    costs.reduce_bandwidth = 1.0;
    const std::vector<Box> drawn = boxes_of(render_svg(s, simulate(s, costs)));
    std::vector<Box> strips;
    for (const Box& b : drawn)
      if (b.action[0] == 'S' || b.action[0] == 'R' || b.action[0] == 'A') strips.push_back(b);
    ASSERT_GE(strips.size(), 100u);
    size_t concurrent = 0;
    for (size_t i = 0; i < strips.size(); ++i)
      for (size_t j = i + 1; j < strips.size(); ++j) {
        const Box &a = strips[i], &b = strips[j];
        if (a.start >= b.end || b.start >= a.end) continue;
        // Same rank: their rectangles' rows meet.
        if (std::abs(a.y - b.y) > 3 * a.height) continue;
        ++concurrent;
        EXPECT_GE(std::abs(a.y - b.y), a.height) << a.action << " and " << b.action;
      }
    EXPECT_GT(concurrent, 0u);
  }
}

}  // namespace
}  // namespace conveyor::schedule

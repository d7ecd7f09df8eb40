// What the SVG timeline draws, read back from its boxes' titles: "F2.5 [3, 4)".
#include "engine/schedule/svg.h"

#include <gtest/gtest.h>

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
};

std::vector<Box> boxes_of(const std::string& svg) {
  static const std::regex title(R"(<title>(\S+) \[([^,]+), ([^)]+)\)</title>)");
  std::vector<Box> out;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), title); it != std::sregex_iterator();
       ++it)
    out.push_back({(*it)[1], std::stod((*it)[2]), std::stod((*it)[3])});
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

}  // namespace
}  // namespace conveyor::schedule

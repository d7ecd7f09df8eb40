// Simulator with communication costs and per-stage costs; SVG and Chrome-trace output.
#include "engine/schedule/simulator.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "engine/schedule/chrome_trace.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/schedule.h"
#include "engine/schedule/svg.h"

namespace conveyor::schedule {
namespace {

TEST(Simulator, TransfersAddLatencyOnTheCriticalPath) {
  // One micro-batch through p stages: p forwards, p-1 activation transfers, p backwards,
  // p-1 gradient transfers, all in sequence.
  for (int p = 1; p <= 6; ++p) {
    const double f = 1.5, i = 2, w = 0.5, c = 0.25;
    const SimResult sim = simulate(generate_1f1b(p, 1), CostModel::uniform(f, i, w, c));
    EXPECT_DOUBLE_EQ(sim.makespan, p * (f + i + w) + 2 * (p - 1) * c) << "p=" << p;
  }
}

TEST(Simulator, BandwidthAndMessageBytes) {
  CostModel costs = CostModel::uniform(1, 1, 1);
  costs.latency = 0.5;
  costs.bandwidth = 100;
  costs.message_bytes = {200};  // 2 time units per message
  const SimResult sim = simulate(generate_gpipe(2, 1), costs);
  EXPECT_DOUBLE_EQ(sim.makespan, 2 * 3 + 2 * 2.5);
}

// A transfer carries the tensor of the boundary between stage b and b + 1, message_bytes[b],
// at both ends and both ways: the activation of stage 1 (sent by stage 1, received by stage
// 2) and its gradient (sent by stage 2, received by stage 1) all cost boundary 1's bytes. An
// all-reduce sums its own stage's gradient bytes. Sizes differ per boundary and stage, so a
// transfer priced by its neighbour's tensor costs something else.
TEST(Simulator, EachTransferPaysTheBytesOfItsBoundary) {
  CostModel costs;
  costs.latency = 0.5;
  costs.bandwidth = 10;
  costs.message_bytes = {10, 30, 70};
  costs.gradient_bytes = {40, 80};
  costs.reduce_latency = 1;
  costs.reduce_bandwidth = 20;
  for (const char* token : {"SA1.0>2", "RA2.0<1", "SG2.0>1", "RG1.0<2"})
    EXPECT_DOUBLE_EQ(costs.cost(parse_action(token)), 0.5 + 30.0 / 10) << token;
  EXPECT_DOUBLE_EQ(costs.cost(parse_action("RA1.0<0")), 0.5 + 10.0 / 10);
  EXPECT_DOUBLE_EQ(costs.cost(parse_action("SG3.0>2")), 0.5 + 70.0 / 10);
  EXPECT_DOUBLE_EQ(costs.cost(allreduce_grad(1)), 1 + 80.0 / 20);
  EXPECT_DOUBLE_EQ(costs.cost(allreduce_grad(0)), 1 + 40.0 / 20);
}

// Refused with the field named, before anything runs: a NaN would pass through max() unseen
// and a negative cost would run time backwards.
TEST(Simulator, RefusesCostsThatAreNotFiniteOrNegative) {
  const Schedule s = generate_1f1b(3, 4);
  auto message = [&](const CostModel& costs) {
    try {
      simulate(s, costs);
    } catch (const ScheduleError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  CostModel nan_forward;
  nan_forward.forward = {1, std::nan(""), 1};
  EXPECT_EQ(message(nan_forward),
            "cost model: forward[1] is nan; costs, sizes and bandwidths must be finite and >= 0");
  CostModel negative_latency = CostModel::uniform(1, 1, 1, -0.5);
  EXPECT_NE(message(negative_latency).find("latency is -0.5;"), std::string::npos);
  CostModel infinite_bytes = CostModel::uniform(1, 1, 1);
  infinite_bytes.bandwidth = 1;
  infinite_bytes.message_bytes = {INFINITY};
  EXPECT_NE(message(infinite_bytes).find("message_bytes[0] is inf;"), std::string::npos);
  // Finite, but a huge size over a tiny bandwidth overflows.
  CostModel overflowing = CostModel::uniform(1, 1, 1);
  overflowing.bandwidth = 1e-300;
  overflowing.message_bytes = {1e300};
  EXPECT_NE(message(overflowing).find("times overflow"), std::string::npos);
  EXPECT_EQ(message(CostModel::uniform(1, 1, 1, 0.5)), "accepted");
}

TEST(Simulator, PerStageCostsBottleneck) {
  // The slowest stage sets the steady-state pace of 1F1B: makespan >= m * its F + B.
  CostModel costs;
  costs.forward = {1, 3, 1};
  costs.backward_input = {1, 3, 1};
  costs.backward_weight = {1, 1, 1};
  const int m = 10;
  const SimResult sim = simulate(generate_1f1b(3, m), costs);
  EXPECT_GE(sim.makespan, m * 7.0);
  EXPECT_DOUBLE_EQ(sim.ranks[1].busy, m * 7.0);
  EXPECT_DOUBLE_EQ(sim.ranks[0].busy, m * 3.0);
  for (const auto& r : sim.ranks) EXPECT_DOUBLE_EQ(r.busy + r.idle, sim.makespan);
}

TEST(Simulator, TimingsRespectDependencies) {
  const Schedule s = generate_interleaved(3, 6, 2);
  const SimResult sim = simulate(s, CostModel::uniform(1, 2, 1, 0.5));
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    double compute_end = 0;
    for (size_t i = 0; i < s.ranks[r].size(); ++i) {
      const auto& t = sim.timing[r][i];
      EXPECT_LE(t.start, t.end);
      if (is_compute(s.ranks[r][i].kind)) {
        EXPECT_GE(t.start, compute_end)
            << "rank " << r << " position " << i;  // one compute at a time
        compute_end = t.end;
      }
    }
  }
  // F of stage s+1 starts after F of stage s ends (plus the transfer).
  for (int st = 0; st + 1 < s.num_stages(); ++st) {
    const ActionRef a = find_action(s, ActionKind::kForward, st, 2);
    const ActionRef b = find_action(s, ActionKind::kForward, st + 1, 2);
    EXPECT_GE(sim.timing[b.rank][b.index].start, sim.timing[a.rank][a.index].end + 0.5);
  }
}

TEST(Output, ChromeTraceHasSlicesAndFlows) {
  const Schedule s = generate_1f1b(3, 4);
  const SimResult sim = simulate(s, CostModel::uniform(1, 1, 1, 0.1));
  const auto doc = nlohmann::json::parse(chrome_trace_json(s, sim));
  int slices = 0, flow_starts = 0, flow_ends = 0, transfers = 0;
  for (const auto& list : s.ranks)
    for (const auto& a : list) transfers += is_transfer(a.kind);
  for (const auto& ev : doc["traceEvents"]) {
    const std::string ph = ev["ph"];
    slices += ph == "X";
    flow_starts += ph == "s";
    flow_ends += ph == "f";
  }
  EXPECT_EQ(slices, transfers + 3 * 4 * 2);
  EXPECT_EQ(flow_starts, transfers / 2);
  EXPECT_EQ(flow_ends, transfers / 2);
}

TEST(Output, SvgDrawsOneBoxPerComputeAction) {
  const Schedule s = generate_zbh1(4, 8);
  const SimResult sim = simulate(s, CostModel::uniform(1, 1, 1));
  SvgOptions options;
  options.title = "zbh1 <p=4>";
  const std::string svg = render_svg(s, sim, options);
  size_t boxes = 0;
  for (size_t at = svg.find("<g><title>"); at != std::string::npos;
       at = svg.find("<g><title>", at + 1))
    ++boxes;
  EXPECT_EQ(boxes, 3u * 4 * 8);
  EXPECT_NE(svg.find("zbh1 &lt;p=4&gt;"), std::string::npos);
  EXPECT_EQ(svg.rfind("</svg>"), svg.size() - 7);
}

// A title made of a loaded schedule's name may hold any bytes; the picture stays XML: no
// control character but line breaks, only well-formed UTF-8, what is not shown as \xNN.
TEST(Output, SvgTitleOfAnyBytesStaysXml) {
  const Schedule s = generate(ScheduleKind::k1F1B, 2, 2);
  SvgOptions options;
  options.title = std::string(
                      "a\x01"
                      "b\x1b[31m \xff\xc3(") +
                  "\xc3\xa9 \xed\xa0\x80 \x7f";
  const std::string svg = render_svg(s, simulate(s, CostModel::uniform(1, 1, 1)), options);
  EXPECT_NE(svg.find("a\\x01b\\x1b[31m \\xff\\xc3(\xc3\xa9 \\xed\\xa0\\x80 \\x7f"),
            std::string::npos);
  for (size_t at = 0; at < svg.size(); ++at) {
    const auto c = static_cast<unsigned char>(svg[at]);
    ASSERT_TRUE(c >= 0x20 || c == '\n') << "control character " << int{c} << " at " << at;
    ASSERT_NE(c, 0x7f) << "at " << at;
    if (c < 0x80) continue;
    // The only non-ASCII character of the picture is the title's e-acute, C3 A9.
    ASSERT_EQ(c, 0xc3) << "at " << at;
    ASSERT_EQ(static_cast<unsigned char>(svg[++at]), 0xa9) << "at " << at;
  }
}

// A picture cut at max_ranks says how many of all the ranks' boxes it drew.
TEST(Output, SvgNoteCountsTheBoxesOfEveryRank) {
  const Schedule s = generate(ScheduleKind::k1F1B, 4, 2);
  SvgOptions options;
  options.max_ranks = 2;
  const std::string svg = render_svg(s, simulate(s, CostModel::uniform(1, 1, 1)), options);
  EXPECT_NE(svg.find("drawn: 2 of 4 ranks, 8 of 16 actions (size cap)"), std::string::npos)
      << svg.substr(svg.find("drawn:"), 60);
}

// Every left-aligned text of the picture ends inside the canvas, at the 7 px per character
// the layout assumes for its 12 px labels.
void expect_texts_inside_canvas(const std::string& svg) {
  const auto attr = [](const std::string& element, const std::string& name) {
    const auto at = element.find(" " + name + "=\"");
    if (at == std::string::npos) return std::string();
    const auto begin = at + name.size() + 3;
    return element.substr(begin, element.find('"', begin) - begin);
  };
  const double width = std::stod(attr(svg.substr(0, svg.find('>')), "width"));
  size_t checked = 0;
  for (size_t at = svg.find("<text "); at != std::string::npos; at = svg.find("<text ", at + 1)) {
    const auto close = svg.find('>', at), end = svg.find("</text>", at);
    const std::string element = svg.substr(at, close - at);
    if (!attr(element, "text-anchor").empty()) continue;  // centred or right-aligned
    const std::string content = svg.substr(close + 1, end - close - 1);
    EXPECT_LE(std::stod(attr(element, "x")) + 7.0 * content.size(), width) << content;
    ++checked;
  }
  EXPECT_GE(checked, 4u);  // at least F, B, idle and the statistics line
}

TEST(Output, SvgLegendFitsTheCanvasOfEverySchedule) {
  for (const auto& s : {generate_zbv(4, 8), generate_zbh1(4, 8), generate_interleaved(2, 4, 2),
                        generate(ScheduleKind::k1F1B, 1, 1)}) {
    SvgOptions options;
    options.px_per_unit = 2;  // a narrow time axis: the legend, not the rows, sets the width
    expect_texts_inside_canvas(
        render_svg(s, simulate(s, CostModel::uniform(1, 1, 1, 0.5)), options));
    expect_texts_inside_canvas(render_svg(s, simulate(s, CostModel::uniform(1, 1, 1))));
  }
}

TEST(Output, SvgDrawsTransfersThatTakeTime) {
  const Schedule s = generate(ScheduleKind::k1F1B, 4, 8);
  size_t transfers = 0;
  for (const auto& list : s.ranks)
    for (const auto& a : list) transfers += is_transfer(a.kind);
  auto strips = [](const std::string& svg, const char* fill) {
    size_t n = 0;
    for (size_t at = svg.find(std::string("fill=\"") + fill + "\"/></g>"); at != std::string::npos;
         at = svg.find(std::string("fill=\"") + fill + "\"/></g>", at + 1))
      ++n;
    return n;
  };
  const std::string costed = render_svg(s, simulate(s, CostModel::uniform(1, 1, 1, 0.25)));
  EXPECT_EQ(strips(costed, "#76706b") + strips(costed, "#b07aa1"), transfers);
  EXPECT_EQ(strips(costed, "#76706b"), transfers / 2);
  EXPECT_NE(costed.find("send (strip)"), std::string::npos);
  const std::string free = render_svg(s, simulate(s, CostModel::uniform(1, 1, 1)));
  EXPECT_EQ(strips(free, "#76706b") + strips(free, "#b07aa1"), 0u);
  EXPECT_EQ(free.find("send (strip)"), std::string::npos);
}

// Replay re-times a recorded run; it must give simulate()'s numbers exactly, not nearly: the
// partition search compares step times for equality when it breaks ties.
TEST(Replay, SameTimesAsSimulateOnRandomSchedulesAndCosts) {
  std::mt19937_64 rng(20240611);
  std::uniform_real_distribution<double> cost(0.05, 3.0), bytes(1e3, 1e7);
  const ScheduleKind kinds[] = {ScheduleKind::kGPipe, ScheduleKind::k1F1B,
                                ScheduleKind::kInterleaved, ScheduleKind::kZBH1,
                                ScheduleKind::kZBV};
  int compared = 0;
  for (ScheduleKind kind : kinds)
    for (int p : {1, 2, 3, 4, 6})
      for (int m : {1, 2, 3, 4, 8, 12})
        for (int replicas : {1, 3}) {
          const int v = kind == ScheduleKind::kInterleaved || kind == ScheduleKind::kZBV ? 2 : 1;
          Schedule s;
          try {
            s = generate(kind, p, m, v, replicas);
          } catch (const ScheduleError&) {
            continue;  // a shape the kind does not take (interleaved needs m % p == 0)
          }
          if (replicas > 1 && rng() % 2) {
            std::vector<int> buckets(s.num_stages());
            for (int& b : buckets) b = 1 + static_cast<int>(rng() % 4);
            add_gradient_all_reduces(&s, replicas, buckets);
          }
          const int stages = s.num_stages();
          Replay replay(s);
          for (int trial = 0; trial < 4; ++trial) {
            CostModel c;
            c.forward.clear(), c.backward_input.clear(), c.backward_weight.clear();
            for (int st = 0; st < stages; ++st) {
              c.forward.push_back(cost(rng)), c.backward_input.push_back(cost(rng));
              c.backward_weight.push_back(cost(rng)), c.message_bytes.push_back(bytes(rng));
              c.gradient_bytes.push_back(bytes(rng));
            }
            if (trial % 2) c.backward.assign(1, cost(rng));  // one B cost for every stage
            c.latency = trial == 0 ? 0.0 : cost(rng) / 10;
            c.bandwidth = trial < 2 ? 0.0 : 1e6 * cost(rng);
            c.reduce_latency = cost(rng) / 5;
            c.reduce_bandwidth = trial == 3 ? 0.0 : 2e6 * cost(rng);
            const SimResult want = simulate(s, c);
            const double makespan = replay.run(c);
            const SimResult got = replay.result();
            const std::string where = std::string(schedule_kind_name(kind)) +
                                      " p=" + std::to_string(p) + " m=" + std::to_string(m) +
                                      " D=" + std::to_string(replicas) + " trial " +
                                      std::to_string(trial);
            ASSERT_EQ(makespan, want.makespan) << where;
            ASSERT_EQ(got.makespan, want.makespan) << where;
            ASSERT_EQ(got.bubble_fraction, want.bubble_fraction) << where;
            for (int r = 0; r < s.num_ranks(); ++r) {
              ASSERT_EQ(got.ranks[r].busy, want.ranks[r].busy) << where << " rank " << r;
              ASSERT_EQ(got.ranks[r].reduce, want.ranks[r].reduce) << where << " rank " << r;
              ASSERT_EQ(got.ranks[r].end, want.ranks[r].end) << where << " rank " << r;
              ASSERT_EQ(got.ranks[r].idle, want.ranks[r].idle) << where << " rank " << r;
              for (size_t j = 0; j < s.ranks[r].size(); ++j) {
                ASSERT_EQ(got.timing[r][j].start, want.timing[r][j].start)
                    << where << " rank " << r << " position " << j;
                ASSERT_EQ(got.timing[r][j].end, want.timing[r][j].end)
                    << where << " rank " << r << " position " << j;
                ASSERT_EQ(replay.timing(r, static_cast<int>(j)).end, want.timing[r][j].end);
              }
            }
            ++compared;
          }
        }
  EXPECT_GT(compared, 400);
}

// The critical path adds up to the makespan of its run, and under any other costs to no more
// than that run's makespan: the partition search bounds step times with it.
TEST(Replay, CriticalPathIsTheMakespanAndBoundsOtherCosts) {
  std::mt19937_64 rng(8128);
  std::uniform_real_distribution<double> cost(0.05, 3.0), bytes(1e3, 1e7);
  auto random_costs = [&](int stages, int trial) {
    CostModel c;
    c.forward.clear(), c.backward_input.clear(), c.backward_weight.clear();
    for (int st = 0; st < stages; ++st) {
      c.forward.push_back(cost(rng)), c.backward_input.push_back(cost(rng));
      c.backward_weight.push_back(cost(rng)), c.message_bytes.push_back(bytes(rng));
    }
    c.latency = trial == 0 ? 0.0 : cost(rng) / 10;
    c.bandwidth = trial < 2 ? 0.0 : 1e6 * cost(rng);
    return c;
  };
  auto length = [](const std::vector<Action>& path, const CostModel& c) {
    double total = 0;
    for (const Action& a : path) total += c.cost(a);
    return total;
  };
  int checked = 0;
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved,
                            ScheduleKind::kZBH1, ScheduleKind::kZBV})
    for (int p : {1, 2, 3, 4})
      for (int m : {1, 2, 4, 8}) {
        const int v = kind == ScheduleKind::kInterleaved || kind == ScheduleKind::kZBV ? 2 : 1;
        Schedule s;
        try {
          s = generate(kind, p, m, v);
        } catch (const ScheduleError&) {
          continue;
        }
        Replay replay(s);
        for (int trial = 0; trial < 3; ++trial) {
          SCOPED_TRACE(std::string(schedule_kind_name(kind)) + " p=" + std::to_string(p) +
                       " m=" + std::to_string(m) + " trial " + std::to_string(trial));
          const CostModel timed = random_costs(s.num_stages(), trial);
          const double makespan = replay.run(timed);
          const std::vector<Action> path = replay.critical_path();
          ASSERT_FALSE(path.empty());
          EXPECT_NEAR(length(path, timed), makespan, 1e-12 * makespan);
          for (int other = 0; other < 3; ++other) {
            const CostModel c = random_costs(s.num_stages(), trial);
            EXPECT_LE(length(path, c), replay.run(c) * (1 + 1e-12));
          }
          ++checked;
        }
      }
  EXPECT_GT(checked, 100);
}

TEST(Replay, RejectsWhatSimulateRejects) {
  Schedule s = generate_1f1b(2, 2);
  s.ranks[0].erase(s.ranks[0].begin());  // the first forward: nothing feeds the rest
  EXPECT_THROW(simulate(s), DeadlockError);
  EXPECT_THROW(Replay{s}, DeadlockError);
}

}  // namespace
}  // namespace conveyor::schedule

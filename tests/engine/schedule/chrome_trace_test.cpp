// The Chrome trace of a schedule: written piece by piece (memory of one piece, whatever the
// action count), every action once with its time, and every flow arrow joining the two ends
// of its message; a valid document also for names that need escaping.
#include "engine/schedule/chrome_trace.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/schedule/generators.h"
#include "engine/schedule/measured_timing.h"
#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"

namespace conveyor::schedule {
namespace {

// F, I, W and transfer costs drawn from `rng`, each in [0.25, 2).
CostModel random_costs(std::mt19937& rng) {
  std::uniform_real_distribution<double> cost(0.25, 2.0);
  return CostModel::uniform(cost(rng), cost(rng), cost(rng), cost(rng));
}

// A time of the trace in whole nanoseconds, the grid it is written on.
int64_t ns(double us) { return std::llround(us * 1000); }
int64_t ns(const nlohmann::json& us) { return ns(us.get<double>()); }

TEST(ChromeTrace, IsHandedOnInPiecesOfBoundedSize) {
  std::mt19937 rng(7);
  const Schedule s = generate(ScheduleKind::k1F1B, 16, 512);  // 47,104 actions, ~11 MB
  const SimResult sim = simulate(s, random_costs(rng));
  std::string joined;
  size_t pieces = 0, largest = 0;
  write_chrome_trace(s, sim, 1000.0, [&](std::string_view piece) {
    ++pieces;
    largest = std::max(largest, piece.size());
    joined += piece;
  });
  // A piece ends at the first event past kTracePieceBytes: no event is near 1 KiB.
  EXPECT_LE(largest, kTracePieceBytes + 1024);
  EXPECT_GE(pieces, joined.size() / (kTracePieceBytes + 1024));
  EXPECT_GT(pieces, 5u);
  EXPECT_EQ(joined, chrome_trace_json(s, sim));
  EXPECT_TRUE(nlohmann::json::accept(joined));
}

TEST(ChromeTrace, HoldsEveryActionOnceAndJoinsEveryMessagesEnds) {
  std::mt19937 rng(11);
  for (const ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kZBV}) {
    const Schedule s = generate(kind, 3, 6, kind == ScheduleKind::kZBV ? 2 : 1, /*replicas=*/2);
    CostModel costs = random_costs(rng);
    costs.gradient_bytes = {3.0};
    const SimResult sim = simulate(s, costs);
    // Two replicas on one clock, the second later, as a measured step has them.
    std::vector<std::vector<ActionTiming>> world = sim.timing;
    for (const auto& rank : sim.timing) {
      world.push_back(rank);
      for (auto& t : world.back()) t.start += 5, t.end += 5;
    }
    const std::vector<SimResult> replicas = summarize_replicas(s, world);
    const double us = 250.0;
    const auto doc = nlohmann::json::parse(chrome_trace_json(s, replicas, us));
    const int R = s.num_ranks();
    std::map<std::pair<int, int>, int> seen;  // (pid, position) -> slices
    std::map<int64_t, std::vector<nlohmann::json>> flows;
    for (const auto& ev : doc["traceEvents"]) {
      if (ev["ph"] == "s" || ev["ph"] == "f") flows[ev["id"].get<int64_t>()].push_back(ev);
      if (ev["ph"] != "X") continue;
      const int pid = ev["pid"], position = ev["args"]["position"];
      ++seen[{pid, position}];
      const int d = pid / R, r = pid % R;
      ASSERT_LT(static_cast<size_t>(position), s.ranks[r].size());
      const Action& a = s.ranks[r][position];
      const ActionTiming& t = replicas[d].timing[r][position];
      EXPECT_EQ(ev["name"], to_string(a));
      EXPECT_EQ(ns(ev["ts"]), ns(t.start * us));
      EXPECT_EQ(ns(ev["dur"]), ns(t.end * us) - ns(t.start * us));
    }
    size_t actions = 0, transfers = 0;
    for (const auto& list : s.ranks)
      for (const Action& a : list) ++actions, transfers += is_transfer(a.kind);
    EXPECT_EQ(seen.size(), 2 * actions);
    for (const auto& [at, n] : seen) EXPECT_EQ(n, 1) << "pid " << at.first << " @" << at.second;
    // One arrow per message of each replica: from its send, at the send's start, to its
    // receive on the peer, in the same replica.
    EXPECT_EQ(flows.size(), transfers);  // 2 replicas x transfers / 2 ends
    for (const auto& [id, ends] : flows) {
      ASSERT_EQ(ends.size(), 2u) << "flow " << id;
      const auto& send = ends[0]["ph"] == "s" ? ends[0] : ends[1];
      const auto& recv = ends[0]["ph"] == "s" ? ends[1] : ends[0];
      ASSERT_EQ(send["ph"], "s");
      ASSERT_EQ(recv["ph"], "f");
      const int sp = send["pid"], rp = recv["pid"];
      EXPECT_EQ(sp / R, rp / R) << "flow " << id << " crosses replicas";
      bool found = false;
      for (size_t i = 0; i < s.ranks[sp % R].size() && !found; ++i) {
        const Action& a = s.ranks[sp % R][i];
        if (!is_send(a.kind) || a.peer != rp % R) continue;
        found = ns(replicas[sp / R].timing[sp % R][i].start * us) == ns(send["ts"]);
      }
      EXPECT_TRUE(found) << "flow " << id << " starts at no send to rank " << rp;
    }
  }
}

// A measured receive is posted before its send starts (and a simulated one may wait on the
// sender's stream): each arrow ends inside its receive, never before its send begins, where
// a viewer would drop it.
TEST(ChromeTrace, ArrowsEndInsideTheReceiveNotBeforeTheSend) {
  const Schedule s = generate(ScheduleKind::k1F1B, 2, 3);
  SimResult sim = simulate(s, CostModel::uniform(1, 1, 1, 0.5));
  // Receives posted at 0 and taking until their message arrives, as an executor records them;
  // one send that starts after its receive ended, as clocks of two processes may say.
  for (size_t r = 0; r < s.ranks.size(); ++r)
    for (size_t i = 0; i < s.ranks[r].size(); ++i)
      if (is_recv(s.ranks[r][i].kind)) sim.timing[r][i].start = 0;
  const ActionRef late = find_action(s, ActionKind::kSendAct, 0, 2);
  sim.timing[late.rank][late.index].start += 100, sim.timing[late.rank][late.index].end += 100;
  const double us = 10.0;
  const auto doc = nlohmann::json::parse(chrome_trace_json(s, sim, us));
  std::map<int64_t, double> sent;
  std::vector<std::pair<int64_t, const nlohmann::json*>> ends;
  for (const auto& ev : doc["traceEvents"]) {
    if (ev["ph"] == "s") sent[ev["id"].get<int64_t>()] = ev["ts"].get<double>();
    if (ev["ph"] == "f") ends.emplace_back(ev["id"].get<int64_t>(), &ev);
  }
  size_t late_arrows = 0;
  for (const auto& [id, end] : ends) {
    ASSERT_TRUE(sent.count(id)) << "flow " << id;
    const double at = (*end)["ts"].get<double>();
    const int pid = (*end)["pid"];
    bool inside = false;
    for (size_t i = 0; i < s.ranks[pid].size(); ++i) {
      const Action& a = s.ranks[pid][i];
      if (!is_recv(a.kind)) continue;
      const ActionTiming& t = sim.timing[pid][i];
      if (at >= t.start * us && at <= t.end * us) inside = true;
    }
    EXPECT_TRUE(inside) << "flow " << id << " ends outside every receive of rank " << pid;
    if (sent[id] > at) {
      ++late_arrows;  // only the send moved past its receive's end
      continue;
    }
    EXPECT_EQ(at, sent[id]) << "flow " << id << " ends elsewhere than where its send began";
  }
  EXPECT_EQ(late_arrows, 1u);
}

// A timeline drawn beside another (a simulated step under two measured replicas): its
// processes from first_pid, sorted by that pid and named with the prefix, its peers among its
// own processes, its arrows numbered past every id of the other; otherwise the same events.
TEST(ChromeTrace, NumbersASecondTimelinePastTheFirst) {
  std::mt19937 rng(13);
  const Schedule s = generate(ScheduleKind::k1F1B, 3, 5, 1, /*replicas=*/2);
  CostModel costs = random_costs(rng);
  costs.gradient_bytes = {2.0};
  const SimResult sim = simulate(s, costs);
  std::vector<std::vector<ActionTiming>> world = sim.timing;
  world.insert(world.end(), sim.timing.begin(), sim.timing.end());
  const auto measured = nlohmann::json::parse(chrome_trace_json(s, summarize_replicas(s, world)));
  const TraceProcesses second{
      .first_pid = 2000000, .first_flow_id = trace_flow_ids(s, 2), .name_prefix = "simulated "};
  const auto plain = nlohmann::json::parse(chrome_trace_json(s, sim));
  const auto drawn = nlohmann::json::parse(chrome_trace_json(s, sim, 1000.0, second));
  std::set<int64_t> measured_ids;
  for (const auto& ev : measured["traceEvents"])
    if (ev.contains("id")) {
      measured_ids.insert(ev["id"].get<int64_t>());
      EXPECT_LE(ev["id"].get<int64_t>(), trace_flow_ids(s, 2));
    }
  ASSERT_EQ(plain["traceEvents"].size(), drawn["traceEvents"].size());
  const int R = s.num_ranks();
  size_t flows = 0;
  for (size_t k = 0; k < drawn["traceEvents"].size(); ++k) {
    const auto& ev = drawn["traceEvents"][k];
    auto was = plain["traceEvents"][k];  // the same event numbered from 0
    const int64_t pid = ev["pid"];
    ASSERT_GE(pid, second.first_pid);
    ASSERT_LT(pid, second.first_pid + R);
    EXPECT_EQ(was["pid"].get<int64_t>(), pid - second.first_pid);
    was["pid"] = pid;
    if (ev["name"] == "process_name") {
      EXPECT_EQ(ev["args"]["name"], "simulated rank " + std::to_string(pid - second.first_pid));
      was["args"]["name"] = ev["args"]["name"];
    }
    if (ev["name"] == "process_sort_index") {
      EXPECT_EQ(ev["args"]["sort_index"].get<int64_t>(), pid);
      was["args"]["sort_index"] = pid;
    }
    if (ev.contains("args") && ev["args"].contains("peer")) {
      EXPECT_EQ(ev["args"]["peer"].get<int64_t>(),
                was["args"]["peer"].get<int64_t>() + second.first_pid);
      was["args"]["peer"] = ev["args"]["peer"];
    }
    if (ev.contains("id")) {
      ++flows;
      const int64_t id = ev["id"];
      EXPECT_EQ(id, was["id"].get<int64_t>() + second.first_flow_id);
      EXPECT_FALSE(measured_ids.count(id)) << "flow " << id << " is also a measured arrow's";
      EXPECT_LE(id, second.first_flow_id + trace_flow_ids(s, 1));
      was["id"] = id;
    }
    EXPECT_EQ(ev, was) << "event " << k;
  }
  EXPECT_GT(flows, 0u);
  EXPECT_EQ(drawn["otherData"], plain["otherData"]);
}

// Each slice's start and duration as written: whole nanoseconds in exact decimal
// microseconds (what a viewer reads, Perfetto in nanoseconds), by (pid, tid) in the order
// written, as (start, end) in nanoseconds.
std::map<std::pair<int64_t, int64_t>, std::vector<std::pair<int64_t, int64_t>>> written_slices(
    const std::string& trace) {
  static const std::regex slice(
      R"("ph": "X", .*"pid": (\d+), "tid": (\d+), "ts": ([^,]*), "dur": ([^,]*),)");
  static const std::regex microseconds(R"((\d+)(?:\.(\d{1,3}))?)");
  auto nanoseconds = [](const std::string& text) -> int64_t {
    std::smatch m;
    if (!std::regex_match(text, m, microseconds)) {
      ADD_FAILURE() << "'" << text << "' is not a whole number of nanoseconds, at least 0";
      return -1;
    }
    const std::string fraction = (m[2].str() + "000").substr(0, 3);
    return std::stoll(m[1]) * 1000 + std::stoll(fraction);
  };
  std::map<std::pair<int64_t, int64_t>, std::vector<std::pair<int64_t, int64_t>>> slices;
  std::istringstream lines(trace);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (!std::regex_search(line, m, slice)) continue;
    const int64_t ts = nanoseconds(m[3]);
    slices[{std::stoll(m[1]), std::stoll(m[2])}].emplace_back(ts, ts + nanoseconds(m[4]));
  }
  return slices;
}

// Slices that follow each other on one thread do not overlap as written: each start and end
// is rounded to one grid, so one that ends where the next begins is written to end there,
// where start plus duration computed each in floating point overshot it (by 1e-9 us at a
// million us) and viewers nest or move slices that overlap. Zero-cost actions last 0, none
// starts before 0.
TEST(ChromeTrace, SlicesOfOneThreadEndWhereTheNextBeginsNotPast) {
  std::mt19937 rng(19);
  // Costs of a tenth, whose sums carry rounding noise, as `schedule --costs 1,1,1,0.1` has;
  // zero costs; costs drawn at random; a unit of a nanosecond, which rounding collapses.
  const Schedule s = generate(ScheduleKind::kInterleaved, 4, 16, 2);
  const SimResult tenths = simulate(s, CostModel::uniform(0.5, 0.5, 0.5, 0.1));
  const SimResult zero = simulate(s, CostModel::uniform(0, 0.3, 0, 0.1));
  const SimResult drawn = simulate(s, random_costs(rng));
  for (const auto& [timeline, us] : {std::pair{&tenths, 1000.0},
                                     {&tenths, 0.001},
                                     {&zero, 1000.0},
                                     {&drawn, 1000.0},
                                     {&drawn, 3e4}}) {
    const std::string trace = chrome_trace_json(s, *timeline, us);
    size_t seen = 0, touching = 0;
    for (auto& [thread, on] : written_slices(trace)) {
      seen += on.size();
      std::sort(on.begin(), on.end());
      for (size_t k = 0; k < on.size(); ++k) {
        EXPECT_GE(on[k].first, 0);
        EXPECT_GE(on[k].second, on[k].first);
        if (k == 0) continue;
        EXPECT_GE(on[k].first, on[k - 1].second)
            << "pid " << thread.first << " tid " << thread.second << " slice " << k << " at " << us
            << " us a unit";
        touching += on[k].first == on[k - 1].second;
      }
    }
    size_t actions = 0;
    for (const auto& list : s.ranks) actions += list.size();
    EXPECT_EQ(seen, actions);
    EXPECT_GT(touching, actions / 4);
  }
}

// Checks that no two slices of one thread overlap (a viewer drops those that do without
// nesting: Perfetto does), that every thread is named, and that the all-reduces are on
// threads 3 .. 3 + lanes - 1 of each rank, named "allreduce", "allreduce 2", ...
void expect_all_reduces_on_lanes(const nlohmann::json& doc, int ranks, int reduces, int lanes) {
  using Thread = std::pair<int64_t, int64_t>;
  std::map<Thread, std::string> names;
  std::map<Thread, std::vector<std::pair<double, double>>> slices;
  int seen = 0;
  for (const auto& ev : doc["traceEvents"]) {
    const Thread thread(ev["pid"].get<int64_t>(), ev.value("tid", int64_t{-1}));
    if (ev["name"] == "thread_name") names[thread] = ev["args"]["name"];
    if (ev["ph"] != "X") continue;
    const double ts = ev["ts"];
    slices[thread].emplace_back(ts, ts + ev["dur"].get<double>());
    if (ev["cat"] == kind_name(ActionKind::kAllReduceGrad)) {
      ++seen;
      EXPECT_GE(thread.second, 3);
      EXPECT_LT(thread.second, 3 + lanes) << ev["name"];
    }
  }
  EXPECT_EQ(seen, reduces);
  for (int64_t pid = 0; pid < ranks; ++pid)
    for (int lane = 0; lane < lanes; ++lane) {
      const std::string want = lane == 0 ? "allreduce" : "allreduce " + std::to_string(lane + 1);
      EXPECT_EQ(names[Thread(pid, 3 + lane)], want);
    }
  EXPECT_EQ(names.size(), static_cast<size_t>(ranks * (3 + lanes)));
  for (auto& [thread, on] : slices) {
    EXPECT_TRUE(names.count(thread)) << "tid " << thread.second << " has no name";
    std::sort(on.begin(), on.end());
    for (size_t k = 1; k < on.size(); ++k)
      EXPECT_LE(on[k - 1].second, on[k].first + 1e-6)
          << "slices overlap on pid " << thread.first << " tid " << thread.second;
  }
}

// A measured step has several all-reduce buckets in flight at once: those that overlap go on
// threads of their own. A simulation, whose buckets take the link one after the other, keeps
// them all on the one "allreduce" thread.
TEST(ChromeTrace, PutsAllReducesInFlightTogetherOnThreadsOfTheirOwn) {
  std::mt19937 rng(17);
  Schedule s = generate(ScheduleKind::k1F1B, 2, 4);
  add_gradient_all_reduces(&s, 2, {4});
  CostModel costs = random_costs(rng);
  costs.gradient_bytes = {3.0};
  const SimResult sim = simulate(s, costs);
  expect_all_reduces_on_lanes(nlohmann::json::parse(chrome_trace_json(s, sim)), 2, 8, 1);
  // Each bucket issued a little after the one before and summed over a longer time, as the
  // executor starts them: all four in flight together.
  SimResult measured = sim;
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    double issued = -1;
    for (size_t i = 0; i < s.ranks[r].size(); ++i)
      if (is_reduce(s.ranks[r][i].kind)) {
        ActionTiming& t = measured.timing[r][i];
        issued = issued < 0 ? t.start : issued + 0.125;
        t.start = issued;
        t.end = issued + 2;
      }
  }
  expect_all_reduces_on_lanes(nlohmann::json::parse(chrome_trace_json(s, measured)), 2, 8, 4);
}

TEST(ChromeTrace, EscapesTheScheduleName) {
  Schedule s = generate(ScheduleKind::kGPipe, 2, 2);
  const SimResult sim = simulate(s, CostModel::uniform(1, 1, 1));
  s.name = "a \"quoted\"\\ name\n\twith\x01 é and \xff";
  const auto doc = nlohmann::json::parse(chrome_trace_json(s, sim));
  // Valid UTF-8 read back as it was, the byte that is not replaced by U+FFFD.
  EXPECT_EQ(doc["otherData"]["schedule"], "a \"quoted\"\\ name\n\twith\x01 é and \xef\xbf\xbd");
}

TEST(ChromeTrace, RefusesATimelineOfAnotherShapeBeforeWriting) {
  const Schedule s = generate(ScheduleKind::k1F1B, 3, 4);
  SimResult sim = simulate(s, CostModel::uniform(1, 1, 1));
  sim.timing[2].pop_back();
  size_t written = 0;
  EXPECT_THROW(write_chrome_trace(s, sim, 1.0, [&](std::string_view p) { written += p.size(); }),
               std::invalid_argument);
  EXPECT_EQ(written, 0u);
  EXPECT_THROW(chrome_trace_json(s, std::vector<SimResult>{}), std::invalid_argument);
  // A time that is no number of microseconds (costs near the largest double, drawn 1000 us a
  // unit): refused with the action named, not written as null.
  SimResult overflowing = simulate(s, CostModel::uniform(1e306, 1, 1));
  try {
    write_chrome_trace(s, overflowing, 1000.0, [&](std::string_view p) { written += p.size(); });
    ADD_FAILURE() << "a time of 1e309 us was written";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("F0.0 of rank 0 in timeline 0 runs from 0 to 1e+306 "
                                         "units of 1000 us; use smaller costs"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(written, 0u);
}

}  // namespace
}  // namespace conveyor::schedule

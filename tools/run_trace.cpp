#include "tools/run_trace.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "engine/schedule/trace_time.h"

namespace conveyor {
namespace {

// Events keep their keys in the order they were written.
using json = nlohmann::ordered_json;
using schedule::TraceGrid;

constexpr int64_t kRunPid = RunTrace::kRunPid;
constexpr int kLoopTid = 0, kWriterTid = 1;

// The whole document is on the run clock's grid, whole nanoseconds; an event's "ts" and "dur"
// hold tick counts until they are written.
const TraceGrid kNanoseconds;

json slice(const std::string& name, int tid, int64_t begin_ns, int64_t end_ns) {
  return {{"ph", "X"},  {"name", name},   {"pid", kRunPid},
          {"tid", tid}, {"ts", begin_ns}, {"dur", std::max<int64_t>(0, end_ns - begin_ns)}};
}

json thread_name(int tid, const char* name) {
  return {{"ph", "M"},
          {"name", "thread_name"},
          {"pid", kRunPid},
          {"tid", tid},
          {"args", {{"name", name}}}};
}

// `v` as JSON text with a space after each colon and comma, as chrome_trace writes it; an
// event's times as exact decimal microseconds.
void append_value(std::string& out, const json& v, bool event = false) {
  if (!v.is_object()) {
    out += v.dump(-1, ' ', false, json::error_handler_t::replace);
    return;
  }
  out += '{';
  bool first = true;
  for (const auto& [key, value] : v.items()) {
    if (!first) out += ", ";
    first = false;
    out += json(key).dump(-1, ' ', false, json::error_handler_t::replace);
    out += ": ";
    if (event && (key == "ts" || key == "dur"))
      kNanoseconds.append(out, value.get<int64_t>());
    else
      append_value(out, value);
  }
  out += '}';
}

}  // namespace

int64_t RunTrace::ns(Clock::time_point t) const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t - start_).count();
}

void RunTrace::add_step(int64_t step, Clock::time_point begin, Clock::time_point end,
                        double pipeline_seconds) {
  // One at a time, so that the trace holds the last kMaxSteps steps, not as few as half.
  if (steps_.size() == kMaxSteps) {
    steps_.pop_front();
    ++dropped_;
  }
  const int64_t begin_ns = ns(begin), end_ns = ns(end);
  // The pipeline ran the end of the step: from no earlier than its begin.
  const double pipeline_ns = std::clamp(
      pipeline_seconds * 1e9, 0.0, static_cast<double>(std::max<int64_t>(0, end_ns - begin_ns)));
  const int64_t pipeline_begin_ns =
      std::isnan(pipeline_ns) ? begin_ns : end_ns - std::llround(pipeline_ns);
  steps_.push_back({step, begin_ns, end_ns, std::max(begin_ns, pipeline_begin_ns)});
}

void RunTrace::add_evaluation(int64_t after_step, Clock::time_point begin, Clock::time_point end) {
  // Those of steps dropped from the front go with them (there is at most one a step).
  if (!steps_.empty())
    evaluations_.erase(evaluations_.begin(),
                       std::find_if(evaluations_.begin(), evaluations_.end(),
                                    [&](const Step& e) { return e.step >= steps_.front().step; }));
  evaluations_.push_back({after_step, ns(begin), ns(end)});
}

std::string RunTrace::to_json(const std::string& last_step_trace,
                              const std::string& simulated_step_trace, double first_action_us,
                              const std::vector<SaveTiming>& saves) const {
  std::vector<json> events;
  events.push_back({{"ph", "M"},
                    {"name", "process_name"},
                    {"pid", kRunPid},
                    {"args", {{"name", "training run"}}}});
  events.push_back({{"ph", "M"},
                    {"name", "process_sort_index"},
                    {"pid", kRunPid},
                    {"args", {{"sort_index", -1}}}});
  events.push_back(thread_name(kLoopTid, "training loop"));
  events.push_back(thread_name(kWriterTid, "checkpoint write"));
  for (const Step& s : steps_)
    events.push_back(slice("step " + std::to_string(s.step), kLoopTid, s.begin_ns, s.end_ns));
  for (const Step& e : evaluations_)
    events.push_back(
        slice("evaluation after step " + std::to_string(e.step), kLoopTid, e.begin_ns, e.end_ns));
  for (const SaveTiming& save : saves) {
    const std::string name =
        "step_" + std::to_string(save.step) + (save.committed ? "" : " (failed)");
    events.push_back(slice((save.async ? "snapshot " : "save ") + name, kLoopTid,
                           ns(save.hold_begin), ns(save.hold_end)));
    events.push_back(slice("write " + name, save.async ? kWriterTid : kLoopTid,
                           ns(save.write_begin), ns(save.write_end)));
  }
  // Written with its keys sorted and one a line: the count of dropped steps ends the object.
  nlohmann::json other = {{"steps_dropped_from_the_front", dropped_}};
  // The last step's ranks, measured and simulated, each moved from its first action to where
  // that action ran on the run's clock: after the batch was drawn and the pipeline started,
  // not at the step's begin. Moved by whole nanoseconds, their slices stay on the grid they
  // were written on, each ending where it did against the next.
  auto place_last_step = [&](const std::string& trace, const char* key) {
    if (trace.empty() || steps_.empty()) return;
    const int64_t origin =
        std::min(steps_.back().pipeline_begin_ns + kNanoseconds.ticks(first_action_us),
                 steps_.back().end_ns);
    json last = json::parse(trace);
    for (auto& ev : last["traceEvents"]) {
      if (ev.contains("ts")) ev["ts"] = kNanoseconds.ticks(ev["ts"].get<double>()) + origin;
      if (ev.contains("dur")) ev["dur"] = kNanoseconds.ticks(ev["dur"].get<double>());
      events.push_back(std::move(ev));
    }
    other[key] = last["otherData"];
  };
  place_last_step(last_step_trace, "last_step");
  place_last_step(simulated_step_trace, "simulated_last_step");
  // One event a line, as chrome_trace writes them: a long run's trace stays small.
  std::string out =
      "{\"displayTimeUnit\": \"ms\", \"otherData\": " + other.dump(1) + ", \"traceEvents\": [";
  for (size_t k = 0; k < events.size(); ++k) {
    out += k == 0 ? "\n" : ",\n";
    append_value(out, events[k], /*event=*/true);
  }
  out += "\n]}\n";
  return out;
}

}  // namespace conveyor

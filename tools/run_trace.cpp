#include "tools/run_trace.h"

#include <algorithm>
#include <nlohmann/json.hpp>

namespace conveyor {
namespace {

using json = nlohmann::json;

constexpr int64_t kRunPid = RunTrace::kRunPid;
constexpr int kLoopTid = 0, kWriterTid = 1;

json slice(const std::string& name, int tid, double begin_us, double end_us) {
  return {{"ph", "X"},  {"name", name},   {"pid", kRunPid},
          {"tid", tid}, {"ts", begin_us}, {"dur", std::max(0.0, end_us - begin_us)}};
}

json thread_name(int tid, const char* name) {
  return {{"ph", "M"},
          {"name", "thread_name"},
          {"pid", kRunPid},
          {"tid", tid},
          {"args", {{"name", name}}}};
}

}  // namespace

double RunTrace::us(Clock::time_point t) const {
  return std::chrono::duration<double, std::micro>(t - start_).count();
}

void RunTrace::add_step(int64_t step, Clock::time_point begin, Clock::time_point end,
                        double pipeline_seconds) {
  // One at a time, so that the trace holds the last kMaxSteps steps, not as few as half.
  if (steps_.size() == kMaxSteps) {
    steps_.pop_front();
    ++dropped_;
  }
  const double begin_us = us(begin), end_us = us(end);
  steps_.push_back({step, begin_us, end_us, std::max(begin_us, end_us - pipeline_seconds * 1e6)});
}

void RunTrace::add_evaluation(int64_t after_step, Clock::time_point begin, Clock::time_point end) {
  // Those of steps dropped from the front go with them (there is at most one a step).
  if (!steps_.empty())
    evaluations_.erase(evaluations_.begin(),
                       std::find_if(evaluations_.begin(), evaluations_.end(),
                                    [&](const Step& e) { return e.step >= steps_.front().step; }));
  evaluations_.push_back({after_step, us(begin), us(end)});
}

std::string RunTrace::to_json(const std::string& last_step_trace,
                              const std::string& simulated_step_trace, double first_action_us,
                              const std::vector<SaveTiming>& saves) const {
  json events = json::array();
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
    events.push_back(slice("step " + std::to_string(s.step), kLoopTid, s.begin_us, s.end_us));
  for (const Step& e : evaluations_)
    events.push_back(
        slice("evaluation after step " + std::to_string(e.step), kLoopTid, e.begin_us, e.end_us));
  for (const SaveTiming& save : saves) {
    const std::string name =
        "step_" + std::to_string(save.step) + (save.committed ? "" : " (failed)");
    events.push_back(slice((save.async ? "snapshot " : "save ") + name, kLoopTid,
                           us(save.hold_begin), us(save.hold_end)));
    events.push_back(slice("write " + name, save.async ? kWriterTid : kLoopTid,
                           us(save.write_begin), us(save.write_end)));
  }
  json doc = {{"displayTimeUnit", "ms"},
              {"otherData", {{"steps_dropped_from_the_front", dropped_}}}};
  // The last step's ranks, measured and simulated, each moved from its first action to where
  // that action ran on the run's clock: after the batch was drawn and the pipeline started,
  // not at the step's begin.
  auto place_last_step = [&](const std::string& trace, const char* key) {
    if (trace.empty() || steps_.empty()) return;
    const double origin =
        std::min(steps_.back().pipeline_begin_us + first_action_us, steps_.back().end_us);
    json last = json::parse(trace);
    for (auto& ev : last["traceEvents"]) {
      if (ev.contains("ts")) ev["ts"] = ev["ts"].get<double>() + origin;
      events.push_back(std::move(ev));
    }
    doc["otherData"][key] = last["otherData"];
  };
  place_last_step(last_step_trace, "last_step");
  place_last_step(simulated_step_trace, "simulated_last_step");
  doc["traceEvents"] = std::move(events);
  return doc.dump(1) + "\n";
}

}  // namespace conveyor

#include "engine/schedule/chrome_trace.h"

#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <tuple>

namespace conveyor::schedule {

std::string chrome_trace_json(const Schedule& schedule, const SimResult& sim, double us_per_unit) {
  return chrome_trace_json(schedule, std::vector<SimResult>{sim}, us_per_unit);
}

std::string chrome_trace_json(const Schedule& schedule, const std::vector<SimResult>& replicas,
                              double us_per_unit) {
  using nlohmann::json;
  if (replicas.empty()) throw std::invalid_argument("a trace needs at least one timeline");
  json events = json::array();
  constexpr int kCompute = 0, kSend = 1, kRecv = 2, kReduce = 3;
  const char* thread_names[] = {"compute", "send", "recv", "allreduce"};
  // The reduction stream is a thread of its own, named only where the schedule has one.
  const int threads = schedule.replicas > 1 ? 4 : 3;
  const int R = static_cast<int>(schedule.ranks.size());
  const int D = static_cast<int>(replicas.size());
  for (int d = 0; d < D; ++d)
    for (int r = 0; r < R; ++r) {
      const int pid = d * R + r;
      const std::string name = D > 1 ? "rank " + std::to_string(pid) + " (replica " +
                                           std::to_string(d) + ", pipeline rank " +
                                           std::to_string(r) + ")"
                                     : "rank " + std::to_string(r);
      events.push_back(
          {{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"args", {{"name", name}}}});
      events.push_back({{"ph", "M"},
                        {"name", "process_sort_index"},
                        {"pid", pid},
                        {"args", {{"sort_index", pid}}}});
      if (D > 1)
        events.push_back({{"ph", "M"},
                          {"name", "process_labels"},
                          {"pid", pid},
                          {"args", {{"labels", "replica " + std::to_string(d)}}}});
      for (int t = 0; t < threads; ++t)
        events.push_back({{"ph", "M"},
                          {"name", "thread_name"},
                          {"pid", pid},
                          {"tid", t},
                          {"args", {{"name", thread_names[t]}}}});
    }
  // Flow ids: one per message (replica, gradient?, producing stage, micro-batch).
  std::map<std::pair<int, MessageKey>, int> flow_id;
  auto message_id = [&](int d, const Action& a) {
    return flow_id.try_emplace({d, message_key(a)}, static_cast<int>(flow_id.size()) + 1)
        .first->second;
  };
  for (int d = 0; d < D; ++d)
    for (int r = 0; r < R; ++r)
      for (size_t i = 0; i < schedule.ranks[r].size(); ++i) {
        const int pid = d * R + r;
        const Action& a = schedule.ranks[r][i];
        const auto& t = replicas[d].timing[r][i];
        const int tid = is_compute(a.kind)  ? kCompute
                        : is_reduce(a.kind) ? kReduce
                        : is_send(a.kind)   ? kSend
                                            : kRecv;
        const double ts = t.start * us_per_unit, dur = (t.end - t.start) * us_per_unit;
        json ev = {{"ph", "X"},
                   {"name", to_string(a)},
                   {"cat", kind_name(a.kind)},
                   {"pid", pid},
                   {"tid", tid},
                   {"ts", ts},
                   {"dur", dur},
                   {"args", {{"stage", a.stage}, {"microbatch", a.microbatch}, {"position", i}}}};
        if (is_reduce(a.kind)) ev["args"].erase("microbatch");
        if (is_transfer(a.kind)) ev["args"]["peer"] = d * R + a.peer;
        events.push_back(ev);
        if (is_transfer(a.kind)) {
          const bool grad = a.kind == ActionKind::kSendGrad || a.kind == ActionKind::kRecvGrad;
          json flow = {{"ph", is_send(a.kind) ? "s" : "f"},
                       {"name", grad ? "grad" : "act"},
                       {"cat", "transfer"},
                       {"id", message_id(d, a)},
                       {"pid", pid},
                       {"tid", tid},
                       {"ts", ts}};
          if (!is_send(a.kind)) flow["bp"] = "e";
          events.push_back(flow);
        }
      }
  json doc = {{"traceEvents", events},
              {"displayTimeUnit", "ms"},
              {"otherData",
               {{"schedule", schedule.name},
                {"makespan", replicas[0].makespan},
                {"bubble", replicas[0].bubble_fraction}}}};
  return doc.dump(1) + "\n";
}

}  // namespace conveyor::schedule

#pragma once
// Chrome trace-event JSON of a simulated schedule (opens in Perfetto or chrome://tracing):
// one process per rank with a compute, a send and a receive thread (and an all-reduce thread
// with replicas, one more for each further all-reduce in flight at once, as viewers drop
// slices that overlap on one thread), and a flow arrow from every send to its receive.
//
// The document is written as it is made, one event a line, so a trace of millions of actions
// takes no more memory than a piece of it: write_chrome_trace hands the text to a sink in
// pieces of about kTracePieceBytes.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"

namespace conveyor::schedule {

// Receives the document's text piece by piece, in order; what it throws ends the writing.
using TraceSink = std::function<void(std::string_view piece)>;
// The size a piece grows to before it is handed on (it ends with a whole event).
inline constexpr size_t kTracePieceBytes = size_t{1} << 20;

// How a document numbers and names its processes and flows. A timeline drawn beside another in
// one viewer (train --trace's simulated step under its measured one) takes pids, and so sort
// indices, and flow ids past the other's, so that no process or arrow of one joins the other's,
// and names that tell the two apart.
struct TraceProcesses {
  int64_t first_pid = 0;      // replica d's rank r is process first_pid + d * P + r
  int64_t first_flow_id = 0;  // flow ids run from first_flow_id + 1 (see trace_flow_ids)
  std::string name_prefix;    // put before each process's name, "rank r ..."
};

// How many flow ids a document of `replicas` timelines of `schedule` numbers from
// TraceProcesses::first_flow_id + 1: one per message, whether or not the schedule sends it.
int64_t trace_flow_ids(const Schedule& schedule, int replicas);

// us_per_unit: microseconds drawn for one simulator time unit. The schedule must be one the
// simulator accepts (every transfer's stage and micro-batch inside the schedule); throws
// std::invalid_argument otherwise.
void write_chrome_trace(const Schedule& schedule, const SimResult& sim, double us_per_unit,
                        const TraceSink& sink, const TraceProcesses& processes = {});

// The timelines of several replicas of the schedule on one clock (a measured step of every
// replica: summarize_replicas), replica d's pipeline rank r as process d * P + r, named by
// its replica and pipeline rank, so that each replica's ranks read as a group. The document's
// makespan and bubble are replica 0's.
void write_chrome_trace(const Schedule& schedule, const std::vector<SimResult>& replicas,
                        double us_per_unit, const TraceSink& sink,
                        const TraceProcesses& processes = {});

// The whole document as one string (small schedules, and tests).
std::string chrome_trace_json(const Schedule& schedule, const SimResult& sim,
                              double us_per_unit = 1000.0, const TraceProcesses& processes = {});
std::string chrome_trace_json(const Schedule& schedule, const std::vector<SimResult>& replicas,
                              double us_per_unit = 1000.0, const TraceProcesses& processes = {});

}  // namespace conveyor::schedule

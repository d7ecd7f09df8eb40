#pragma once
// Chrome trace-event JSON of a simulated schedule (opens in Perfetto or chrome://tracing):
// one process per rank with a compute, a send and a receive thread (and an all-reduce thread
// with replicas), and a flow arrow from every send to its receive.
#include <string>
#include <vector>

#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"

namespace conveyor::schedule {

// us_per_unit: microseconds drawn for one simulator time unit.
std::string chrome_trace_json(const Schedule& schedule, const SimResult& sim,
                              double us_per_unit = 1000.0);

// The timelines of several replicas of the schedule on one clock (a measured step of every
// replica: summarize_replicas), replica d's pipeline rank r as process d * P + r, named by
// its replica and pipeline rank, so that each replica's ranks read as a group. The document's
// makespan and bubble are replica 0's.
std::string chrome_trace_json(const Schedule& schedule, const std::vector<SimResult>& replicas,
                              double us_per_unit = 1000.0);

}  // namespace conveyor::schedule

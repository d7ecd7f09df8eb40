#pragma once
// Chrome trace-event JSON of a simulated schedule (opens in Perfetto or chrome://tracing):
// one process per rank with a compute, a send and a receive thread, and a flow arrow from
// every send to its receive.
#include <string>

#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"

namespace conveyor::schedule {

// us_per_unit: microseconds drawn for one simulator time unit.
std::string chrome_trace_json(const Schedule& schedule, const SimResult& sim,
                              double us_per_unit = 1000.0);

}  // namespace conveyor::schedule

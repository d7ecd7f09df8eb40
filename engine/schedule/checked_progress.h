#pragma once
// For validate() alone, not part of the library's interface: check_progress (simulator.h)
// without its range pass, for a schedule that has passed validate()'s structural checks
// (every stage, micro-batch and peer exists; all-reduces only with replicas > 1). Any other
// schedule may make it read out of range.
#include "engine/schedule/schedule.h"

namespace conveyor::schedule::detail {

void check_progress_of_checked(const Schedule& schedule);

}  // namespace conveyor::schedule::detail

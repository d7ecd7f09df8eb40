#pragma once
// A partition as the plan table writes it, "[0,3) [3,4)": shared by the table (plan_format.cpp;
// format_plan itself is declared in planner.h, the public API) and the planner's errors
// (planner.cpp), so the two print a partition the same way. Internal to the planner.
#include <string>
#include <vector>

#include "engine/pipeline/partition.h"

namespace conveyor::planning {

std::string ranges_text(const std::vector<StageRange>& ranges);

}  // namespace conveyor::planning

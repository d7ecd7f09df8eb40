#pragma once
// Which pipelines the measurements do not tell apart from the fastest, and which of them the
// plan chooses (Plan, PlanCandidate::tied). Internal to the planner.
#include <cstdint>
#include <vector>

#include "engine/pipeline/layout_search.h"
#include "engine/pipeline/planner.h"

namespace conveyor::planning {

// Differences of step times within this many standard errors are ties: at two, a difference
// that is noise alone is called one 19 times in 20, so the same pipeline is chosen again.
inline constexpr double kTieErrors = 2;

// How far `layout`'s step time with `ranges` (`step`) moves when the times of one group of
// `units` (UnitCost::group; a unit of group -1 on its own) are off by their relative error,
// for each group with an error: PlanCandidate::step_errors.
std::vector<StepError> step_errors(const LayoutSearch& layout, const std::vector<UnitCost>& units,
                                   const std::vector<StageRange>& ranges, double step);

// A layout's partition with its step time and step_errors.
struct TimedPartition {
  std::vector<StageRange> ranges;
  std::vector<double> peak_bytes;  // per rank
  double step = 0;
  std::vector<StepError> errors;
};

// The partition chosen for a layout: of its fastest (`fastest`) and the partitions one cut
// away from it (a cut moved by one unit) that fit and whose step times the measurements do
// not tell apart from the fastest's (within kTieErrors standard errors of the difference),
// the one with the least peak memory on its fullest rank, then over all ranks, then the
// earlier cuts. Where equal units leave the fastest partition to the noise between two cuts,
// both are seen from either, and one is chosen.
TimedPartition partition_among_tied(const LayoutSearch& layout, const std::vector<UnitCost>& units,
                                    TimedPartition fastest);

// The standard error of a.step_seconds - b.step_seconds: from one table, both move with its
// groups together (each group counts the larger of its moves up and down); from two,
// independently.
double difference_error(const PlanCandidate& a, const PlanCandidate& b);

// Marks the pipelines tied with `fastest` (PlanCandidate::tied) and returns the one of them
// the plan chooses (Plan::fastest_pipeline_seconds says how); end() when none is tied.
std::vector<PlanCandidate>::iterator choose_among_tied(std::vector<PlanCandidate>& candidates,
                                                       const PlanCandidate& fastest);

}  // namespace conveyor::planning

#pragma once
// A measured run in the simulator's terms: the timeline an executor recorded (one timing per
// action, parallel to Schedule::ranks) turned into a cost model, so that the run can be
// compared with its prediction, and into the busy / idle / bubble figures of a SimResult.
#include <vector>

#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"

namespace conveyor::schedule {

// Mean measured duration of each compute kind per stage (F, and B or I and W as the schedule
// has them), of each message (from when both its send and its receive had started to when
// both had ended, so not a receive's wait for its sender) as the latency, and of the gradient
// all-reduces as reduce_latency. Throws std::invalid_argument when `timing`
// does not hold one entry per action of `schedule`.
CostModel measured_costs(const Schedule& schedule,
                         const std::vector<std::vector<ActionTiming>>& timing);

// Busy time (compute actions), idle time and bubble fraction per rank of a measured
// timeline, with the timeline shifted to start at 0. Same precondition as measured_costs.
SimResult summarize_timing(const Schedule& schedule, std::vector<std::vector<ActionTiming>> timing);

// A measured step of every replica (`world`: replica d's pipeline rank r at d * P + r, as the
// executor numbers its ranks) cut into replica `replica`'s timeline, parallel to
// Schedule::ranks, for the functions above (whose figures are those of one replica).
std::vector<std::vector<ActionTiming>> replica_timeline(
    const Schedule& schedule, const std::vector<std::vector<ActionTiming>>& world, int replica);

// summarize_timing of each replica of `world` (as for replica_timeline), all on one clock:
// the earliest start of any rank of any replica at 0, so that the replicas line up when drawn
// together (chrome_trace_json of several replicas).
std::vector<SimResult> summarize_replicas(const Schedule& schedule,
                                          const std::vector<std::vector<ActionTiming>>& world);

// Puts the ranks of `world` (every replica's, as for replica_timeline) on one clock when each
// was measured on a clock of its own: one process per rank, each counting from its own start
// of the step, which the processes reach some microseconds apart. The transfers themselves
// say how far apart at least: a receive cannot end before its send began, nor an all-reduce
// end on one replica before it began on another. Each rank's timeline is moved later by the
// least amount that makes every such pair hold (a rank that no pair contradicts stays where
// it is), and the shifts are returned, in the timeline's unit. Pairs that contradict each
// other around a cycle, which timelines on offset clocks cannot give, leave `world` as it
// was and return no shifts. Same precondition as replica_timeline.
std::vector<double> align_to_transfers(const Schedule& schedule,
                                       std::vector<std::vector<ActionTiming>>& world);

// How much of the gradient all-reduces (AR actions) a timeline hides behind compute: the
// time of all-reduce (in the timeline's unit), summed over the actions, and the part of them during
// which some rank of the timeline was computing (the union of all ranks' compute intervals, so a
// moment with two ranks busy counts once). For a measured step and for its simulation alike; both
// zero without all-reduces.
struct ReductionOverlap {
  double reduce_time = 0;
  double hidden_time = 0;
  double hidden_fraction() const { return reduce_time > 0 ? hidden_time / reduce_time : 0; }
};
ReductionOverlap reduction_overlap(const Schedule& schedule, const SimResult& result);

}  // namespace conveyor::schedule

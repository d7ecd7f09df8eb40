#pragma once
// What a pipeline run needs on each rank before anything is allocated, so a run that cannot
// fit is refused in a moment instead of failing (or swapping) after minutes of set-up. A
// planner uses the same figures to choose partitions under a memory cap.
#include <cstdint>
#include <string>
#include <vector>

#include "engine/pipeline/partition.h"
#include "engine/schedule/schedule.h"
#include "layers/model.h"

namespace conveyor {

struct RankMemoryEstimate {
  double parameter_bytes = 0;   // f32 weights of the rank's units
  double gradient_bytes = 0;    // one f32 gradient per weight
  double optimizer_bytes = 0;   // AdamW: two moments per weight; SGD: one buffer
  double activation_bytes = 0;  // peak in-flight micro-batches x activations kept per one
  double total() const {
    return parameter_bytes + gradient_bytes + optimizer_bytes + activation_bytes;
  }
};

// Per rank of `schedule`: its stages' parameters, gradients and `optimizer_kind` state, and
// the schedule's peak in-flight micro-batches (schedule::in_flight_per_rank) times the
// activations one micro-batch of `microbatch_tokens` keeps on each stage, counted as the
// activation entering each of the stage's units (the model description's shapes). The
// activation figure is a lower bound: units keep their inner activations too.
std::vector<RankMemoryEstimate> estimate_rank_memory(const ModelDescription& model,
                                                     const std::vector<StageRange>& ranges,
                                                     const schedule::Schedule& schedule,
                                                     const std::string& optimizer_kind,
                                                     int64_t microbatch_tokens);

// Bytes the CPU can still give: MemAvailable of /proc/meminfo, 0 when unknown.
double cpu_available_bytes();

}  // namespace conveyor

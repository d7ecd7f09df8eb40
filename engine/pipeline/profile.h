#pragma once
// Measuring a model's per-unit costs on the device it will train on: forward, input-gradient
// and weight-gradient time of every unit (the first unit and the loss head included), the
// bytes its forward keeps for the backward (and its input gradient for the weight gradient),
// its input and its workspace, the bytes of its parameters, gradients and
// optimizer state, and the time of one boundary activation on the in-process transport.
// What the planner takes.
#include <cstdint>

#include "engine/core/device_context.h"
#include "engine/pipeline/planner.h"
#include "layers/model.h"

namespace conveyor {

struct ProfileOptions {
  int64_t microbatch_tokens = 256;
  int warmup = 2;           // runs per unit before timing (caches, allocator, GEMM plans)
  int repetitions = 5;      // timed runs per unit; the median is kept
  int optimizer_slots = 2;  // optimizer tensors per parameter (AdamW: 2, SGD: 0)
  uint64_t seed = 1;
  // Other ranks that will share this device's host during training (CPU ranks of one
  // machine share its cores, caches and memory bandwidth, and each runs while the others
  // do). That many copies of the profile run alongside on threads of their own, each on a
  // context built with `neighbour_context`, until this profile is done; only this one's
  // times are kept. Units timed alone ran 10-25 % faster than the same units in a two-rank
  // run on a two-core machine.
  int neighbours = 0;
  DeviceContextOptions neighbour_context;
};

// Each unit is built alone on `ctx` and run on seeded random inputs (fresh copies, so what a
// unit keeps of its input or output gradient counts). Times are medians in seconds; bytes
// come from the allocator's counters, whose peak this resets. Throws std::invalid_argument for
// options that cannot be measured.
UnitCosts profile_units(const ModelDescription& model, DeviceContext& ctx,
                        const ProfileOptions& options = {});

}  // namespace conveyor

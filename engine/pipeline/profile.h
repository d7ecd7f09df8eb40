#pragma once
// Measuring a model's per-unit costs on the device it will train on: forward, input-gradient
// and weight-gradient time of every unit (the first unit and the loss head included), the
// bytes its forward keeps for the backward (and its input gradient for the weight gradient),
// its input and its workspace, the bytes of its parameters, gradients and
// optimizer state, and the time of one boundary activation on the in-process transport; the
// cost of the data-parallel gradient sum on a transport; the memory of a device. What the
// planner takes.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/transport.h"
#include "engine/core/device_context.h"
#include "engine/pipeline/planner.h"
#include "layers/model.h"

namespace conveyor {

struct ProfileOptions {
  int64_t microbatch_tokens = 256;
  int warmup = 2;  // runs per group of units before timing (caches, allocator, GEMM plans)
  // Timed runs per unit (a group of fewer than three identical units takes as many as three
  // would); the lower quartile of its group's runs is kept.
  int repetitions = 5;
  int optimizer_slots = 2;  // optimizer tensors per parameter (AdamW: 2, SGD: 1)
  uint64_t seed = 1;
  // Other ranks that will share this device's host during training (CPU ranks of one
  // machine share its cores, caches and memory bandwidth, and each runs while the others
  // do). That many copies of the profile run alongside on threads of their own, each on a
  // context built with `neighbour_context`, until this profile is done; only this one's
  // times are kept. Units timed alone ran 10-25 % faster than the same units in a two-rank
  // run on a two-core machine.
  int neighbours = 0;
  DeviceContextOptions neighbour_context;
  // Units identical to an earlier one (identical_units.h) are timed as one group, with the
  // runs of all its members, and given the group's cost. False: every unit on its own.
  bool pool_identical_units = true;
};

// The first unit of each group of identical units is built on `ctx` (all groups' together)
// and run on seeded random inputs (fresh copies, so what a unit keeps of its input or output
// gradient counts): the warm-ups, then the timed runs of every group interleaved
// (interleaved_runs), so that the machine's slow moments fall on every group alike. Times
// are lower quartiles in seconds of the group's runs (summarize_samples), the same for each
// of its units, with the relative standard error of the quartile of their sum F + I + W
// (UnitCost::time_error, the group named by UnitCost::group); bytes come from the allocator's
// counters, whose peak this resets. Throws std::invalid_argument for options that cannot be
// measured.
UnitCosts profile_units(const ModelDescription& model, DeviceContext& ctx,
                        const ProfileOptions& options = {});
// The same at each of `sizes` tokens per micro-batch (options.microbatch_tokens aside), in one
// profile: each group's unit built once, with inputs of every size, and the runs of every
// group at every size interleaved, so that a busy minute of the machine falls on every size's
// table alike, not on the one measured then (the planner compares layouts across them). One
// table per size, in order.
std::vector<UnitCosts> profile_units(const ModelDescription& model, DeviceContext& ctx,
                                     const std::vector<int64_t>& sizes,
                                     const ProfileOptions& options = {});

// The data-parallel gradient sum as the planner models it: 2(p-1) steps of `latency` seconds
// plus 1/p of the bytes at `bandwidth` bytes per second (PlanOptions::allreduce_*).
struct AllReduceCost {
  double latency = 0;
  double bandwidth = 0;
  size_t small_bytes = 0, large_bytes = 0;      // the sizes timed ...
  double small_seconds = 0, large_seconds = 0;  // ... and their medians
};

// Times Transport::start_group_sum over every rank of `transports` (one thread per rank, each
// starting and waiting as a rank's step does) at 4 KiB and at `bytes` of floats, medians of
// `repetitions` after `warmup`, and fits latency and bandwidth to the two: the planner then
// predicts both times exactly. Throws std::invalid_argument for fewer than two transports.
AllReduceCost measure_allreduce(std::vector<std::unique_ptr<comm::Transport>>& transports,
                                size_t bytes, int warmup = 2, int repetitions = 5);

}  // namespace conveyor

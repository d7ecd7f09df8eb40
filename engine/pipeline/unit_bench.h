#pragma once
// The units profile_units times (profile.h): each group of identical units (identical_units.h)
// built once, with seeded inputs for every micro-batch size profiled, run a forward, input
// gradient and weight gradient at a time. Internal to the profile.
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/core/device_context.h"
#include "engine/pipeline/planner.h"
#include "engine/pipeline/profile.h"
#include "engine/pipeline/stage.h"
#include "layers/model.h"

namespace conveyor::profiling {

// Seeded values in [-1, 1) of `spec` (f32 only: std::invalid_argument otherwise).
Tensor random_tensor(DeviceContext& ctx, const ActivationSpec& spec, uint64_t seed);

// The groups of identical units at every size of `sizes` (units identical at one size and not
// at another are apart): each group's first unit stands for it, and takes `repetitions` timed
// runs per size for each of its members, and for at least kLeastRuns members: a unit without
// a twin would have five runs by default, and the spread around their lower quartile
// (summarize_samples) then comes of two of them.
struct UnitGroups {
  static constexpr int kLeastRuns = 3;
  std::vector<int64_t> leader_of;  // per unit
  std::vector<int64_t> leaders;    // per group
  std::vector<int> timed_runs;     // per group, at each size

  UnitGroups(const ModelDescription& model, const ProfileOptions& options,
             const std::vector<int64_t>& sizes);
  size_t group_of(int64_t u) const;
};

// One unit built on `ctx`, with seeded inputs for each of `sizes` (tokens per micro-batch);
// what it holds at a size is counted into its cost at that size at every run.
class UnitBench {
 public:
  UnitBench(const ModelDescription& model, int64_t u, DeviceContext& ctx,
            const ProfileOptions& options, const std::vector<int64_t>& sizes);

  struct Times {
    double forward = 0, input_grad = 0, weight_grad = 0;
  };
  // One run at sizes[size] as micro-batch `microbatch`, on fresh copies of the inputs.
  Times run(size_t size, int64_t microbatch);
  // The bytes counted so far at sizes[size], and no times.
  const UnitCost& cost(size_t size) const { return at_[size].cost; }

 private:
  struct AtSize {
    MicroBatchInputs in;
    Tensor input, dy;
    UnitCost cost;
  };
  DeviceContext& ctx_;
  const size_t before_build_;
  Stage stage_;
  const bool first_, last_;
  std::vector<AtSize> at_;
};

// Every group's first unit built on `ctx` (together: the runs alternate between them), in
// `groups` order.
std::vector<std::unique_ptr<UnitBench>> build_benches(const ModelDescription& model,
                                                      const UnitGroups& groups, DeviceContext& ctx,
                                                      const ProfileOptions& options,
                                                      const std::vector<int64_t>& sizes);

}  // namespace conveyor::profiling

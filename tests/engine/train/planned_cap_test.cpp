// The memory cap proved in a real run: plans made under caps that bind (the fastest layout
// without a cap needs more) run with every rank's allocator peak within the cap, the tightest
// only by recomputing activations.
#include <gtest/gtest.h>

#include <algorithm>

#include "engine/pipeline/planner.h"
#include "engine/pipeline/profile.h"
#include "engine/train/trainer.h"

namespace conveyor {
namespace {

double largest(const std::vector<double>& bytes) {
  return *std::max_element(bytes.begin(), bytes.end());
}

TEST(PlannedCap, EveryRankStaysWithinTheCapThePlanWasMadeFor) {
  TrainConfig config;
  config.model = model_preset("tiny");
  config.model.d_model = 32;
  config.model.hidden = 128;
  config.model.vocab = 64;
  config.model.n_layers = 6;
  config.steps = 2;
  config.batch_tokens = 1024;
  config.stages = 2;
  config.device = Device::cpu();
  const ModelDescription model = reference_model(config.model);

  // Profiled as `conveyor plan` does: on the device, at every candidate micro-batch size.
  DeviceContext ctx(Device::cpu());
  PlanOptions options;
  options.num_ranks = config.stages;
  options.batch_tokens = config.batch_tokens;
  options.include_data_parallel = false;
  std::vector<UnitCosts> measured;
  for (int m : {2, 4, 8, 16}) {
    options.microbatch_counts.push_back(m);
    ProfileOptions profile;
    profile.microbatch_tokens = config.batch_tokens / m;
    profile.warmup = 0;
    profile.repetitions = 1;
    measured.push_back(profile_units(model, ctx, profile));
  }
  const double unconstrained = largest(plan(measured, options).best().peak_bytes);

  // The smallest cap at which some layout fits keeping its activations, and recomputing them
  // (bisected to a thousandth).
  auto least_cap = [&](PlanOptions o) {
    double lo = 0, hi = 2 * unconstrained;
    while (hi - lo > 1e-3 * hi) {
      o.memory_cap = 0.5 * (lo + hi);
      bool fits = false;
      for (const auto& c : plan(measured, o).candidates) fits = fits || c.rejected.empty();
      (fits ? hi : lo) = o.memory_cap;
    }
    return hi;
  };
  options.recompute_when_short = false;
  const double plain_least = least_cap(options);
  options.recompute = RecomputeSpec::every_unit();
  const double recomputed_least = least_cap(options);
  options.recompute = RecomputeSpec::none();
  options.recompute_when_short = true;
  ASSERT_LT(recomputed_least, 0.95 * plain_least);

  int recomputing_runs = 0;
  for (const double cap : {0.8 * unconstrained, 0.5 * (plain_least + recomputed_least)}) {
    SCOPED_TRACE("cap " + std::to_string(cap) + " bytes");
    options.memory_cap = cap;
    const Plan capped = plan(measured, options);
    const PlanCandidate& best = capped.best();
    ASSERT_TRUE(best.pipelined);
    EXPECT_GT(unconstrained, cap);  // the cap binds: the fastest layout does not fit it
    EXPECT_LE(largest(best.peak_bytes), cap);
    // Below what any layout keeping its activations needs, only recomputation fits.
    if (cap < plain_least) EXPECT_TRUE(best.recompute.any()) << best.layout;
    if (best.recompute.any()) ++recomputing_runs;

    TrainConfig run = config;
    run.schedule = best.kind;
    run.chunks = best.chunks;
    run.microbatches = best.microbatches;
    run.partition = PartitionSpec::explicit_blocks(blocks_of(best.ranges));
    run.recompute = best.recompute;
    // No allocator limit: both CPU ranks share one device, whose limit the trainer would
    // split between them, while the plan gives each rank a device of `cap` bytes.
    Trainer trainer(model, run);
    for (int step = 1; step <= run.steps; ++step) {
      const StepStats stats = trainer.step();
      ASSERT_EQ(stats.pipeline.peak_allocated_bytes.size(), 2u);
      for (int r = 0; r < 2; ++r)
        EXPECT_LE(static_cast<double>(stats.pipeline.peak_allocated_bytes[r]), cap)
            << best.layout << " m=" << best.microbatches << " rank " << r << " step " << step;
    }
  }
  EXPECT_GE(recomputing_runs, 1);
}

}  // namespace
}  // namespace conveyor

// The memory cap proved in a real run: plans made under caps that bind (the fastest layout
// without a cap needs more) run with every rank's allocator peak within the cap, the tightest
// only by recomputing activations; and ranks that share a device are held to its cap together.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>

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

// A unit of a user's own that keeps a scratch buffer its activation_memory leaves out (it says
// what the unit it wraps keeps): the check before the run cannot see the buffer.
class UndeclaredScratch : public Layer {
 public:
  UndeclaredScratch(std::unique_ptr<Layer> inner, int64_t floats)
      : inner_(std::move(inner)), floats_(floats) {}
  const std::string& name() const override { return inner_->name(); }
  std::vector<Parameter*> parameters() override { return inner_->parameters(); }
  Tensor forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs& in,
                 SavedTensors& saved) override {
    if (!scratch_.defined()) scratch_ = ctx.empty({floats_});
    return inner_->forward(ctx, x, in, saved);
  }
  Tensor backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) override {
    return inner_->backward_input(ctx, dy, saved);
  }
  void backward_weight(DeviceContext& ctx, SavedTensors& saved) override {
    inner_->backward_weight(ctx, saved);
  }
  std::optional<ActivationMemory> activation_memory(const Shape& input) const override {
    return inner_->activation_memory(input);
  }
  std::optional<int64_t> accepted_ids() const override { return inner_->accepted_ids(); }

 private:
  std::unique_ptr<Layer> inner_;
  int64_t floats_;
  Tensor scratch_;
};

// Two CPU ranks that each fit the cap alone, but not together: the check before the run adds
// up estimates that miss the scratch, so only the allocators, drawing from one cap, can stop
// the run, with the allocator's error naming the shared cap and what each rank holds.
TEST(PlannedCap, RanksSharingADeviceAreHeldToItsCapTogetherWhileTheyRun) {
  TrainConfig config;
  config.model = model_preset("tiny");
  config.model.d_model = 24;
  config.model.hidden = 56;
  config.model.vocab = 40;
  config.model.n_layers = 2;  // units: embedding, 2 blocks, head; a block on each rank
  config.steps = 1;
  config.batch_tokens = 64;
  config.microbatches = 2;
  config.stages = 2;
  config.device = Device::cpu();
  ModelDescription model = reference_model(config.model);
  const int64_t scratch_floats = int64_t{1} << 20;  // 4 MiB on each rank
  const auto make = model.make_unit;
  model.make_unit = [make, last = model.num_units - 1,
                     scratch_floats](int64_t unit) -> std::unique_ptr<Layer> {
    if (unit == 0 || unit == last) return make(unit);
    return std::make_unique<UndeclaredScratch>(make(unit), scratch_floats);
  };

  // The most either rank reserves alone, without a cap.
  size_t alone = 0;
  {
    Trainer uncapped(model, config);
    uncapped.step();
    for (int r = 0; r < 2; ++r)
      alone =
          std::max(alone, uncapped.executor().context(r).allocator().stats().peak_reserved_bytes);
  }
  config.memory_limit_bytes = alone + (size_t{1} << 20);
  ASSERT_LT(config.memory_limit_bytes, size_t{2} * scratch_floats * 4)
      << "the two scratch buffers alone must pass the cap";
  std::unique_ptr<Trainer> trainer;
  ASSERT_NO_THROW(trainer = std::make_unique<Trainer>(model, config))
      << "the check before the run must let it through, or it shows nothing here";
  try {
    trainer->step();
    FAIL() << "both ranks ran, each reserving up to " << alone << " bytes, under a cap of "
           << config.memory_limit_bytes << " bytes they share";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("out of memory on cpu"), std::string::npos) << what;
    EXPECT_NE(what.find("the memory limit would be exceeded; the limit of "), std::string::npos)
        << what;
    EXPECT_NE(what.find("is shared by the 2 allocators of cpu in this process"), std::string::npos)
        << what;
    EXPECT_NE(what.find("rank 0 "), std::string::npos) << what;
    EXPECT_NE(what.find("rank 1 "), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace conveyor

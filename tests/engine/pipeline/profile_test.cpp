// Profiling on the CPU: every unit of a model is timed and its bytes counted; the bytes agree
// with the parameter counts and with what the allocator holds after a forward; the result
// plans a pipeline.
#include "engine/pipeline/profile.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "support/unit_cost_bytes.h"

namespace conveyor {
namespace {

using testing::expect_same_bytes;

ModelConfig head_heavy_config() {
  ModelConfig c;
  c.preset = "test";
  c.d_model = 16;
  c.n_layers = 3;
  c.vocab = 512;
  c.hidden = 64;
  return c;
}

// 64 tokens per micro-batch, one warm-up and `repetitions` timed runs.
ProfileOptions quick_options(int repetitions) {
  ProfileOptions options;
  options.microbatch_tokens = 64;
  options.repetitions = repetitions;
  options.warmup = 1;
  return options;
}

TEST(Profile, EveryUnitIsTimedAndItsBytesCounted) {
  const ModelDescription model = reference_model(head_heavy_config());
  DeviceContext ctx(Device::cpu());
  const ProfileOptions options = quick_options(3);
  const UnitCosts costs = profile_units(model, ctx, options);
  ASSERT_EQ(costs.units.size(), static_cast<size_t>(model.num_units));
  EXPECT_EQ(costs.microbatch_tokens, 64);
  const auto counts = model.unit_parameter_counts();
  for (size_t u = 0; u < costs.units.size(); ++u) {
    SCOPED_TRACE("unit " + std::to_string(u));
    const UnitCost& c = costs.units[u];
    EXPECT_GT(c.forward, 0.0);
    EXPECT_GT(c.backward_weight, 0.0);
    EXPECT_DOUBLE_EQ(c.parameter_bytes, 4.0 * counts[u]);
    // Value and gradient from the allocator plus two AdamW moments, each a tensor of the
    // parameter's shape rounded up as the allocator gives it.
    const std::unique_ptr<Layer> unit = model.unit(static_cast<int64_t>(u));
    double allocated = 0;
    for (Parameter* p : unit->parameters()) allocated += allocated_bytes(p->shape);
    EXPECT_GE(allocated, c.parameter_bytes);
    EXPECT_EQ(c.state_bytes, 4.0 * allocated);
    EXPECT_EQ(c.optimizer_bytes, 2.0 * allocated);
    if (u > 0) EXPECT_GT(c.backward_input, 0.0);
  }
  // A block keeps at least its input rows (64 tokens x 16 floats) for the backward.
  const UnitCost& block = costs.units[1];
  EXPECT_GE(block.activation_bytes, 64.0 * 16 * 4);
  EXPECT_GT(costs.units.back().forward, 0.0);
  EXPECT_GT(costs.transfer_seconds, 0.0);
  EXPECT_LT(costs.transfer_seconds, 1.0);

  PlanOptions plan_options;
  plan_options.num_ranks = 2;
  plan_options.batch_tokens = 256;
  const Plan result = plan(costs, plan_options);
  EXPECT_NO_THROW(result.best());
}

// The blocks are timed as one group: every block gets the same cost and error, to the bit,
// and the same bytes as when each is measured on its own; the embedding and the head keep
// their own.
TEST(Profile, IdenticalUnitsShareOneCost) {
  ModelConfig config = head_heavy_config();
  config.n_layers = 4;
  const ModelDescription model = reference_model(config);
  DeviceContext ctx(Device::cpu());
  ProfileOptions options = quick_options(2);
  const UnitCosts pooled = profile_units(model, ctx, options);
  options.pool_identical_units = false;
  const UnitCosts apart = profile_units(model, ctx, options);
  ASSERT_EQ(pooled.units.size(), 6u);
  ASSERT_EQ(apart.units.size(), 6u);
  for (size_t u = 0; u < pooled.units.size(); ++u) {
    SCOPED_TRACE("unit " + std::to_string(u));
    const UnitCost& c = pooled.units[u];
    EXPECT_GT(c.forward, 0.0);
    if (u >= 2 && u <= 4) {
      const UnitCost& first = pooled.units[1];
      EXPECT_EQ(c.forward, first.forward);
      EXPECT_EQ(c.backward_input, first.backward_input);
      EXPECT_EQ(c.backward_weight, first.backward_weight);
      EXPECT_EQ(c.time_error, first.time_error);
    }
    // Each unit's group is its first unit's number, so the planner moves the blocks together;
    // timed apart, each unit is its own group.
    EXPECT_EQ(c.group, u >= 1 && u <= 4 ? 1 : static_cast<int64_t>(u));
    EXPECT_EQ(apart.units[u].group, static_cast<int64_t>(u));
    EXPECT_GE(c.time_error, 0.0);
    expect_same_bytes(c, apart.units[u]);
  }
}

// Several micro-batch sizes in one profile: a table per size, in order, each with the bytes a
// profile of that size alone counts, and every time measured.
TEST(Profile, EverySizeInOneProfileCountsWhatEachAloneDoes) {
  const ModelDescription model = reference_model(head_heavy_config());
  DeviceContext ctx(Device::cpu());
  const ProfileOptions options = quick_options(2);
  const std::vector<int64_t> sizes = {96, 32, 64};
  const std::vector<UnitCosts> tables = profile_units(model, ctx, sizes, options);
  ASSERT_EQ(tables.size(), sizes.size());
  for (size_t s = 0; s < sizes.size(); ++s) {
    SCOPED_TRACE("size " + std::to_string(sizes[s]));
    ProfileOptions alone_options = options;
    alone_options.microbatch_tokens = sizes[s];
    DeviceContext alone_ctx(Device::cpu());
    const UnitCosts alone = profile_units(model, alone_ctx, alone_options);
    EXPECT_EQ(tables[s].microbatch_tokens, sizes[s]);
    ASSERT_EQ(tables[s].units.size(), alone.units.size());
    EXPECT_GT(tables[s].transfer_seconds, 0.0);
    for (size_t u = 0; u < alone.units.size(); ++u) {
      SCOPED_TRACE("unit " + std::to_string(u));
      const UnitCost& c = tables[s].units[u];
      EXPECT_GT(c.forward, 0.0);
      EXPECT_GT(c.backward_weight, 0.0);
      EXPECT_EQ(c.group, alone.units[u].group);
      expect_same_bytes(c, alone.units[u]);
    }
  }
  EXPECT_THROW(profile_units(model, ctx, std::vector<int64_t>{}, options), std::invalid_argument);
  EXPECT_THROW(profile_units(model, ctx, std::vector<int64_t>{8, 0}, options),
               std::invalid_argument);
}

TEST(Profile, BadOptionsAreErrors) {
  const ModelDescription model = reference_model(head_heavy_config());
  DeviceContext ctx(Device::cpu());
  ProfileOptions options;
  options.microbatch_tokens = 0;
  EXPECT_THROW(profile_units(model, ctx, options), std::invalid_argument);
  options.microbatch_tokens = 8;
  options.repetitions = 0;
  EXPECT_THROW(profile_units(model, ctx, options), std::invalid_argument);
}

// Neighbours run the same profile alongside: the measured copy's bytes are what they are
// alone (only times may change), and every neighbour is stopped and joined on return.
TEST(Profile, NeighboursChangeNoByteCount) {
  const ModelDescription model = reference_model(head_heavy_config());
  DeviceContext ctx(Device::cpu());
  ProfileOptions options = quick_options(2);
  const UnitCosts alone = profile_units(model, ctx, options);
  options.neighbours = 2;
  DeviceContext crowded_ctx(Device::cpu());
  const UnitCosts crowded = profile_units(model, crowded_ctx, options);
  ASSERT_EQ(crowded.units.size(), alone.units.size());
  for (size_t u = 0; u < alone.units.size(); ++u) {
    SCOPED_TRACE("unit " + std::to_string(u));
    expect_same_bytes(crowded.units[u], alone.units[u]);
    EXPECT_GT(crowded.units[u].forward, 0.0);
  }
}

// A neighbour that fails (here: its context's memory cap cannot hold a unit) fails the
// profile with its own message instead of being lost on its thread.
TEST(Profile, ANeighboursFailureReachesTheCaller) {
  const ModelDescription model = reference_model(head_heavy_config());
  DeviceContext ctx(Device::cpu());
  ProfileOptions options = quick_options(2);
  options.neighbours = 1;
  options.neighbour_context.memory_limit_bytes = 1024;
  EXPECT_ANY_THROW(profile_units(model, ctx, options));
  options.neighbours = -1;
  options.neighbour_context = {};
  EXPECT_THROW(profile_units(model, ctx, options), std::invalid_argument);
}

}  // namespace
}  // namespace conveyor

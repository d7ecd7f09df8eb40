// What a model description says each unit keeps (Layer::activation_memory, through
// described_unit_costs) against what profile_units measures the unit holds on the CPU's
// caching allocator: equal to the byte, for every kind of layer and every model preset, at
// token counts whose tensors round up at both of the allocator's granularities (512 B below
// 1 MiB, 2 MiB above). The rule is the allocator's: each tensor is rounded up on its own.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/optimizer.h"
#include "engine/pipeline/profile.h"
#include "engine/pipeline/stage.h"
#include "layers/basic_layers.h"
#include "layers/blocks.h"
#include "support/unit_cost_bytes.h"

namespace conveyor {
namespace {

using testing::expect_same_bytes;

constexpr int64_t kVocab = 13;

// Every kind of layer as a unit of its own:
//   embed (width 8) -> linear (8 -> w) -> gelu -> layernorm (w) -> MLP block (w, 20) -> head (w)
ModelDescription every_layer_kind(int64_t width) {
  ModelDescription model;
  model.name = "every layer kind, width " + std::to_string(width);
  model.num_units = 6;
  model.vocab = kVocab;
  model.make_unit = [width](int64_t index) -> std::unique_ptr<Layer> {
    switch (index) {
      case 0:
        return std::make_unique<Embedding>("embed", kVocab, 8);
      case 1:
        return std::make_unique<Linear>("widen", 8, width);
      case 2:
        return std::make_unique<Activation>("act", ops::ActivationKind::kGelu);
      case 3:
        return std::make_unique<LayerNorm>("norm", width);
      case 4:
        return std::make_unique<MlpBlock>("block", width, 20, ops::ActivationKind::kRelu);
      default:
        return std::make_unique<LossHead>("head", width, kVocab);
    }
  };
  model.activation = [width](int64_t boundary, int64_t tokens) {
    return ActivationSpec{{tokens, boundary == 1 ? 8 : width}};
  };
  return model;
}

UnitCosts measured(const ModelDescription& model, int64_t tokens, int optimizer_slots) {
  DeviceContext ctx(Device::cpu());
  ProfileOptions options;
  options.microbatch_tokens = tokens;
  options.warmup = 0;
  options.repetitions = 1;
  options.optimizer_slots = optimizer_slots;
  return profile_units(model, ctx, options);
}

// Each replica's sharded optimizer state, as sharded_optimizer_bytes counts it from the
// description, against what an Optimizer of the replica's pieces allocates: equal to the byte
// for every replica of 2, 3 and 5, on parameters whose pieces round up at 512 B (norms and
// biases of 12 elements, some pieces empty) and at 2 MiB (a weight of 5 MiB, in pieces of 2.5,
// 1.7 and 1 MiB), each of which takes more than an even share of the whole state somewhere.
TEST(UnitMemory, ShardedOptimizerStateIsWhatEachReplicaAllocates) {
  const int64_t wide = 5 * 1024 * 1024 / (4 * 8);  // the widening weight of 8 x wide: 5 MiB
  for (const int64_t width : {int64_t{12}, wide})
    for (const std::string optimizer : {"adamw", "sgd"}) {
      const ModelDescription model = every_layer_kind(width);
      const std::vector<UnitCost> units = described_unit_costs(model, 1, optimizer);
      double most_over_share = 0;  // the largest piece's bytes over an even share
      for (int64_t u = 0; u < model.num_units; ++u)
        for (const int replicas : {2, 3, 5})
          for (int d = 0; d < replicas; ++d) {
            SCOPED_TRACE("width " + std::to_string(width) + ", " + optimizer + ", unit " +
                         std::to_string(u) + ", replica " + std::to_string(d) + " of " +
                         std::to_string(replicas));
            DeviceContext ctx(Device::cpu());
            Stage stage(model, u, u + 1, ctx, 1);
            std::vector<ParameterShard> shards;
            for (const Parameter* p : stage.parameters())
              shards.push_back(replica_piece(p->value.numel(), d, replicas));
            OptimizerConfig config;
            config.kind = optimizer;
            const size_t before = ctx.allocator().stats().allocated_bytes;
            const Optimizer sharded(ctx, stage.parameters(), config, shards);
            const double allocated =
                static_cast<double>(ctx.allocator().stats().allocated_bytes - before);
            const UnitCost& unit = units[static_cast<size_t>(u)];
            const double counted = sharded_optimizer_bytes(unit, d, replicas);
            EXPECT_EQ(counted, allocated);
            if (unit.optimizer_bytes > 0)
              most_over_share =
                  std::max(most_over_share, counted / (unit.optimizer_bytes / replicas));
          }
      EXPECT_GT(most_over_share, 1.25) << "width " << width << ", " << optimizer;
    }
}

TEST(UnitMemory, EveryLayerKindSaysWhatTheAllocatorMeasures) {
  // Width 2100: 129 rows of it are above 1 MiB, rounded to 2 MiB.
  for (const int64_t width : {12, 2100})
    for (const int64_t tokens : {1, 7, 129}) {
      const ModelDescription model = every_layer_kind(width);
      for (const std::string optimizer : {"adamw", "sgd"}) {
        SCOPED_TRACE("width " + std::to_string(width) + ", " + std::to_string(tokens) +
                     " tokens, " + optimizer);
        bool complete = true;
        const std::vector<UnitCost> described =
            described_unit_costs(model, tokens, optimizer, &complete);
        EXPECT_TRUE(complete);
        const UnitCosts costs = measured(model, tokens, optimizer == "sgd" ? 1 : 2);
        ASSERT_EQ(described.size(), costs.units.size());
        for (size_t u = 0; u < described.size(); ++u) {
          SCOPED_TRACE(model.unit(static_cast<int64_t>(u))->name());
          expect_same_bytes(described[u], costs.units[u]);
        }
      }
    }
}

// The presets' blocks all have one shape, so a copy with one block measures every unit kind
// of the preset; its units are compared with the full preset's.
TEST(UnitMemory, EveryPresetSaysWhatTheAllocatorMeasures) {
  for (const std::string& name : model_preset_names()) {
    const ModelConfig preset = model_preset(name);
    ModelConfig one_block = preset;
    one_block.n_layers = 1;
    const ModelDescription full = reference_model(preset), measurable = reference_model(one_block);
    for (const int64_t tokens : {1, 7, 129}) {
      SCOPED_TRACE(name + ", " + std::to_string(tokens) + " tokens");
      const UnitCosts costs = measured(measurable, tokens, 2);
      bool complete = true;
      const std::vector<UnitCost> described =
          described_unit_costs(full, tokens, "adamw", &complete);
      EXPECT_TRUE(complete);
      ASSERT_EQ(described.size(), static_cast<size_t>(full.num_units));
      for (size_t u = 0; u < described.size(); ++u) {
        SCOPED_TRACE("unit " + std::to_string(u));
        const size_t kind = u == 0 ? 0 : u + 1 == described.size() ? 2 : 1;
        expect_same_bytes(described[u], costs.units[kind]);
      }
    }
  }
}

// A layer that does not say what it keeps: the estimate counts the tensor entering it and
// calls itself incomplete.
class Silent : public Layer {
 public:
  const std::string& name() const override { return name_; }
  std::vector<Parameter*> parameters() override { return {}; }
  Tensor forward(DeviceContext&, const Tensor& x, const MicroBatchInputs&, SavedTensors&) override {
    return x;
  }
  Tensor backward_input(DeviceContext&, const Tensor& dy, SavedTensors&) override { return dy; }
  void backward_weight(DeviceContext&, SavedTensors&) override {}

 private:
  std::string name_ = "silent";
};

TEST(UnitMemory, ALayerThatDoesNotSayMakesTheEstimateALowerBound) {
  ModelDescription model = every_layer_kind(12);
  const auto make = model.make_unit;
  model.make_unit = [make](int64_t index) -> std::unique_ptr<Layer> {
    if (index == 2) return std::make_unique<Silent>();
    return make(index);
  };
  EXPECT_FALSE(model.unit_memory(2, 7).has_value());
  bool complete = true;
  const std::vector<UnitCost> described = described_unit_costs(model, 7, "adamw", &complete);
  EXPECT_FALSE(complete);
  EXPECT_EQ(described[2].activation_bytes, allocated_bytes({7, 12}));
  EXPECT_EQ(described[2].workspace_bytes, 0.0);
  const auto sched = schedule::generate(schedule::ScheduleKind::k1F1B, 1, 2, 1);
  const auto estimate = estimate_rank_memory(model, {{0, 6}}, sched, "adamw", 7);
  EXPECT_FALSE(estimate[0].complete);
  EXPECT_TRUE(estimate_rank_memory(every_layer_kind(12), {{0, 6}}, sched, "adamw", 7)[0].complete);
}

}  // namespace
}  // namespace conveyor

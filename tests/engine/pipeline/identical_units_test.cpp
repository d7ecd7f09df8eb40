// Which units profile_units times as one: the reference model's blocks, and in a model that
// names its kinds only the units of one kind whose layers also agree in type and shapes.
#include "engine/pipeline/identical_units.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "layers/basic_layers.h"
#include "layers/blocks.h"

namespace conveyor {
namespace {

TEST(IdenticalUnits, TheReferenceModelsBlocksAreOneGroup) {
  ModelConfig config;
  config.d_model = 16;
  config.n_layers = 4;
  config.vocab = 32;
  config.hidden = 24;
  const ModelDescription model = reference_model(config);
  EXPECT_EQ(identical_unit_leaders(model, 8), (std::vector<int64_t>{0, 1, 1, 1, 1, 5}));
}

// embed -> block(16, 24) -> block(16, 24) -> block(16, 40) -> relu -> gelu -> block(16, 24)
// -> head, every unit's kind named by `kind`.
ModelDescription mixed_units(std::function<std::string(int64_t)> kind) {
  ModelDescription model;
  model.name = "mixed";
  model.num_units = 8;
  model.vocab = 32;
  model.make_unit = [](int64_t i) -> std::unique_ptr<Layer> {
    const std::string name = "u" + std::to_string(i);
    switch (i) {
      case 0:
        return std::make_unique<Embedding>(name, 32, 16);
      case 3:
        return std::make_unique<MlpBlock>(name, 16, 40, ops::ActivationKind::kGelu);
      case 4:
        return std::make_unique<Activation>(name, ops::ActivationKind::kRelu);
      case 5:
        return std::make_unique<Activation>(name, ops::ActivationKind::kGelu);
      case 7:
        return std::make_unique<LossHead>(name, 16, 32);
      default:
        return std::make_unique<MlpBlock>(name, 16, 24, ops::ActivationKind::kGelu);
    }
  };
  model.activation = activation_rows(16);
  model.unit_kind = std::move(kind);
  return model;
}

TEST(IdenticalUnits, OnlyUnitsOfOneKindAndShapeAreOneGroup) {
  // Every unit of one kind: the types and shapes still part the blocks of another width, the
  // embedding and the head; the two activations share type and shapes, and so pass as one.
  const auto all_alike = mixed_units([](int64_t) { return "unit"; });
  EXPECT_EQ(identical_unit_leaders(all_alike, 8), (std::vector<int64_t>{0, 1, 1, 3, 4, 4, 1, 7}));
  // Named apart, the ReLU and the GELU are two groups.
  const auto named = mixed_units([](int64_t i) { return i == 4 ? "relu" : i == 5 ? "gelu" : "x"; });
  EXPECT_EQ(identical_unit_leaders(named, 8), (std::vector<int64_t>{0, 1, 1, 3, 4, 5, 1, 7}));
}

TEST(IdenticalUnits, AModelThatNamesNoKindsIsTimedUnitByUnit) {
  const auto unnamed = mixed_units(nullptr);
  EXPECT_EQ(identical_unit_leaders(unnamed, 8), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
}

}  // namespace
}  // namespace conveyor

// Model presets and their validation; model descriptions: the reference model as one, and
// the checks that catch an incomplete description before anything is built from it.
#include "layers/model.h"

#include <gtest/gtest.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "layers/basic_layers.h"

namespace conveyor {
namespace {

TEST(ModelPresets, KnownAndUnknown) {
  EXPECT_EQ(model_preset("small").d_model, 1024);
  EXPECT_EQ(model_preset("medium").n_layers, 16);
  EXPECT_EQ(model_preset("medium").vocab, 32768);
  EXPECT_THROW(model_preset("huge"), std::invalid_argument);
  ModelConfig bad = model_preset("tiny");
  bad.d_model = 0;
  EXPECT_THROW(bad.validate(), std::invalid_argument);
}

// The tiny preset made smaller: d=12, hidden 20, 3 blocks (5 units).
ModelConfig small_tiny() {
  ModelConfig config = model_preset("tiny");
  config.d_model = 12;
  config.hidden = 20;
  config.n_layers = 3;
  return config;
}

TEST(ModelDescription, TheReferenceModelIsOne) {
  ModelConfig config = small_tiny();
  const ModelDescription model = reference_model(config);
  EXPECT_NO_THROW(model.validate());
  EXPECT_EQ(model.num_units, 5);
  EXPECT_EQ(model.vocab, config.vocab);
  EXPECT_EQ(model.unit(0)->name(), "embed");
  EXPECT_EQ(model.unit(2)->name(), "blocks.1");
  EXPECT_EQ(model.unit(4)->name(), "head");
  EXPECT_EQ(model.count_parameters(), count_parameters(config));
  const std::vector<int64_t> counts = model.unit_parameter_counts();
  ASSERT_EQ(counts.size(), 5u);
  EXPECT_EQ(counts[0], config.vocab * config.d_model);
  EXPECT_EQ(counts[1], counts[3]);  // identical blocks
  for (int64_t boundary = 1; boundary < model.num_units; ++boundary) {
    const ActivationSpec spec = model.activation_at(boundary, 7);
    EXPECT_EQ(spec.shape, (Shape{7, 12}));
    EXPECT_EQ(spec.dtype, DType::kF32);
  }
  EXPECT_THROW(model.unit(5), std::out_of_range);
  EXPECT_THROW(model.activation_at(0, 7), std::out_of_range);
  config.d_model = 0;
  EXPECT_THROW(reference_model(config), std::invalid_argument);
}

ModelDescription two_linear_units() {
  ModelDescription model;
  model.name = "two linears";
  model.num_units = 2;
  model.make_unit = [](int64_t index) -> std::unique_ptr<Layer> {
    return std::make_unique<Linear>("unit." + std::to_string(index), 4, 4);
  };
  model.activation = activation_rows(4);
  return model;
}

// What each check says matters as much as that it throws: the user has to fix the field.
std::string error_of(const ModelDescription& model) {
  try {
    model.validate();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(ModelDescription, IncompleteDescriptionsAreRejectedByName) {
  EXPECT_EQ(error_of(two_linear_units()), "");
  ModelDescription model = two_linear_units();
  model.num_units = 1;
  EXPECT_NE(error_of(model).find("at least 2 are needed"), std::string::npos) << error_of(model);
  model = two_linear_units();
  model.make_unit = nullptr;
  EXPECT_NE(error_of(model).find("make_unit"), std::string::npos) << error_of(model);
  model = two_linear_units();
  model.activation = nullptr;
  EXPECT_NE(error_of(model).find("activation_rows"), std::string::npos) << error_of(model);
  model = two_linear_units();
  model.activation = [](int64_t, int64_t tokens) { return ActivationSpec{{tokens, 0}}; };
  EXPECT_NE(error_of(model).find("positive dimensions"), std::string::npos) << error_of(model);
  model = two_linear_units();
  model.vocab = -3;
  EXPECT_NE(error_of(model).find("vocab -3"), std::string::npos) << error_of(model);
  model = two_linear_units();
  model.make_unit = [](int64_t) { return std::unique_ptr<Layer>(); };
  EXPECT_THROW(model.unit(0), std::invalid_argument);
  EXPECT_THROW(activation_rows(0), std::invalid_argument);
}

// Each unit's own account of what it keeps, on the input the description gives it; that the
// figures are what the allocator measures is checked in engine/pipeline's unit_memory_test.
TEST(ModelDescription, UnitMemoryAsksEachUnitOnItsInput) {
  ModelConfig config = small_tiny();
  const ModelDescription model = reference_model(config);
  std::vector<ActivationMemory> memory;
  for (int64_t u = 0; u < model.num_units; ++u) {
    const std::optional<ActivationMemory> m = model.unit_memory(u, 7);
    ASSERT_TRUE(m.has_value()) << "unit " << u;
    memory.push_back(*m);
  }
  // The embedding keeps nothing of its own: its ids are a view of the step's.
  EXPECT_EQ(memory[0].saved, 0.0);
  EXPECT_EQ(memory[0].weight_pending, allocated_bytes({7, 12}));
  for (int64_t u = 2; u <= 3; ++u) {  // identical blocks
    EXPECT_EQ(memory[u].saved, memory[1].saved);
    EXPECT_EQ(memory[u].weight_pending, memory[1].weight_pending);
    EXPECT_EQ(memory[u].workspace, memory[1].workspace);
  }
  // A block keeps its input among other tensors; the head keeps its logits' gradient.
  EXPECT_GT(memory[1].saved, allocated_bytes({7, 12}));
  EXPECT_GT(memory[4].saved, allocated_bytes({7, config.vocab}));
  // A Linear unit sizes what it keeps from the activation the description gives it.
  ModelDescription linears = two_linear_units();
  EXPECT_EQ(linears.unit_memory(1, 300)->saved, allocated_bytes({300, 4}));
  EXPECT_THROW(model.unit_memory(5, 7), std::out_of_range);
}

}  // namespace
}  // namespace conveyor

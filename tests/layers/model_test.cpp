// Model presets and their validation.
#include <gtest/gtest.h>

#include <stdexcept>

#include "layers/model.h"

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

}  // namespace
}  // namespace conveyor

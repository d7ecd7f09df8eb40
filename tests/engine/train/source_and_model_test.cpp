// The trainer with the caller's data and model: a TokenSource of one's own is the one drawn
// from, a ModelDescription of one's own trains, and what cannot work says why.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>

#include "engine/train/trainer.h"
#include "layers/basic_layers.h"
#include "layers/blocks.h"

namespace conveyor {
namespace {

// Token t+1 = (5·token t + 3) mod vocab: a function of the current token, so a model that
// sees one token can learn it exactly (loss towards 0).
class AffineSource : public TokenSource {
 public:
  explicit AffineSource(int64_t vocab) : vocab_(vocab) {}
  int64_t vocab() const override { return vocab_; }
  void next(int32_t* inputs, int32_t* targets, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) {
      inputs[i] = current_;
      current_ = static_cast<int32_t>((5 * current_ + 3) % vocab_);
      targets[i] = current_;
      ++position_;
    }
  }
  uint64_t position() const override { return position_; }
  void seek(uint64_t position) override {
    current_ = 0;
    position_ = 0;
    std::vector<int32_t> scratch(position);
    next(scratch.data(), scratch.data(), static_cast<int64_t>(position));
  }
  std::string describe() const override { return "affine sequence"; }

 private:
  int64_t vocab_;
  int32_t current_ = 0;
  uint64_t position_ = 0;
};

TrainConfig small_run() {
  TrainConfig c;
  c.model = model_preset("tiny");
  c.model.d_model = 32;
  c.model.hidden = 64;
  c.model.vocab = 16;
  c.steps = 30;
  c.batch_tokens = 256;
  c.microbatches = 2;
  c.optimizer.lr = 1e-2;
  c.optimizer.warmup_steps = 3;
  c.device = Device::cpu();
  return c;
}

TEST(TrainerSource, TheCallersSourceIsTheOneDrawnFrom) {
  auto source = std::make_shared<AffineSource>(16);
  Trainer trainer(small_run(), source);
  EXPECT_EQ(&trainer.source(), source.get());
  const double first = trainer.step().loss;
  double last = first;
  for (int s = 1; s < 30; ++s) last = trainer.step().loss;
  EXPECT_EQ(source->position(), 30u * 256u);
  EXPECT_GT(first, 0.5 * std::log(16.0));  // untrained
  EXPECT_LT(last, 0.5 * first);            // a deterministic sequence is learnt far below uniform
}

TEST(TrainerSource, ASourceBeyondTheVocabularyIsRejected) {
  TrainConfig c = small_run();
  try {
    Trainer trainer(c, std::make_shared<AffineSource>(40));
    FAIL() << "token ids up to 39 were accepted by a model of vocab 16";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("ids up to 39"), std::string::npos) << e.what();
  }
}

// The reference model's units, cut differently: a description of the caller's.
ModelDescription custom_description(int64_t vocab) {
  ModelDescription model;
  model.name = "custom";
  model.num_units = 4;
  model.vocab = vocab;
  model.make_unit = [vocab](int64_t index) -> std::unique_ptr<Layer> {
    if (index == 0) return std::make_unique<Embedding>("embed", vocab, 24);
    if (index == 3) return std::make_unique<LossHead>("head", 24, vocab);
    return std::make_unique<MlpBlock>("blocks." + std::to_string(index - 1), 24, 40,
                                      ops::ActivationKind::kRelu);
  };
  model.activation = activation_rows(24);
  return model;
}

TEST(TrainerModel, ADescriptionOfTheCallersTrainsOnTwoStages) {
  TrainConfig c = small_run();
  c.stages = 2;
  c.model.d_model = 0;  // not used with a description: must not be validated
  Trainer trainer(custom_description(16), c, std::make_shared<AffineSource>(16));
  EXPECT_EQ(trainer.model().name, "custom");
  EXPECT_EQ(trainer.stage_ranges().size(), 2u);
  const double first = trainer.step().loss;
  double last = first;
  for (int s = 1; s < 30; ++s) last = trainer.step().loss;
  EXPECT_LT(last, 0.5 * first);
}

TEST(TrainerModel, TheBuiltInSourceNeedsTheDescriptionsVocabulary) {
  ModelDescription model = custom_description(16);
  model.vocab = 0;
  try {
    Trainer trainer(model, small_run());
    FAIL() << "a Markov source was made without a vocabulary";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("TokenSource"), std::string::npos) << e.what();
  }
  // With the vocabulary stated, the built-in Markov source is the default.
  Trainer trainer(custom_description(16), small_run());
  EXPECT_TRUE(trainer.source().entropy().has_value());
}

}  // namespace
}  // namespace conveyor

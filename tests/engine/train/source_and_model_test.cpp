// The trainer with the caller's data and model: a TokenSource of one's own is the one drawn
// from, a ModelDescription of one's own trains, and what cannot work says why.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "engine/train/trainer.h"
#include "layers/basic_layers.h"
#include "layers/blocks.h"
#include "support/throwing_layer.h"

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

// Says vocab 16 and gives a 16 (one past its last id) at one position of its first batch.
class OnceOutOfRangeSource : public AffineSource {
 public:
  OnceOutOfRangeSource() : AffineSource(16) {}
  void next(int32_t* inputs, int32_t* targets, int64_t n) override {
    AffineSource::next(inputs, targets, n);
    if (!lied_ && n > 5) {
      inputs[5] = 16;
      lied_ = true;
    }
  }

 private:
  bool lied_ = false;
};

// The first step of `trainer` (fed by OnceOutOfRangeSource) is refused saying `says`, before
// anything runs: the trainer goes on with the next batch.
void expect_the_out_of_range_id_refused(Trainer& trainer, const std::string& says) {
  try {
    trainer.step();
    FAIL() << "token id 16 reached a table of 16 rows";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
  EXPECT_EQ(trainer.steps_done(), 0);
  EXPECT_EQ(trainer.failure(), "");
  EXPECT_TRUE(std::isfinite(trainer.step().loss));
}

TEST(TrainerSource, AnIdOutsideTheVocabularyIsRefusedBeforeTheStepRuns) {
  // On a GPU the embedding would read past its table; the trainer checks the ids on the host.
  Trainer trainer(small_run(), std::make_shared<OnceOutOfRangeSource>());
  expect_the_out_of_range_id_refused(
      trainer, "token id 16 at position 5 of micro-batch 0 is outside [0, 16)");
  // Evaluation batches of the caller's are checked too; an ignored target (-1) is no error.
  std::vector<MicroBatchData> batch(1);
  batch[0].tokens = {1, 2, 3};
  batch[0].targets = {2, -1, 4};
  EXPECT_TRUE(std::isfinite(trainer.evaluate(batch)));
  batch[0].targets[2] = 99;
  try {
    trainer.evaluate(batch);
    FAIL() << "target id 99 was evaluated";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("target id 99 at position 2 of micro-batch 0"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(std::isfinite(trainer.step().loss));
}

// A model that does not say its vocab is checked against the ids its embedding and loss head
// accept, as a vocab would check them: on the CPU the kernel's own error would otherwise leave
// the trainer unusable, and on a GPU the id would read past the table.
TEST(TrainerSource, WithoutAVocabTheIdsTheUnitsAcceptAreChecked) {
  ModelDescription model = custom_description(16);
  model.vocab = 0;
  Trainer trainer(model, small_run(), std::make_shared<OnceOutOfRangeSource>());
  expect_the_out_of_range_id_refused(trainer,
                                     "token id 16 at position 5 of micro-batch 0 is outside "
                                     "[0, 16), the ids unit 0 of the model accepts");
  std::vector<MicroBatchData> batch(1);
  batch[0].tokens = {1, 2, 3};
  batch[0].targets = {2, -1, 16};
  try {
    trainer.evaluate(batch);
    FAIL() << "target id 16 was evaluated by a loss head of 16 classes";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("target id 16 at position 2 of micro-batch 0 is outside "
                                         "[0, 16), the ids unit 3 of the model accepts"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(trainer.failure(), "");
}

TEST(TrainerSource, WithoutAVocabASourceBeyondTheUnitsIdsIsRejected) {
  ModelDescription model = custom_description(16);
  model.vocab = 0;
  try {
    Trainer trainer(model, small_run(), std::make_shared<AffineSource>(40));
    FAIL() << "token ids up to 39 were accepted by an embedding of 16 rows";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "the data source has token ids up to 39 but the model's first unit takes ids "
              "below 16; use a model whose units take 40 ids or more");
  }
  // The targets too: an embedding of 32 rows before a loss head of 16 classes.
  model.make_unit = [inner = model.make_unit](int64_t index) -> std::unique_ptr<Layer> {
    if (index == 0) return std::make_unique<Embedding>("embed", 32, 24);
    return inner(index);
  };
  try {
    Trainer trainer(model, small_run(), std::make_shared<AffineSource>(32));
    FAIL() << "target ids up to 31 were accepted by a loss head of 16 classes";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "the data source has token ids up to 31 but the model's last unit takes ids "
              "below 16; use a model whose units take 32 ids or more");
  }
  Trainer trainer(model, small_run(), std::make_shared<AffineSource>(16));
  try {
    trainer.evaluate(*std::make_shared<AffineSource>(20), 1);
    FAIL() << "an evaluation source of ids up to 19 was accepted by a loss head of 16 classes";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("the evaluation source has token ids up to 19 but the "
                                         "model's last unit takes ids below 16"),
              std::string::npos)
        << e.what();
  }
}

// custom_description's model on two stages, its unit 2 returning rows of 12 where the
// description says 24.
Trainer trainer_with_a_narrow_unit() {
  ModelDescription model = custom_description(16);
  model.make_unit = [inner = model.make_unit](int64_t index) -> std::unique_ptr<Layer> {
    if (index == 2) return std::make_unique<Linear>("narrow", 24, 12);
    return inner(index);
  };
  TrainConfig c = small_run();
  c.stages = 2;
  return Trainer(model, c, std::make_shared<AffineSource>(16));
}

TEST(TrainerModel, AUnitOfAnotherShapeFailsTheStepAndTheTrainerStopsThere) {
  Trainer trainer = trainer_with_a_narrow_unit();
  try {
    trainer.step();
    FAIL() << "a unit of the wrong width trained";
  } catch (const PipelineError& e) {
    EXPECT_NE(std::string(e.what()).find("the output of unit 2 is f32 [128, 12] for a "
                                         "micro-batch of 128 tokens; expected f32 [128, 24]"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NE(trainer.failure().find("step 1 failed (rank"), std::string::npos) << trainer.failure();
  // Its stages hold micro-batches and its transports are aborted: it says so, every time.
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      trainer.step();
      FAIL() << "a trainer whose step failed ran another";
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find("cannot run a step: step 1 failed (rank"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(trainer.evaluate(trainer.source(), 1), std::logic_error);
}

// A unit that takes another width than the one it is given fails inside its own layer, whose
// check does not know the unit: the stage names it.
TEST(TrainerModel, AUnitThatTakesAnotherWidthIsNamedInTheError) {
  ModelDescription model = custom_description(16);
  model.make_unit = [inner = model.make_unit](int64_t index) -> std::unique_ptr<Layer> {
    if (index == 2) return std::make_unique<Linear>("wide", 40, 24);
    return inner(index);
  };
  Trainer trainer(model, small_run(), std::make_shared<AffineSource>(16));
  try {
    trainer.step();
    FAIL() << "a unit of another input width trained";
  } catch (const PipelineError& e) {
    EXPECT_NE(std::string(e.what()).find("unit 2 ('wide'): "), std::string::npos)
        << "[" << e.what() << "]";
  }
}

TEST(TrainerModel, AnEvaluationThatFailsLeavesTheTrainerRefusingToo) {
  Trainer trainer = trainer_with_a_narrow_unit();
  std::vector<MicroBatchData> batch(1);
  batch[0].tokens = {1, 2, 3};
  batch[0].targets = {2, 3, 4};
  try {
    trainer.evaluate(batch);
    FAIL() << "a unit of the wrong width was evaluated";
  } catch (const std::exception& e) {  // the unit's own error, not a refusal
    EXPECT_NE(std::string(e.what()).find("the output of unit 2 is f32 [3, 12]"), std::string::npos)
        << e.what();
  }
  EXPECT_NE(trainer.failure().find("an evaluation failed (model 'custom': the output of unit 2"),
            std::string::npos)
      << trainer.failure();
  try {
    trainer.step();
    FAIL() << "a trainer whose evaluation failed ran a step";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot run a step: an evaluation failed"),
              std::string::npos)
        << e.what();
  }
}

using testing::ThrowsAnInt;

TEST(TrainerModel, AUnitThrowingWhatIsNotAStdExceptionFailsTheStepLikeAnyOther) {
  ModelDescription model = custom_description(16);
  model.make_unit = [inner = model.make_unit](int64_t index) -> std::unique_ptr<Layer> {
    if (index == 2) return std::make_unique<ThrowsAnInt>();
    return inner(index);
  };
  TrainConfig c = small_run();
  c.stages = 2;
  Trainer trainer(model, c, std::make_shared<AffineSource>(16));
  try {
    trainer.step();
    FAIL() << "a unit that throws trained";
  } catch (const PipelineError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "unit 2 ('thrower') threw an exception not derived from std::exception"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NE(trainer.failure().find("step 1 failed (rank 1, action "), std::string::npos)
      << trainer.failure();
  EXPECT_THROW(trainer.step(), std::logic_error);
}

}  // namespace
}  // namespace conveyor

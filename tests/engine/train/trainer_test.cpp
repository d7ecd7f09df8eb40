// The single-device trainer: it learns, it is deterministic, it reports divergence with the
// step, and it rejects impossible configurations.
#include "engine/train/trainer.h"

#include <gtest/gtest.h>

#include <cmath>

namespace conveyor {
namespace {

TrainConfig quick_config() {
  TrainConfig c;
  c.model = model_preset("tiny");
  c.model.d_model = 32;
  c.model.hidden = 64;
  c.model.vocab = 16;
  c.steps = 40;
  c.batch_tokens = 512;
  c.microbatches = 2;
  c.optimizer.lr = 1e-2;
  c.optimizer.min_lr = 1e-3;
  c.optimizer.warmup_steps = 5;
  c.device = Device::cpu();
  return c;
}

TEST(Trainer, LossApproachesTheSourceEntropy) {
  Trainer trainer(quick_config());
  const double first = trainer.step().loss;
  double last = first;
  for (int s = 1; s < 40; ++s) last = trainer.step().loss;
  const double floor = *trainer.source().entropy();
  EXPECT_NEAR(first, std::log(16.0), 0.3);  // untrained: close to uniform
  EXPECT_LT(last, first - 0.5);
  EXPECT_LT(last, floor * 1.25);
}

TEST(Trainer, SameConfigGivesTheSameBits) {
  Trainer a(quick_config()), b(quick_config());
  for (int s = 0; s < 5; ++s) EXPECT_EQ(a.step().loss, b.step().loss);
  auto pa = a.executor().parameters(), pb = b.executor().parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_EQ(to_vector_f32(pa[i]->value), to_vector_f32(pb[i]->value)) << pa[i]->name;
}

TEST(Trainer, DivergenceNamesTheStep) {
  TrainConfig c = quick_config();
  c.optimizer.kind = "sgd";
  c.optimizer.lr = 1e30;
  c.optimizer.min_lr = 0;
  c.optimizer.warmup_steps = 0;
  c.optimizer.clip_norm = 0;
  Trainer trainer(c);
  try {
    for (int s = 0; s < 10; ++s) trainer.step();
    FAIL() << "training with lr 1e30 did not diverge";
  } catch (const TrainingDiverged& e) {
    EXPECT_NE(std::string(e.what()).find("at step"), std::string::npos) << e.what();
  }
}

TEST(Trainer, ImpossibleConfigsAreRejected) {
  TrainConfig c = quick_config();
  c.microbatches = 3;  // 512 tokens do not split into 3
  EXPECT_THROW(Trainer{c}, std::invalid_argument);
  c = quick_config();
  c.steps = 0;
  EXPECT_THROW(Trainer{c}, std::invalid_argument);
  c = quick_config();
  c.optimizer.kind = "lion";
  EXPECT_THROW(Trainer{c}, std::invalid_argument);
}

TEST(LearningRate, WarmupThenCosine) {
  OptimizerConfig c;
  c.lr = 1.0;
  c.min_lr = 0.1;
  c.warmup_steps = 10;
  EXPECT_DOUBLE_EQ(learning_rate(c, 5, 110), 0.5);
  EXPECT_DOUBLE_EQ(learning_rate(c, 10, 110), 1.0);
  EXPECT_NEAR(learning_rate(c, 60, 110), 0.55, 1e-12);
  EXPECT_NEAR(learning_rate(c, 110, 110), 0.1, 1e-12);
  EXPECT_EQ(clip_scale(c, 0.5), 1.0f);
  c.clip_norm = 1.0;
  EXPECT_FLOAT_EQ(clip_scale(c, 4.0), 0.25f);
}

}  // namespace
}  // namespace conveyor

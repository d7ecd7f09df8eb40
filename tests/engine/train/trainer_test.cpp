// The single-device trainer: it learns, it is deterministic, it reports divergence with the
// step, and it rejects impossible configurations.
#include "engine/train/trainer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "support/mapped_files.h"
#include "support/test_util.h"

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

// cuBLASLt is the CUDA backend's alone, opened on its first matrix product: a CPU run does
// not pay for loading it (a tenth of a second and some 200 MiB per process).
TEST(Trainer, ACpuRunNeverLoadsCublasLt) {
  TrainConfig config = quick_config();
  config.steps = 2;
  Trainer trainer(config);
  trainer.step();
  trainer.step();
  EXPECT_FALSE(testing::process_maps_file("libcublasLt"));
}

TEST(Trainer, SameConfigGivesTheSameBits) {
  Trainer a(quick_config()), b(quick_config());
  for (int s = 0; s < 5; ++s) EXPECT_EQ(a.step().loss, b.step().loss);
  auto pa = a.executor().parameters(), pb = b.executor().parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_EQ(to_vector_f32(pa[i]->value), to_vector_f32(pb[i]->value)) << pa[i]->name;
}

// Held-out data follows the trained tokens: a fresh built-in source at the run's state draws
// what the run's own source would, after two steps and 2^50 tokens in alike (the latter only
// by restoring, not replaying).
TEST(Trainer, TheSourceAtTheRunDrawsWhatTheRunWould) {
  const TrainConfig config = quick_config();
  Trainer trainer(config);
  trainer.step();
  trainer.step();
  for (const bool far : {false, true}) {
    if (far) trainer.source().restore(uint64_t{1} << 50, 11);
    std::unique_ptr<TokenSource> held_out =
        make_token_source_at(config, config.model.vocab, trainer.source());
    EXPECT_EQ(held_out->position(), trainer.source().position());
    std::vector<int32_t> in_a(300), out_a(300), in_b(300), out_b(300);
    trainer.source().next(in_a.data(), out_a.data(), 300);
    held_out->next(in_b.data(), out_b.data(), 300);
    EXPECT_EQ(in_a, in_b) << far;
    EXPECT_EQ(out_a, out_b) << far;
  }
}

// The held-out source of a file run draws the bytes the run read: the file replaced by other
// bytes, cut short or removed since changes nothing (read again, it evaluated the new bytes,
// training data wrapped around, or failed after the last step).
TEST(Trainer, TheSourceAtAFileRunDrawsTheBytesTheRunRead) {
  const std::string path = ::testing::TempDir() + "conveyor_held_out.bin";
  std::string bytes(4096, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 7 + i / 13) % 256);
  auto write = [&](const std::string& text) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f << text;
  };
  write(bytes);
  TrainConfig config = quick_config();
  config.model.vocab = 256;
  config.batch_tokens = 256;
  config.data_path = path;
  Trainer trainer(config);
  trainer.step();
  for (const std::string& now :
       {std::string(bytes.size(), 'x'), bytes.substr(0, 300), std::string()}) {
    if (now.empty())
      std::remove(path.c_str());
    else
      write(now);
    std::unique_ptr<TokenSource> held_out =
        make_token_source_at(config, config.model.vocab, trainer.source());
    EXPECT_EQ(held_out->position(), 256u);
    EXPECT_EQ(held_out->contents_digest(), trainer.source().contents_digest());
    std::vector<int32_t> in(1024), out(1024);
    held_out->next(in.data(), out.data(), 1024);
    for (size_t i = 0; i < in.size(); ++i) {
      ASSERT_EQ(in[i], static_cast<uint8_t>(bytes[256 + i])) << i << " " << now.size();
      ASSERT_EQ(out[i], static_cast<uint8_t>(bytes[257 + i])) << i << " " << now.size();
    }
  }
  EXPECT_EQ(trainer.source().position(), 256u);
}

// SGD at a learning rate of 1e30 from the first step: the loss stops being finite within a
// few steps.
TrainConfig diverging_config(double clip_norm) {
  TrainConfig c = quick_config();
  c.optimizer.kind = "sgd";
  c.optimizer.lr = 1e30;
  c.optimizer.min_lr = 0;
  c.optimizer.warmup_steps = 0;
  c.optimizer.clip_norm = clip_norm;
  return c;
}

TEST(Trainer, DivergenceNamesTheStep) {
  Trainer trainer(diverging_config(/*clip_norm=*/0));
  try {
    for (int s = 0; s < 10; ++s) trainer.step();
    FAIL() << "training with lr 1e30 did not diverge";
  } catch (const TrainingDiverged& e) {
    EXPECT_NE(std::string(e.what()).find("at step"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("or enable clipping (TrainConfig::optimizer.clip_norm)"),
              std::string::npos)
        << e.what();
  }
}

TEST(Trainer, DivergenceWithClippingOnSuggestsALowerNorm) {
  Trainer trainer(diverging_config(/*clip_norm=*/0.5));
  try {
    for (int s = 0; s < 10; ++s) trainer.step();
    FAIL() << "training with lr 1e30 did not diverge";
  } catch (const TrainingDiverged& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "or the clipping norm (TrainConfig::optimizer.clip_norm, now 0.5)"),
              std::string::npos)
        << e.what();
  }
}

std::vector<std::vector<float>> weights(Trainer& trainer) {
  std::vector<std::vector<float>> out;
  for (Parameter* p : trainer.executor().parameters()) out.push_back(to_vector_f32(p->value));
  return out;
}

// A step whose loss or gradient norm is not finite changes no weight: the run ends on the
// weights of the last good step.
TEST(Trainer, ADivergedStepLeavesTheWeightsAsTheyWere) {
  Trainer trainer(diverging_config(/*clip_norm=*/0));
  for (int s = 0; s < 10; ++s) {
    const auto before = weights(trainer);
    try {
      trainer.step();
    } catch (const TrainingDiverged&) {
      EXPECT_GT(s, 0) << "the first step diverged: no good step to keep";
      EXPECT_EQ(weights(trainer), before);
      return;
    }
  }
  FAIL() << "training with lr 1e30 did not diverge";
}

// A diverged step applied no update, so running it again diverged again without end, each
// time on the next batch; an evaluation of the weights an update ruined returned NaN.
TEST(Trainer, AfterADivergedStepTheStepIsRefusedAndEvaluationSaysWhy) {
  Trainer trainer(diverging_config(/*clip_norm=*/0));
  std::string diverged;
  uint64_t position = 0;
  for (int s = 0; s < 10 && diverged.empty(); ++s) {
    position = trainer.source().position();
    try {
      trainer.step();
    } catch (const TrainingDiverged& e) {
      diverged = e.what();
    }
  }
  ASSERT_FALSE(diverged.empty()) << "training with lr 1e30 did not diverge";
  const int64_t good = trainer.steps_done();
  ASSERT_GT(good, 0) << diverged;
  const std::string at = " at step " + std::to_string(good + 1);
  ASSERT_NE(diverged.find(at), std::string::npos) << diverged;
  // Put back where the step began: a save of the last good step resumes on the right batch.
  EXPECT_EQ(trainer.source().position(), position);

  const std::string how = diverged.substr(0, diverged.find(at) + at.size());
  for (int again = 0; again < 2; ++again) {
    try {
      trainer.step();
      ADD_FAILURE() << "a step ran after " << diverged;
    } catch (const std::logic_error& e) {
      EXPECT_EQ(std::string(e.what()),
                "the trainer cannot run a step: " + (how.starts_with("the ") ? how : "the " + how) +
                    ", which applied no update, so the same step would diverge again on the "
                    "same weights and batch; restore a checkpoint into the trainer "
                    "(resume_trainer) or build a new Trainer");
    }
    EXPECT_EQ(trainer.steps_done(), good);
    EXPECT_EQ(trainer.source().position(), position);
  }

  MarkovSource held_out(trainer.config().model.vocab, 5);
  const std::string says = " with the weights of step " + std::to_string(good) +
                           ", whose update diverged; lower the learning rate "
                           "(TrainConfig::optimizer.lr)";
  try {
    const double loss = trainer.evaluate(held_out, 1);
    ADD_FAILURE() << "the evaluation returned " << loss;
  } catch (const TrainingDiverged& e) {
    EXPECT_FALSE(std::isfinite(e.loss()));
    EXPECT_TRUE(std::string_view(e.what()).starts_with("the evaluation's mean loss is "))
        << e.what();
    EXPECT_TRUE(std::string_view(e.what()).ends_with(says)) << e.what();
    EXPECT_EQ(std::string(e.what()).find("-nan"), std::string::npos) << e.what();
  }
  MicroBatchData mb;
  mb.tokens = {1, 2, 3, 4};
  mb.targets = {2, 3, 4, 5};
  EXPECT_THROW(trainer.evaluate({mb}), TrainingDiverged);
  EXPECT_TRUE(trainer.failure().empty());

  // A restore replaces the weights: the step may run again (and, on these, diverge again).
  trainer.resume_at(good);
  EXPECT_THROW(trainer.step(), TrainingDiverged);
}

// Clipping scales the whole step by clip / norm: with SGD without momentum or decay the step
// is lr x the scaled gradient, so a clip at a quarter of the gradient norm moves every weight
// a quarter as far as no clip does (up to the rounding of the weights, half an ulp of each).
TEST(Trainer, ClippingScalesTheStepByClipOverNorm) {
  auto config = [](double clip) {
    TrainConfig c = quick_config();
    c.optimizer.kind = "sgd";
    c.optimizer.momentum = 0.0;
    c.optimizer.weight_decay = 0.0;
    c.optimizer.warmup_steps = 0;
    c.optimizer.clip_norm = clip;
    return c;
  };
  Trainer free(config(0.0));
  const auto start = weights(free);
  const double norm = free.step().grad_norm;
  ASSERT_GT(norm, 0.0);
  Trainer clipped(config(norm / 4));
  ASSERT_EQ(weights(clipped), start);
  EXPECT_EQ(clipped.step().grad_norm, norm);
  const auto free_end = weights(free), clipped_end = weights(clipped);
  double largest_move = 0.0;
  for (size_t i = 0; i < start.size(); ++i) {
    std::vector<double> want(start[i].size()), got(start[i].size());
    for (size_t j = 0; j < start[i].size(); ++j) {
      want[j] = 0.25 * (double(start[i][j]) - free_end[i][j]);
      got[j] = double(start[i][j]) - clipped_end[i][j];
      largest_move = std::max(largest_move, std::abs(want[j]));
    }
    EXPECT_TRUE(testing::all_close(got, want, 1e-4, 5e-7)) << "parameter " << i;
  }
  EXPECT_GT(largest_move, 1e-4) << "the step moved no weight enough to tell";
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

TEST(OptimizerConfig, DecayThatWouldZeroOrFlipTheWeightsIsRefused) {
  OptimizerConfig c;
  c.lr = 0.5;
  c.weight_decay = 1.99;  // each step scales decayed weights by 0.005
  EXPECT_NO_THROW(c.validate());
  // Products 1 and 1.5: a step would scale them by 0 and by -0.5.
  for (const auto& [decay, product] : {std::pair{2.0, "is 1 "}, std::pair{3.0, "is 1.5 "}}) {
    c.weight_decay = decay;
    try {
      c.validate();
      ADD_FAILURE() << "weight decay " << decay << " at lr 0.5 was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("lr x weight decay ") + product),
                std::string::npos)
          << e.what();
    }
  }
}

// The message a config's validate() gives, or "" when it passes.
std::string refusal(const OptimizerConfig& c, std::string_view prefix = "OptimizerConfig::") {
  try {
    c.validate(prefix);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// Each setting is checked as the float the kernels read: a beta that rounds to 1 made AdamW's
// bias correction 0 (NaN weights at the first step), an eps that rounds to 0 divided a zero
// gradient by 0, an infinite eps or lr passed and trained nothing or gave NaN.
TEST(OptimizerConfig, SettingsAreCheckedAsTheFloatsTheKernelsReadAndNamed) {
  EXPECT_EQ(refusal(OptimizerConfig{}), "");
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  struct Case {
    double OptimizerConfig::*field;
    double value;
    const char* says;
  };
  for (const Case& c : std::initializer_list<Case>{
           {&OptimizerConfig::beta2, 1.0 - 1e-8,
            "OptimizerConfig::beta2 must be in [0, 1) as a float"},
           {&OptimizerConfig::beta1, nan, "OptimizerConfig::beta1 must be in [0, 1)"},
           {&OptimizerConfig::beta1, -0.1, "OptimizerConfig::beta1 must be in [0, 1)"},
           {&OptimizerConfig::eps, 1e-46,
            "OptimizerConfig::eps must be a number above 0 that a float holds"},
           {&OptimizerConfig::eps, inf, "OptimizerConfig::eps must be"},
           {&OptimizerConfig::eps, 1e39, "OptimizerConfig::eps must be"},
           {&OptimizerConfig::lr, inf,
            "OptimizerConfig::lr must be a number above 0 that a float holds"},
           {&OptimizerConfig::lr, 1e39, "got 1e+39"},
           {&OptimizerConfig::lr, 1e-50, "OptimizerConfig::lr must be"},
           {&OptimizerConfig::lr, -1e-8, "got -1e-08"},
           {&OptimizerConfig::momentum, 1.0 - 1e-9, "OptimizerConfig::momentum must be in [0, 1)"},
           {&OptimizerConfig::weight_decay, nan, "OptimizerConfig::weight_decay must be a finite"},
           {&OptimizerConfig::clip_norm, nan,
            "OptimizerConfig::clip_norm must be a finite number of at least 0 (0 disables "
            "clipping)"},
           {&OptimizerConfig::clip_norm, -1.0, "OptimizerConfig::clip_norm must be"},
           {&OptimizerConfig::min_lr, nan, "OptimizerConfig::min_lr must be in [0, lr]"}}) {
    OptimizerConfig config;
    config.min_lr = 0;
    config.*c.field = c.value;
    const std::string error = refusal(config);
    EXPECT_NE(error.find(c.says), std::string::npos) << c.says << " | " << error;
  }
  OptimizerConfig config;
  config.warmup_steps = -1;
  EXPECT_EQ(refusal(config), "OptimizerConfig::warmup_steps must be at least 0, got -1");
  config = OptimizerConfig{};
  config.beta2 = 0.99999994;  // the largest float below 1
  EXPECT_EQ(refusal(config), "");
  config.eps = 1e-45;  // a float's smallest, subnormal, still above 0
  EXPECT_EQ(refusal(config), "");
  config.clip_norm = 0;  // clipping off
  EXPECT_EQ(refusal(config), "");
  // A trainer names the field as the config it holds it in.
  config.beta1 = 1.0;
  EXPECT_NE(refusal(config, "TrainConfig::optimizer.").find("TrainConfig::optimizer.beta1 must"),
            std::string::npos);
}

TEST(LearningRate, WarmupThenCosine) {
  OptimizerConfig c;
  c.lr = 1.0;
  c.min_lr = 0.1;
  c.warmup_steps = 10;
  EXPECT_DOUBLE_EQ(learning_rate(c, 5, 110), 0.5);
  EXPECT_DOUBLE_EQ(learning_rate(c, 10, 110), 1.0);
  EXPECT_NEAR(learning_rate(c, 60, 110), 0.55, 1e-12);
  // A quarter and three quarters of the decay: cos(pi/4) = sqrt(1/2) either side of the
  // midpoint, where a straight line from 1.0 to 0.1 would give 0.775 and 0.325.
  EXPECT_NEAR(learning_rate(c, 35, 110), 0.55 + 0.45 * std::sqrt(0.5), 1e-12);
  EXPECT_NEAR(learning_rate(c, 85, 110), 0.55 - 0.45 * std::sqrt(0.5), 1e-12);
  EXPECT_NEAR(learning_rate(c, 110, 110), 0.1, 1e-12);
  EXPECT_EQ(learning_rate(c, 0, 110), 0.0);  // before the first step
  // A negative step was read as deep in the warm-up, a negative rate.
  EXPECT_THROW(learning_rate(c, -5, 110), std::invalid_argument);
  EXPECT_THROW(learning_rate(c, 5, -1), std::invalid_argument);
  EXPECT_EQ(clip_scale(c, 0.5), 1.0f);
  c.clip_norm = 1.0;
  EXPECT_FLOAT_EQ(clip_scale(c, 4.0), 0.25f);
}

}  // namespace
}  // namespace conveyor

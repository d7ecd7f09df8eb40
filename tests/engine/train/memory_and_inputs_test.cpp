// Checks made before any work starts: the per-rank memory estimate and its refusal, and the
// built-in data sources' bounds on what they read and build.
#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <stdexcept>
#include <string>

#include "engine/pipeline/memory_estimate.h"
#include "engine/schedule/generators.h"
#include "engine/train/data.h"
#include "engine/train/trainer.h"

namespace conveyor {
namespace {

ModelConfig small_model() {
  ModelConfig m;
  m.d_model = 24;
  m.n_layers = 4;
  m.vocab = 40;
  m.hidden = 56;
  return m;
}

TEST(MemoryEstimate, ParametersGradientsAndStateMatchTheModel) {
  const ModelConfig config = small_model();
  const ModelDescription model = reference_model(config);
  const schedule::Schedule sched = schedule::generate(schedule::ScheduleKind::k1F1B, 2, 4, 1);
  const auto ranges = stage_ranges(model, partition_blocks(model, 2, PartitionSpec::uniform()));
  const auto adamw = estimate_rank_memory(model, ranges, sched, "adamw", 64);
  const auto sgd = estimate_rank_memory(model, ranges, sched, "sgd", 64);
  ASSERT_EQ(adamw.size(), 2u);
  double params = 0;
  for (const auto& r : adamw) {
    params += r.parameter_bytes / 4.0;
    EXPECT_EQ(r.gradient_bytes, r.parameter_bytes);
    EXPECT_EQ(r.optimizer_bytes, 2 * r.parameter_bytes);
    EXPECT_GT(r.activation_bytes, 0.0);
  }
  EXPECT_EQ(params, static_cast<double>(count_parameters(config)));
  EXPECT_EQ(sgd[0].optimizer_bytes, sgd[0].parameter_bytes);
  // 1F1B keeps p - r micro-batches in flight on rank r: rank 0 holds more than rank 1.
  const auto gpipe = estimate_rank_memory(
      model, ranges, schedule::generate(schedule::ScheduleKind::kGPipe, 2, 4, 1), "adamw", 64);
  EXPECT_GT(gpipe[0].activation_bytes, adamw[0].activation_bytes);
}

TEST(MemoryEstimate, TrainerRefusesARunOverTheLimitBeforeAllocating) {
  TrainConfig c;
  c.model = small_model();
  c.device = Device::cpu();
  c.steps = 1;
  c.batch_tokens = 64;
  c.microbatches = 2;
  c.memory_limit_bytes = 1024;
  try {
    Trainer trainer(c);
    FAIL() << "a 1 KiB limit was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("but the memory limit is"), std::string::npos) << e.what();
  }
  c.memory_limit_bytes = size_t{64} << 20;
  EXPECT_NO_THROW(Trainer trainer(c));
}

TEST(MemoryEstimate, ModelOfTensOfGigabytesIsRefusedAtOnce) {
  TrainConfig c;
  c.model = small_model();
  c.model.d_model = 16384;
  c.model.hidden = 65536;
  c.model.n_layers = 32;
  c.device = Device::cpu();
  c.memory_limit_bytes = size_t{8} << 30;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(Trainer trainer(c), std::invalid_argument);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1.0);
}

TEST(TrainConfigChecks, NegativeOrNonFiniteClipIsRefused) {
  for (const double clip : {-1.0, -1e-9, std::numeric_limits<double>::infinity(),
                            std::numeric_limits<double>::quiet_NaN()}) {
    TrainConfig c;
    c.optimizer.clip_norm = clip;
    EXPECT_THROW(c.validate(), std::invalid_argument) << clip;
  }
  TrainConfig off;
  off.optimizer.clip_norm = 0.0;
  EXPECT_NO_THROW(off.validate());
}

TEST(DataSources, FileSourceRefusesDevicesAndDirectories) {
  for (const char* path : {"/dev/zero", "/dev/null", "/"}) {
    try {
      FileSource source(path);
      FAIL() << path << " was accepted";
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.find("not a regular file") != std::string::npos ||
                  what.find("is a directory") != std::string::npos)
          << what;
    }
  }
}

TEST(DataSources, MarkovVocabAboveTheCapIsRefusedAtOnce) {
  for (const int64_t vocab : {MarkovSource::kMaxVocab + 1, int64_t{1} << 30}) {
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THROW(MarkovSource(vocab, 7), std::invalid_argument);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 0.1);
  }
}

}  // namespace
}  // namespace conveyor

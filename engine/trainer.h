#pragma once
// Single-device training: the global batch of each step is split into micro-batches whose
// gradients accumulate, the step's loss is the mean over all its tokens, and one optimizer
// step (with clipping by the global gradient norm) follows. The model runs as one Stage,
// the same object a pipeline cuts into several.
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "engine/data.h"
#include "engine/device_context.h"
#include "engine/optimizer.h"
#include "engine/stage.h"
#include "layers/model.h"

namespace conveyor {

struct TrainConfig {
  ModelConfig model;
  OptimizerConfig optimizer;
  int64_t steps = 200;
  int64_t batch_tokens = 4096;  // tokens per optimizer step (the global batch)
  int64_t microbatches = 4;
  uint64_t seed = 1;
  std::string data_path;        // empty: the synthetic Markov source
  std::string device = "auto";  // auto | cpu | cuda | cuda:N
  bool allow_tf32 = false;
  size_t memory_limit_bytes = 0;

  // Throws std::invalid_argument naming the first impossible setting.
  void validate() const;
};

// Training stopped because the loss or the gradient stopped being finite.
class TrainingDiverged : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct StepStats {
  int64_t step = 0;
  double loss = 0.0;
  int64_t tokens = 0;
  double seconds = 0.0;
  double lr = 0.0;
  double grad_norm = 0.0;
  size_t peak_bytes = 0;  // peak of live allocations on the device during the step
};

// The device a spec names; "auto" is the first GPU if one is usable, else the CPU. `note`
// receives a one-line explanation when a CUDA build falls back to the CPU.
Device resolve_device(const std::string& spec, std::string* note);

// The data source of a config: the file, or a Markov chain over the model's vocabulary.
std::unique_ptr<TokenSource> make_token_source(const TrainConfig& config);

class Trainer {
 public:
  Trainer(TrainConfig config, Device device);
  StepStats step();  // runs the next step

  int64_t steps_done() const { return steps_done_; }
  const TrainConfig& config() const { return config_; }
  TokenSource& source() { return *source_; }
  Stage& stage() { return *stage_; }
  Optimizer& optimizer() { return *optimizer_; }
  DeviceContext& context() { return *ctx_; }

 private:
  TrainConfig config_;
  std::unique_ptr<DeviceContext> ctx_;
  std::unique_ptr<TokenSource> source_;
  std::unique_ptr<Stage> stage_;
  std::unique_ptr<Optimizer> optimizer_;
  int64_t steps_done_ = 0;
};

}  // namespace conveyor

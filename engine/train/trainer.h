#pragma once
// Training: the global batch of each step is split into micro-batches whose gradients
// accumulate, the step's loss is the mean over all its tokens, and one optimizer step (with
// clipping by the global gradient norm) follows on every rank. The model is cut into
// pipeline stages run by the executor under a schedule; one stage on one device is the
// plain single-device case (schedule 1f1b with p = 1: F0 B0 F1 B1 ...).
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "engine/train/data.h"
#include "engine/core/device_context.h"
#include "engine/pipeline/executor.h"
#include "engine/pipeline/optimizer.h"
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

  // Pipeline: `stages` ranks, each with `chunks` virtual stages, under `schedule`
  // (gpipe | 1f1b | interleaved | zbh1) or the schedule in `schedule_file`; blocks per
  // stage from `partition` (uniform | params | explicit counts "3,5,5,3").
  int stages = 1;
  int chunks = 1;
  std::string schedule = "1f1b";
  std::string schedule_file;
  std::string partition = "uniform";
  // CUDA placement: one rank per GPU when there are enough GPUs, else all ranks share the
  // chosen GPU (each with its own streams). "shared" forces sharing.
  std::string placement = "auto";
  // How ranks exchange tensors: auto (NCCL when every rank has its own GPU, in-process
  // otherwise), inproc, or nccl.
  std::string transport = "auto";
  std::chrono::milliseconds transport_timeout{120000};

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
  size_t peak_bytes = 0;        // largest peak of live allocations over the ranks' devices
  PipelineStepResult pipeline;  // measured timeline, per-rank memory
};

// The device a spec names; "auto" is the first GPU if one is usable, else the CPU. `note`
// receives a one-line explanation when a CUDA build falls back to the CPU.
Device resolve_device(const std::string& spec, std::string* note);

// The schedule a config asks for: generated, or loaded from its file (then checked against
// the config's micro-batches).
schedule::Schedule make_schedule(const TrainConfig& config);

// The data source of a config: the file, or a Markov chain over the model's vocabulary.
std::unique_ptr<TokenSource> make_token_source(const TrainConfig& config);

class Trainer {
 public:
  Trainer(TrainConfig config, Device device);
  StepStats step();  // runs the next step

  int64_t steps_done() const { return steps_done_; }
  const TrainConfig& config() const { return config_; }
  TokenSource& source() { return *source_; }
  PipelineExecutor& executor() { return *executor_; }
  const std::vector<StageRange>& stage_ranges() const { return ranges_; }
  const std::vector<Device>& rank_devices() const { return devices_; }

 private:
  TrainConfig config_;
  std::unique_ptr<TokenSource> source_;
  std::vector<StageRange> ranges_;
  std::vector<Device> devices_;
  std::unique_ptr<PipelineExecutor> executor_;
  int64_t steps_done_ = 0;
};

}  // namespace conveyor

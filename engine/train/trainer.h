#pragma once
// Training: the global batch of each step is split into micro-batches whose gradients
// accumulate, the step's loss is the mean over all its tokens, and one optimizer step (with
// clipping by the global gradient norm) follows on every rank. The model — the reference
// model of a ModelConfig or any ModelDescription — is cut into pipeline stages run by the
// executor under a schedule; one stage on one device is the plain single-device case
// (schedule 1f1b with p = 1: F0 B0 F1 B1 ...). Data comes from a TokenSource: the caller's,
// or a built-in one (a file's bytes, or a Markov chain over the model's vocabulary).
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/device_context.h"
#include "engine/pipeline/executor.h"
#include "engine/pipeline/optimizer.h"
#include "engine/pipeline/partition.h"
#include "engine/pipeline/planner.h"
#include "engine/schedule/generators.h"
#include "engine/train/data.h"
#include "engine/train/run_limits.h"
#include "layers/model.h"

namespace conveyor {

// Where the ranks of a pipeline on CUDA live. kAuto: one rank per GPU (from the chosen one
// on) when there are enough GPUs, else all ranks share the chosen GPU, each with its own
// streams. kShared: always share. No effect on the CPU.
enum class RankPlacement : uint8_t { kAuto, kShared };

// PyTorch DDP's bucket_cap_mb: large enough that a bucket's latency is small next to its
// transfer, small enough that summing starts before the last gradients of a large stage.
inline constexpr double kDefaultGradientBucketMiB = 25.0;
// Beyond 10^6 MiB (about 1 TiB) a bucket holds any stage whole; below 1 KiB the latency each
// bucket pays would dwarf its transfer.
inline constexpr double kMaxGradientBucketMiB = 1e6;
inline constexpr double kMinGradientBucketMiB = 1.0 / 1024.0;

struct TrainConfig {
  // The reference model, when the trainer is not given a ModelDescription.
  ModelConfig model;
  OptimizerConfig optimizer;
  int64_t steps = 200;
  int64_t batch_tokens = 4096;  // tokens per optimizer step (the global batch)
  int64_t microbatches = 4;
  uint64_t seed = 1;             // of the weights and of the built-in Markov source
  std::string data_path;         // built-in source: bytes of this file; empty: Markov chain
  std::optional<Device> device;  // unset: the first usable GPU, else the CPU
  bool allow_tf32 = false;
  size_t memory_limit_bytes = 0;
  // Threads of each CPU rank's kernels; 0: all cores, shared between the ranks (at least 1
  // each). The bits of a run do not depend on it.
  int cpu_threads = 0;

  // Pipeline: `stages` ranks, each with `chunks` virtual stages, under `schedule`, or under
  // the schedule in `schedule_file` when that is set; blocks per stage from `partition`.
  int stages = 1;
  int chunks = 1;
  schedule::ScheduleKind schedule = schedule::ScheduleKind::k1F1B;
  std::string schedule_file;
  PartitionSpec partition;
  RankPlacement placement = RankPlacement::kAuto;
  TransportKind transport = TransportKind::kAuto;
  std::chrono::milliseconds transport_timeout{120000};
  // Units that re-run their forward in the backward instead of keeping its activations
  // (engine/pipeline/recompute.h); the bits of a run do not depend on it.
  RecomputeSpec recompute;

  // Data parallelism: `data_parallel` replicas of the pipeline (stages * data_parallel ranks;
  // rank r is pipeline rank r mod stages of replica r div stages), replica d training on the
  // d-th contiguous slice of microbatches / data_parallel micro-batches of each step, the
  // gradients of each stage summed over the replicas before the optimizer step.
  int data_parallel = 1;
  // ZeRO-1 with data_parallel > 1: each replica keeps the optimizer state of 1/D of every
  // stage's parameters (ExecutorOptions::shard_optimizer); the weights stay those of the
  // unsharded run. Each rank's checkpoint shard holds its part of the moments.
  bool shard_optimizer = false;
  // With data_parallel > 1: each stage's gradients are all-reduced in buckets of at most this
  // many MiB, ceil(stage gradient bytes / bucket bytes) of them (0, or a bucket at least as
  // large as the stage: one). Unset: kDefaultGradientBucketMiB for a generated schedule, and a
  // schedule file's own buckets; set with a schedule file, the file must agree. The bits of a
  // run do not depend on it.
  std::optional<double> gradient_bucket_mib;

  // Throws std::invalid_argument naming the first impossible setting. The reference model
  // is checked by ModelConfig::validate (the trainer of the reference model calls both).
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

// The device to run on: `requested` if it is usable, or, when unset, the first GPU if one
// is usable, else the CPU. `note` receives a one-line explanation when a CUDA build falls
// back to the CPU. Throws std::invalid_argument for a CUDA device that is not there.
Device resolve_device(const std::optional<Device>& requested, std::string* note = nullptr);

// CPU kernel threads for each of `ranks` ranks in one process: `requested`, or with 0 the
// machine's cores shared between the ranks (their threads run at once), at least one each.
int cpu_threads_per_rank(int requested, int ranks);

// Sets the layout of `config` to a pipelined candidate of a plan (plan(),
// engine/pipeline/planner.h; Plan::fastest_pipeline picks one): stages, schedule, chunks,
// micro-batches, blocks per stage and recomputation; a schedule file is dropped. A plan is of
// one pipeline: with config.data_parallel D > 1 it was planned for one replica's share of the
// batch (batch_tokens / D) and each replica runs the plan's micro-batches, D times as many in
// all. Throws std::invalid_argument for a candidate that is not a pipeline, one the planner
// rejected (saying why), or one whose partition does not fit its chunks.
void apply_plan(const PlanCandidate& candidate, TrainConfig& config);

// The schedule a config asks for: generated, or loaded from its file (then checked against
// the config's micro-batches).
schedule::Schedule make_schedule(const TrainConfig& config);

// Per stage of `ranges`: how many buckets of at most `bucket_mib` MiB its f32 gradients are
// all-reduced in (schedule::gradient_bucket_count; 0 MiB: one).
std::vector<int> gradient_buckets_per_stage(const ModelDescription& model,
                                            const std::vector<StageRange>& ranges,
                                            double bucket_mib);

// The built-in data source of a config for a model taking token ids in [0, vocab): the
// file's bytes, or a Markov chain over the vocabulary.
std::unique_ptr<TokenSource> make_token_source(const TrainConfig& config, int64_t vocab);
// The same, standing where `run` (such a source) stands: what follows the trained tokens, for
// held-out data. Restored from run's current token, so at once however far the run has gone.
std::unique_ptr<TokenSource> make_token_source_at(const TrainConfig& config, int64_t vocab,
                                                  const TokenSource& run);

// Refuses, with the estimate and what is available, a run whose parameters, gradients,
// optimizer state, in-flight activations, step inputs, boundary tensors and workspace
// (estimate_rank_memory, engine/pipeline/memory_estimate.h) exceed, on
// some device, config.memory_limit_bytes or the device's free memory, whichever is smaller
// (a limit emulates a smaller device, never a larger one). The trainer calls
// it before allocating anything. Throws std::invalid_argument. `one_device_per_process`:
// every rank runs in a process of its own on a GPU of its own (NCCL over MPI), so no two
// ranks share a device, whatever their entries in `devices` say.
void check_memory_fits(const ModelDescription& model, const std::vector<StageRange>& ranges,
                       const schedule::Schedule& schedule, const std::vector<Device>& devices,
                       const TrainConfig& config, bool one_device_per_process = false);

// Trainer::evaluate stopped by the executor's stop request; `signal()` is what it gave.
class EvaluationStopped : public std::runtime_error {
 public:
  explicit EvaluationStopped(int signal)
      : std::runtime_error("evaluation stopped by signal " + std::to_string(signal)),
        signal_(signal) {}
  int signal() const { return signal_; }

 private:
  int signal_;
};

class Trainer {
 public:
  // The reference model of config.model.
  explicit Trainer(TrainConfig config, std::shared_ptr<TokenSource> source = nullptr);
  // Any model; config.model is not used. Without a `source`, the built-in one needs the
  // description's vocab.
  Trainer(ModelDescription model, TrainConfig config,
          std::shared_ptr<TokenSource> source = nullptr);

  // Runs the next step. The batch's ids are checked against the model's vocab first
  // (std::invalid_argument, nothing run). A step that fails once it has started (a
  // PipelineError, a transport error) leaves the trainer unusable: step() and evaluate()
  // then throw std::logic_error saying so. A diverged step (TrainingDiverged) applied no
  // update and leaves it usable.
  StepStats step();

  // Mean loss per token over `batches` global batches drawn from `source` (held-out data),
  // each split into the config's micro-batches. Forward only: no backward, no update,
  // gradients and optimizer state untouched. Each rank of the pipeline runs the forward of
  // its stages, micro-batch by micro-batch, on a thread of its own (in one process) or in
  // its process (under MPI), passing activations to the next stage's rank over the
  // transport, so the stages overlap as a forward-only pipeline (no schedule is needed: a
  // forward pass has no backward to interleave). On the CPU the loss is bitwise the loss
  // that step() would report for the same batch. Replica 0's ranks evaluate; other
  // replicas' ranks do no work. A failure on one rank aborts the transport and is the error
  // that comes out.
  //
  // When the ranks are processes (MPI) this is a collective: every process calls it, at the
  // same point of the run, with the same batches. Each runs the stages it holds and passes
  // activations to the next stage's process over the transport; the last stage's process
  // adds the losses and one sum over all processes shares them, so every process returns
  // the same value, bit for bit the one a single process gives. A failure aborts the
  // transport, so every process ends with an error (comm::TransportError on the others).
  //
  // The batches are drawn and run at most `tokens_at_once` tokens at a time (at least one
  // batch), so that host memory for the ids does not grow with `batches`; the value is bit
  // for bit the same whatever it is. Between two such groups the executor's stop request
  // (PipelineExecutor::set_stop_request) is asked, on every process at the same point, and
  // when it asks on any, every process throws EvaluationStopped with the signal of the
  // lowest one asked: a long evaluation ends on a signal as a step does.
  static constexpr int64_t kEvaluationTokensAtOnce = int64_t{1} << 20;
  double evaluate(TokenSource& source, int64_t batches = 1,
                  int64_t tokens_at_once = kEvaluationTokensAtOnce);
  // The same over given micro-batches (any number, any sizes; under MPI the same on every
  // process).
  double evaluate(const std::vector<MicroBatchData>& microbatches);

  int64_t steps_done() const { return steps_done_; }
  // Empty while the trainer is usable; once a step or an evaluation has failed after it
  // started, what failed (step() and evaluate() then refuse with std::logic_error).
  const std::string& failure() const { return failure_; }
  // After restoring a checkpoint of `steps_done` steps: the next step() runs steps_done + 1.
  void resume_at(int64_t steps_done);
  // A save on request (e.g. on a signal, between steps), by whatever the caller installed
  // (engine/train/trainer_checkpoint.h installs one); without a handler it does nothing.
  void set_save_handler(std::function<void()> handler) { save_handler_ = std::move(handler); }
  void save_now() {
    if (save_handler_) save_handler_();
  }
  const TrainConfig& config() const { return config_; }
  const ModelDescription& model() const { return model_; }
  Device device() const { return device_; }
  TokenSource& source() { return *source_; }
  PipelineExecutor& executor() { return *executor_; }
  const std::vector<StageRange>& stage_ranges() const { return ranges_; }
  const std::vector<Device>& rank_devices() const { return devices_; }

 private:
  void build();  // everything after the model, config and source are set
  std::vector<MicroBatchData> draw_batch(TokenSource& source) const;
  // This process's sum of the token losses of `microbatches`, added after `start` in
  // micro-batch order on the process that holds the last stage (0.0 on the others); the ids
  // checked first, and a failure of the forward recorded in failure_.
  double local_loss_sum(const std::vector<MicroBatchData>& microbatches, double start);
  double forward_loss_sum(const std::vector<MicroBatchData>& microbatches, double start);
  // Throws std::logic_error, saying what failed, once a step or an evaluation has failed.
  void check_usable(const char* action) const;
  // Throws std::invalid_argument for an id outside the model's vocabulary (a target may be
  // the ignored one), naming the micro-batch and position.
  void check_token_ids(const std::vector<MicroBatchData>& microbatches) const;
  // The executor's stop request, agreed over the processes (a collective under MPI): the
  // signal of the lowest process asked, or 0.
  int agreed_stop_request();

  ModelDescription model_;
  TrainConfig config_;
  Device device_;
  std::shared_ptr<TokenSource> source_;
  std::vector<StageRange> ranges_;
  std::vector<Device> devices_;
  std::unique_ptr<PipelineExecutor> executor_;
  int64_t steps_done_ = 0;
  std::function<void()> save_handler_;
  // What failed in a step or an evaluation, which leaves the executor with micro-batches in
  // flight and its transports aborted; empty while the trainer is usable.
  std::string failure_;
};

}  // namespace conveyor

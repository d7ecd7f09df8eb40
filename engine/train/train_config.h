#pragma once
// What a training run is asked to be (TrainConfig) and what follows from it before any
// weight exists: its device, schedule, gradient buckets, built-in data source, threads, and
// the check that it fits in memory. The trainer (trainer.h) builds its run from these.
#include <cstdint>
#include <memory>
#include <optional>
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
  // Threads of each CPU rank's kernels, at most kMaxCpuThreads; 0: all cores, shared between
  // the ranks (at least 1 each). The bits of a run do not depend on it.
  static constexpr int kMaxCpuThreads = DeviceContextOptions::kMaxCpuThreads;
  int cpu_threads = 0;

  // Pipeline: `stages` ranks, each with `chunks` virtual stages, under `schedule`, or under
  // the schedule in `schedule_file` when that is set (which decides all three: each left at
  // its default or equal to the file's); blocks per stage from `partition`.
  // kInterleaved with chunks 1 is 1F1B (the command line gives it 2 unless told); kZBV always
  // has 2 chunks per rank, with chunks 1 or 2. The other kinds take chunks 1.
  int stages = 1;
  int chunks = 1;
  schedule::ScheduleKind schedule = schedule::ScheduleKind::k1F1B;
  std::string schedule_file;
  PartitionSpec partition;
  RankPlacement placement = RankPlacement::kAuto;
  TransportKind transport = TransportKind::kAuto;
  // How long a rank waits for a peer before failing: 1 ms to kMaxTransportTimeoutMs.
  std::chrono::milliseconds transport_timeout{120000};
  static constexpr int64_t kMaxTransportTimeoutMs = ExecutorOptions::kMaxTransportTimeoutMs;
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

// The device to run on: `requested` if it is usable, or, when unset, the first GPU if one
// is usable, else the CPU. `note` receives a one-line explanation when a CUDA build falls
// back to the CPU. Throws std::invalid_argument for a CUDA device that is not there.
Device resolve_device(const std::optional<Device>& requested, std::string* note = nullptr);

// CPU kernel threads for each of `ranks` ranks in one process: `requested`, or with 0 the
// machine's cores shared between the ranks (their threads run at once), at least one each.
// Throws std::invalid_argument for fewer than 1 rank or a negative request.
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

// Gives a schedule of several replicas its gradient all-reduce buckets: a generated one
// those of config.gradient_bucket_mib (or the default size); a schedule file keeps its own,
// which must hold at most one bucket per gradient element and, when a size is given too,
// agree with it. Throws std::invalid_argument naming the stage.
void set_gradient_buckets(schedule::Schedule& sched, const ModelDescription& model,
                          const std::vector<StageRange>& ranges, const TrainConfig& config);

// The built-in data source of a config for a model taking token ids in [0, vocab): the
// file's bytes, or a Markov chain over the vocabulary.
std::unique_ptr<TokenSource> make_token_source(const TrainConfig& config, int64_t vocab);
// The same, standing where `run` (such a source) stands: what follows the trained tokens, for
// held-out data. Restored from run's current token, so at once however far the run has gone;
// a FileSource is copied, sharing the bytes run read whatever the file holds now.
std::unique_ptr<TokenSource> make_token_source_at(const TrainConfig& config, int64_t vocab,
                                                  const TokenSource& run);
// Held-out data of a run of the built-in source: tokens that none of its config.steps
// training batches gives, the same whenever it is made, so that every evaluation of a run
// (and of the runs that resume it) measures the same batches. For the file, those after the
// config.steps training batches (the caller checks the file holds as many as it evaluates:
// beyond its end the source wraps onto training data); for the Markov chain, the same chain
// on a walk of its own (MarkovSource::Walk::held_out), from its first state. `run`: the run's
// source, whose file bytes a FileSource shares, whatever the file holds now.
std::unique_ptr<TokenSource> make_held_out_source(const TrainConfig& config, int64_t vocab,
                                                  const TokenSource& run);

// The memory the ranks on `device` may use together: `memory_limit_bytes` (0: none) or what
// the device can give now (its free memory on CUDA, MemAvailable on the CPU), whichever is
// smaller, since a limit emulates a smaller device, never a larger one. check_memory_fits
// holds a run to it, and a planner plans against it, so that the run's check takes every
// layout planned. `bytes` is 0 when neither is known. `source` says where the figure comes
// from ("the memory limit", "free memory of cuda:0", ...), and `note` what it is less than
// when a limit was given above it (", less than the memory limit (8.0 GiB)"), else empty.
struct DeviceMemoryLimit {
  double bytes = 0;
  std::string source;
  std::string note;
};
DeviceMemoryLimit device_memory_limit(Device device, size_t memory_limit_bytes);

// Bytes that a rank's context on `device` takes from its allocator, and so from its cap,
// before the first step, outside what estimate_rank_memory counts: on CUDA its cuBLASLt
// workspace (DeviceContextOptions::cublas_workspace_bytes, which the trainer leaves at its
// default), nothing on the CPU.
double rank_context_bytes(Device device);

// How many of a run's `ranks` ranks (every replica's) on devices of `device`'s kind share one
// device's memory, as check_memory_fits counts them, which a planner divides that memory (or
// the cap) by: 1 where each rank has a GPU of its own, which it has when there are
// `cuda_devices` >= `ranks`, and under a launcher (`one_rank_per_process`: NCCL over MPI,
// one process per rank, each on the GPU it was given, which holds the cap for that rank
// alone); else all of them. CPU ranks as processes share the machine's memory as far as one
// process can tell, while each holds the cap for its own rank: the planner takes the cap as
// it is there (tools/plan_training.cpp).
int ranks_sharing_device_memory(Device device, int ranks, int cuda_devices,
                                bool one_rank_per_process);

// What a planner may plan each rank's stages against, so that check_memory_fits takes every
// layout it plans: `memory` bytes (> 0; a cap, or the device's memory) of `device` shared
// equally by the `sharing` ranks on it, less each rank's context (rank_context_bytes).
// `source` is `memory_source` (where the memory and its sharing come from, as the caller
// says them), with what was subtracted added. Throws std::invalid_argument when a rank's
// equal share cannot hold its context with some room to spare, naming the figures.
struct RankMemoryShare {
  double bytes = 0;
  std::string source;
};
RankMemoryShare rank_memory_share(double memory, int sharing, Device device,
                                  const std::string& memory_source);

// Refuses, with the estimate and what is available, a run whose parameters, gradients,
// optimizer state, in-flight activations, step inputs, boundary tensors and workspace
// (estimate_rank_memory, engine/pipeline/memory_estimate.h; on a CUDA device also each
// rank's context, rank_context_bytes) exceed, on
// some device, config.memory_limit_bytes or the device's free memory, whichever is smaller
// (a limit emulates a smaller device, never a larger one). The trainer calls
// it before allocating anything. Throws std::invalid_argument. `one_device_per_process`:
// every rank runs in a process of its own on a GPU of its own (NCCL over MPI), so no two
// ranks share a device, whatever their entries in `devices` say. `one_rank_per_process`:
// every rank runs in a process of its own (MPI), whose allocators hold the limit for that
// rank alone; ranks on one device still share the memory it can give.
void check_memory_fits(const ModelDescription& model, const std::vector<StageRange>& ranges,
                       const schedule::Schedule& schedule, const std::vector<Device>& devices,
                       const TrainConfig& config, bool one_device_per_process = false,
                       bool one_rank_per_process = false);

}  // namespace conveyor

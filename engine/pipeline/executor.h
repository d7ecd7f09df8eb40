#pragma once
// The pipeline executor: runs a validated schedule IR for real. Each rank is a thread with
// its own device context (CPU, or a CUDA device possibly shared with other ranks), its
// stages, its optimizer and its transport endpoint. A rank runs its action list as the three
// in-order streams of docs/execution-model.md: compute (F, B, I, W) on its compute stream,
// sends on its send stream, receives on its receive stream, CUDA events ordering them. The
// host runs whichever stream's head can start and waits only when none can, for the message
// of the receive head (with NCCL never: a receive is only enqueued), so every schedule the
// validator accepts runs to the end. Activations are released as soon as the last action
// that needs them is done; the caching allocator's stream-ordered reuse makes that safe.
//
// With a transport that spans processes (MPI), each process holds one rank (its stages,
// optimizer and transport endpoint) and run_step runs that rank alone; the all-reduce still
// goes over the transport, so every process gets the global loss and norm.
//
// Data parallelism (schedule.replicas = D > 1): P*D ranks, rank r being pipeline rank r mod P
// of replica r div P; every replica runs the same lists on its own contiguous slice of the
// step's micro-batches (replica d the d-th m of the D*m), and each ALLREDUCE_GRAD sums its
// stage's gradients over the D replicas (Transport::start_group_sum, in replica order), on a
// reduction stream of the rank's own, so every replica steps identical weights.
//
// After the last action, each rank contributes its per-micro-batch losses and per-parameter
// squared gradient norms to one all-reduce (slots indexed by global parameter order), so
// every rank sums them in the same order as the one-stage run: the clipping factor and the
// loss are bitwise those of a single device. Each rank then steps its own parameters.
//
// The pieces: comm/transport_factory.h chooses and builds the transports, rank_step.h runs
// one rank's step, engine/schedule/measured_timing.h turns the measured timeline into the
// simulator's terms.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/transport.h"
#include "comm/transport_factory.h"
#include "engine/core/device_context.h"
#include "engine/pipeline/optimizer.h"
#include "engine/pipeline/partition.h"
#include "engine/pipeline/rank_threads.h"
#include "engine/pipeline/recompute.h"
#include "engine/pipeline/stage.h"
#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"
#include "layers/model.h"

namespace conveyor {

// How ranks exchange tensors (comm/transport_factory.h says how kAuto chooses).
using TransportKind = comm::TransportKind;

struct ExecutorOptions {
  TransportKind transport = TransportKind::kAuto;
  // How long a rank waits for a peer (transfer or all-reduce) before the run fails: from 1 ms
  // to kMaxTransportTimeoutMs.
  std::chrono::milliseconds transport_timeout{120000};
  static constexpr int64_t kMaxTransportTimeoutMs = comm::kMaxTimeoutMs;
  // Every rank's context. Its memory_limit_bytes caps each device: the ranks this process
  // holds on one device share the cap (MemoryBudget), each rank's allocator named "rank r".
  DeviceContextOptions device_options;
  // Units whose forward is re-run in the backward instead of keeping what it saves.
  RecomputeSpec recompute;
  // Data parallelism only (ZeRO-1): each replica keeps the optimizer state of 1/D of every
  // stage's parameters (a contiguous range of the stage's flattened parameters), updates that
  // range after the gradient all-reduce, and the replicas then gather each other's ranges, so
  // the weights are those of the unsharded run.
  bool shard_optimizer = false;
  // Data parallelism: a rank starts each gradient all-reduce bucket as soon as its stage's
  // gradients are final, so several may be in flight. This bounds their bytes (of f32
  // gradients), except that two may always be in flight whatever their size (one summed
  // while the next is packed and queued). Each bucket in flight holds a host copy of its
  // values, and over NCCL device staging of D + 1 times them for a sum: the bound keeps that
  // staging small next to the gradients. Ranks need not agree on it: it changes when calls
  // start, not their order. The default lets four of the default 25 MiB buckets go at once,
  // and every bucket of a smaller stage.
  size_t bucket_bytes_in_flight = kDefaultBucketBytesInFlight;
  static constexpr size_t kDefaultBucketBytesInFlight = size_t{100} << 20;
};

// One micro-batch of the step, on the host.
struct MicroBatchData {
  std::vector<int32_t> tokens;
  std::vector<int32_t> targets;
};

struct PipelineStepResult {
  double loss_sum = 0.0;   // Σ of token losses over the step
  double grad_norm = 0.0;  // global, before clipping
  bool diverged = false;   // loss or norm not finite: no update was applied
  // What the stop request (PipelineExecutor::set_stop_request) gave on the lowest rank where
  // it was not 0, or 0: the same on every rank and process, since the step's all-reduce
  // carries it.
  int stop_signal = 0;
  double seconds = 0.0;
  // Measured timeline of every rank (all P*D, replica d's pipeline rank r at d*P + r, each
  // parallel to its list of Schedule::ranks), in microseconds from the step start; the first
  // P are replica 0's, which schedule::replica_timeline cuts out for the one-replica summaries.
  // Under a transport that spans processes only the ranks this process holds, until
  // PipelineExecutor::gather_timing.
  std::vector<std::vector<schedule::ActionTiming>> timing;
  // Per rank (all P*D): peak bytes of activations held by its stages (allocator-measured,
  // excluding tensors in transit), and peak of all live allocations: every rank's, under a
  // transport that spans processes too (gathered at the end of the step).
  std::vector<size_t> peak_activation_bytes;
  std::vector<size_t> peak_allocated_bytes;
};

struct PipelineRank;  // what one rank owns (rank_step.h)
struct RankPosition;  // where a rank stood in a failed step (rank_progress.h)

// A rank failed: names the rank, the action and the cause on the first line. When the step
// failed on a transport (a wait passed its deadline, a link was lost or aborted), the lines
// after it draw the rank x list-position grid with each rank's position marked, this
// process's ranks only, and say what each waits on.
class PipelineError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The replicas of a data-parallel run do not hold the same weights (check_replicas_agree):
// their gradient sums or optimizer steps went apart, which the run must not hide.
class ReplicasDiffer : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A 64-bit value (a digest, a checksum) as two 32-bit halves in `slots`, each exact in a
// double, so that PipelineExecutor::sum_over_processes gathers it unchanged from the one
// process that writes it (the others leave zeros); and the value back.
inline void put_u64_in_doubles(uint64_t value, double* slots) {
  slots[0] = static_cast<double>(value >> 32);
  slots[1] = static_cast<double>(value & 0xffffffffu);
}
inline uint64_t u64_from_doubles(const double* slots) {
  return static_cast<uint64_t>(slots[0]) << 32 | static_cast<uint64_t>(slots[1]);
}

class PipelineExecutor {
 public:
  // `ranges[s]` are the units of virtual stage s; `devices[r]` the device of rank r, for the
  // P*D ranks of the schedule's D replicas.
  PipelineExecutor(const ModelDescription& model, schedule::Schedule schedule,
                   std::vector<StageRange> ranges, std::vector<Device> devices,
                   const OptimizerConfig& optimizer, uint64_t seed, ExecutorOptions options = {});
  ~PipelineExecutor();
  PipelineExecutor(const PipelineExecutor&) = delete;
  PipelineExecutor& operator=(const PipelineExecutor&) = delete;

  // Runs the schedule over `microbatches` (all of the same size; D*m of them with D
  // replicas), with per-token loss gradient `loss_scale`; then, when `update`, the optimizer
  // step `step` at rate `lr`. Throws std::invalid_argument, before any rank starts, for a rate
  // that is NaN, infinite or negative, a step below 1, or a loss scale that is not finite.
  PipelineStepResult run_step(const std::vector<MicroBatchData>& microbatches, float loss_scale,
                              int64_t step, double lr, bool update = true);

  // With a transport that spans processes, each process measured the timeline of the ranks
  // it holds only: this fills `result.timing` with every rank of every replica. A collective:
  // every process calls it with the result of the same step. Each rank's timeline counts
  // from its own process's start of the step; the processes start a step together, after
  // the previous step's global sum, so they differ by that sum's exit skew, which
  // schedule::align_to_transfers then takes out as far as the transfers show it. Nothing to
  // do when this process holds every rank.
  void gather_timing(PipelineStepResult& result);
  // With a transport that spans processes: the element-wise sum of `values` over the
  // processes, added in rank order, so an element that one process alone sets (the others
  // give 0) is gathered exactly. A collective: every process calls it at the same point of
  // the run, from the thread that runs the steps. Nothing to do when this process holds
  // every rank.
  void sum_over_processes(std::vector<double>& values);
  // Data parallelism: checks that every replica holds bitwise the weights of replica 0, stage
  // by stage (an XXH3 digest of each stage's parameters, compared over the transport), and
  // throws ReplicasDiffer naming the first replica and stage that do not. A collective under
  // a transport that spans processes, as sum_over_processes. Nothing to do with one replica.
  void check_replicas_agree();

  // Asked by every rank during each step's all-reduce: a nonzero value (a signal number)
  // asks the run to stop after this step. It travels with the losses, so every process
  // learns in the same step whether any of them was asked, with no extra collective (a
  // process stopping alone would leave the others waiting in the next step). Called from
  // the rank threads at once: it must be thread-safe. Null: never.
  void set_stop_request(std::function<int()> request) { stop_request_ = std::move(request); }
  // What the stop request gives now, asked from the calling thread; 0 when none is set.
  int stop_requested() const { return stop_request_ ? stop_request_() : 0; }

  const schedule::Schedule& schedule() const { return schedule_; }
  // Pipeline ranks P (of one replica). The ranks of replica 0 are 0..P-1, so the accessors
  // below that take a pipeline rank or a stage reach replica 0.
  int num_ranks() const { return schedule_.num_ranks(); }
  int num_replicas() const { return schedule_.replicas; }
  int num_world_ranks() const { return num_ranks() * num_replicas(); }
  DeviceContext& context(int rank);
  // The ranks this process holds: all of them, or, with a transport that spans processes
  // (MPI), the one rank of this process. The accessors below that take a rank, or a stage,
  // throw std::invalid_argument for one held by another process.
  std::vector<int> local_ranks() const;
  bool holds_all_ranks() const { return static_cast<int>(ranks_.size()) == num_world_ranks(); }
  // Every parameter of the model in global order, from replica 0 (null where another process
  // holds it).
  std::vector<Parameter*> parameters();
  // Parameters and optimizers per rank, 0..P*D-1 (checkpoints use replica 0's, 0..P-1).
  std::vector<Parameter*> rank_parameters(int rank);
  Optimizer& optimizer(int rank);
  // Bytes the rank's optimizer state took from its allocator when it was made.
  size_t optimizer_state_bytes(int rank) const;
  // Virtual stage `stage`, on the rank the schedule places it (forward-only evaluation).
  Stage& stage(int stage);
  // The transport endpoint of a rank held here, for work outside run_step that moves
  // tensors between processes in an order every process follows (forward-only evaluation).
  // Not to be used while a step runs: its messages would interleave with the step's.
  comm::Transport& transport(int rank);

  // The transport chosen at construction (kAuto resolved).
  TransportKind transport_kind() const { return transport_kind_; }
  bool uses_nccl() const {
    return transport_kind_ == TransportKind::kNccl ||
           transport_kind_ == TransportKind::kNcclOverMpi;
  }
  // Replaces the transport of every rank held here, in local_ranks() order (tests inject
  // faults through this).
  void set_transports(std::vector<std::unique_ptr<comm::Transport>> transports);

 private:
  PipelineRank& held(int rank) const;
  // After a step stalled on a transport: the ranks' positions (rank_progress.h), for the
  // error of the held rank at position `failed`.
  std::string format_positions(int failed, const std::vector<RankPosition>& others) const;
  // After a step stalled on a transport that spans processes: the positions the other
  // processes' ranks report to rank 0's process (nothing elsewhere, and from ranks that
  // are dead or stopped).
  std::vector<RankPosition> positions_of_other_processes();

  ModelDescription model_;
  schedule::Schedule schedule_;
  TransportKind transport_kind_ = TransportKind::kInProcess;
  std::vector<StageRange> ranges_;
  int total_parameters_ = 0;
  std::chrono::milliseconds transport_timeout_{0};
  std::function<int()> stop_request_;
  std::vector<std::unique_ptr<PipelineRank>> ranks_;
  std::unique_ptr<RankThreads> threads_;  // last: joined before the ranks go
};

}  // namespace conveyor

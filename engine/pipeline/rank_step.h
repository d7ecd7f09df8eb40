#pragma once
// Internal to the executor: what one rank owns (PipelineRank), and one training step of one
// rank (RankStep), run as the execution model's three in-order streams over the rank's list
// (docs/execution-model.md). executor.h is the public surface.
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "comm/transport.h"
#include "engine/core/device_context.h"
#include "engine/pipeline/executor.h"
#include "engine/pipeline/handoffs.h"
#include "engine/pipeline/optimizer.h"
#include "engine/pipeline/rank_progress.h"
#include "engine/pipeline/stage.h"
#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"
#ifdef CONVEYOR_WITH_CUDA
#include "engine/core/cuda_device_guard.h"
#endif

namespace conveyor {

// Makes a CUDA rank's device current for a scope (kernels launch on the current device) and
// gives the thread its previous device back afterwards; nothing to do for a CPU rank.
class OnDevice {
 public:
  explicit OnDevice(Device device) {
#ifdef CONVEYOR_WITH_CUDA
    if (device.is_cuda()) guard_.emplace(device.index);
#else
    (void)device;
#endif
  }

 private:
#ifdef CONVEYOR_WITH_CUDA
  std::optional<detail::CudaDeviceGuard> guard_;
#endif
};

// What one rank owns: its device context, streams, stages (by virtual stage id), optimizer,
// transport endpoint, and the events that time and order its actions.
struct PipelineRank {
  int index = 0;                   // among all P*D ranks: the transport's rank
  int pipeline_rank = 0;           // index mod P: whose list of the schedule it runs
  int replica = 0;                 // index div P
  std::vector<int> replica_group;  // the ranks holding the same stages: pipeline_rank + d*P
  std::unique_ptr<DeviceContext> ctx;
  // Staging of a CUDA rank's token ids in host memory. Not under the run's memory cap, as the
  // memory estimate leaves it out too: the cap emulates a smaller device, and these blocks are
  // the host's (a CPU rank stages its ids through its context's capped allocator instead).
  std::shared_ptr<CachingAllocator> host_allocator = make_cpu_allocator();
  std::unique_ptr<Stream> send_stream, recv_stream;
  std::map<int, std::unique_ptr<Stage>> stages;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<comm::Transport> transport;
  std::vector<int> global_index;  // of each of this rank's parameters, in rank order
  // Sharded optimizer state: per stage (in `stages` order), where each replica's range starts
  // in the stage's packing by replica (packed_shard_bounds), and the end.
  std::vector<std::vector<size_t>> shard_bounds;
  size_t optimizer_state_bytes = 0;
  // The bound on the all-reduce buckets in flight at once (ExecutorOptions).
  size_t bucket_bytes_in_flight = 0;
  RankProgress progress;  // where the rank's current step stands, for a stalled run's report
  // CUDA: start/end timing events per action, one ordering event per action (recorded after
  // a receive, or after a compute whose output a send takes), and the step's reference event.
  std::vector<Event> starts, ends, order;
  std::unique_ptr<Event> reference;

  std::vector<Parameter*> parameters();
};

// A stage's parameters packed by replica, for the reduce-scatter and the gather: replica 0's
// pieces of every parameter in order, then replica 1's, and so on, so that each replica's
// elements are one range. Returns where each replica's range starts, and the end.
std::vector<size_t> packed_shard_bounds(const std::vector<Parameter*>& params, int replicas);

// A run of one parameter's gradient elements [offset, offset + count) at position `at` of its
// stage's flattened gradients (in parameter order, or packed by replica when the optimizer is
// sharded), which the all-reduce buckets cut into ranges.
struct GradientSegment {
  Parameter* parameter = nullptr;
  int64_t offset = 0, count = 0;
  size_t at = 0;
};

// What every rank of one step reads.
struct StepInputs {
  const schedule::Schedule& schedule;
  const std::vector<MicroBatchData>& microbatches;  // all replicas', replica d's at d*m
  float loss_scale = 1.0f;
  const ModelDescription& model;          // the shape of the tensors sent between stages
  const std::vector<StageRange>& ranges;  // units of each virtual stage
  int total_parameters = 0;               // of the whole model: the all-reduce's parameter slots
  int64_t step = 0;                       // optimizer step, 1-based
  double lr = 0.0;
  bool update = true;  // false: gradients and norms only, no optimizer step
  std::chrono::steady_clock::time_point start;  // of the step, for the timeline
  int reporting_rank = 0;  // fills the step's totals: the first rank this process holds
  // Under a transport across processes (one rank per process): the ranks' memory peaks are
  // summed over all of them at the end of the step, so every process reports every rank's.
  bool gather_peaks = false;
  const std::function<int()>* stop_request = nullptr;  // PipelineExecutor::set_stop_request
};

// One step of one rank. Throws what an action threw, wrapped (std::throw_with_nested) in a
// PipelineError naming the rank, the action index and the action.
//
// The host keeps the heads of the rank's three streams (compute, send, receive), each going
// through its kind of action in list order, and runs whichever can start: sends whose tensor
// has been produced, receives whose message has arrived (ahead of the computes, at most one
// per stage and direction: may_receive), computes whose inputs are there.
// Only when none can start does it wait, for the message of the receive head, up to the
// transport's deadline. Computes run in list order, so the arithmetic is that of a list walk.
class RankStep {
 public:
  RankStep(PipelineRank& rank, const StepInputs& in);
  // Zeroes the gradients, uploads the ids, runs every action of the rank, then the end of the
  // step; fills the rank's entries of `result` (the reporting rank also the step's totals).
  void run(PipelineStepResult& result);

 private:
  using Action = schedule::Action;

  void begin();
  void run_actions();
  // Runs action i, timed, with the memory sampled after it. Returns false, having run
  // nothing, only for a receive whose message has not arrived when `wait` is false.
  bool run_action(size_t i, bool wait);
  bool inputs_ready(const Action& compute) const;
  // Whether receive i may complete with the compute stream's head at `compute_head`: always
  // once every compute listed before it has run; ahead of that only while no other message
  // of its stage and direction is, so a rank that falls behind its peers takes at most one
  // message per stage and direction ahead of its list (what the memory model counts) and the
  // others wait in the transport, outside its allocator. Never what a compute waits for: the
  // head's inputs come from receives listed before it.
  bool may_receive(size_t i, size_t compute_head) const;
  bool produced(const Action& send) const;
  [[noreturn]] void fail_stuck(size_t i) const;

  void forward(size_t i, const Action& a, Stage& stage);
  void backward(size_t i, const Action& a, Stage& stage);  // B, or I when the backward is split
  void backward_weight(const Action& a, Stage& stage);
  void send(size_t i, const Action& a);
  bool recv(size_t i, const Action& a, bool wait);
  // The reduction stream: the gradient all-reduce of a stage over the replicas.
  // Each ALLREDUCE_GRAD sums one bucket of its stage's flattened gradients
  // (schedule::gradient_bucket). A bucket starts, in list order, as soon as its stage's
  // gradients are final and the bound on the bytes in flight lets it; the buckets in flight
  // finish in the order they started.
  bool weight_grads_done(const Action& reduce, size_t compute_head) const;
  // Whether the bucket of all-reduce `reduce` may start beside those in flight: fewer than
  // two are, or it fits the rank's bound with them.
  bool may_start_reduce(const Action& reduce);
  // The stage's flattened gradients as segments of its parameters, made at its first bucket
  // and kept for the step's others (the parameters do not change within a step).
  const std::vector<GradientSegment>& gradient_layout(int stage);
  schedule::BucketRange bucket_of(const Action& reduce,
                                  const std::vector<GradientSegment>& layout) const;
  void pack_bucket(const Action& reduce, std::vector<float>& values);
  void start_reduce(size_t i, const Action& a);
  // Copies the sum of the oldest bucket in flight back into the gradients, once it is there.
  void finish_oldest_reduce();
  int world_rank(int pipeline_peer) const;
  void finish_transfers();
  // Where each replica's range of `stage` starts in its packing by replica, and the end.
  const std::vector<size_t>& shard_bounds_of(int stage) const;
  // Sharded optimizer: every replica's updated range of each stage's weights, to all.
  void gather_weights();
  // The squares of this replica's piece of each of its parameters' gradients, in the slots
  // of `reduced` from `first_slot` on: parameter g's piece d at first_slot + g * D + d.
  void piece_squares(std::vector<double>& reduced, size_t first_slot);
  void end_of_step(PipelineStepResult& result);

  const Stream& stream_for(const Action& a) const;
  Stage& stage_of(const Action& a);
  // A handoff for the compute stream: a tensor received on another stream is waited for.
  Tensor take_for_compute(Handoffs::Kind kind, int stage, int mb, const Action& a);
  // The event a send of compute i's output waits for (CUDA; null on the CPU), recorded now,
  // right after the compute: a send issued later must not wait for computes enqueued since.
  Event* ready_for_send(size_t i);
  bool on_this_rank(int stage) const;
  void sample_memory();
  // Action i ran on the host from `start` until now: its timing on a CPU rank (a CUDA rank's
  // comes from its events at the end of the step).
  void time_on_host(size_t i, std::chrono::steady_clock::time_point start);

  PipelineRank& rank_;
  const StepInputs& in_;
  DeviceContext& ctx_;
  const bool cuda_;
  Stream& compute_;
  Stream& send_;
  Stream& recv_;
  const std::vector<Action>& actions_;
  const int last_stage_;
  const int m_;         // micro-batches per replica
  const int first_mb_;  // of this replica's, in the step's
  const int64_t n_;     // tokens per micro-batch

  Tensor tokens_, targets_;  // [m, n] ids, where the first / last stage lives
  Handoffs handoffs_;
  // The list position of the last receive completed, per (stage, received kind).
  std::map<std::pair<int, schedule::ActionKind>, size_t> last_received_;
  std::vector<Tensor> losses_;  // per micro-batch, on the last stage
  size_t loss_bytes_ = 0;
  size_t baseline_bytes_ = 0;  // allocated before the first action
  size_t peak_activations_ = 0;
  double reference_us_ = 0;  // host time of the reference event, from the step start
  std::vector<schedule::ActionTiming> timing_;
  std::vector<std::pair<int, size_t>> last_weight_grad_;  // (stage, position in the list)
  // An all-reduce bucket in flight: its part of the stage's gradients, flat on the host in
  // parameter order, or packed by replica when the optimizer is sharded, which sums only this
  // replica's range (a reduce-scatter, `bounds` its ranges in the bucket); the transport's
  // call, which holds `values` until it is done; and when it started.
  struct BucketInFlight {
    size_t action = 0;  // its position in the list
    std::vector<float> values;
    std::vector<size_t> bounds;
    std::unique_ptr<comm::PendingGroupCall> call;  // after what it holds: destroyed first
    std::chrono::steady_clock::time_point start{};
  };
  // In start order, which is list order. A deque keeps each bucket's values in place while
  // others come and go.
  std::deque<BucketInFlight> buckets_in_flight_;
  size_t bytes_in_flight_ = 0;                    // of their values
  std::vector<std::vector<float>> spare_values_;  // of finished buckets, for the next ones
  std::map<int, int> buckets_;                    // all-reduce buckets of each stage of this rank
  std::map<int, std::vector<GradientSegment>> gradient_layouts_;  // by stage
};

}  // namespace conveyor

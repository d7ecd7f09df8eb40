#pragma once
// Simulates a schedule under a cost model, the way the executor runs it: each rank has a
// compute stream, a send stream and a receive stream, each running that rank's actions of
// its kind in list order. A compute starts when the previous compute ended and its inputs
// are there; a transfer starts when its data is produced and both the sender's send stream
// and the receiver's receive stream are free and at this message (rendezvous, as NCCL
// point-to-point), and takes latency + bytes / bandwidth. With zero communication cost the
// transfers take no time and the results are those of the pure dependency graph.
// A data-parallel schedule's ALLREDUCE_GRAD actions run on a fourth stream per rank, the
// reduction stream: each starts when the previous one has ended and every weight-gradient
// action of its stage has run, and takes reduce_latency + gradient bytes / reduce_bandwidth
// (a stage all-reduced in k buckets: k actions, each of the latency and a k-th of the bytes),
// overlapping the computes that follow. Every replica runs the same lists at the same times,
// so one replica is simulated; the rank's end, and the makespan, include its all-reduces.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/schedule/schedule.h"

namespace conveyor::schedule {

// Per-stage vectors: size 1 applies to every stage; otherwise one entry per stage.
struct CostModel {
  std::vector<double> forward{1.0};
  std::vector<double> backward_input{1.0};
  std::vector<double> backward_weight{1.0};
  std::vector<double> backward;          // full backward B; empty = I + W
  double latency = 0.0;                  // per transfer
  double bandwidth = 0.0;                // bytes per time unit; 0 = infinite
  std::vector<double> message_bytes;     // stage s output tensor (also its input gradient)
  std::vector<double> activation_bytes;  // saved by F(s, mb) until its last use
  // Data parallelism: the all-reduce of stage s's gradients takes
  // reduce_latency + gradient_bytes[s] / reduce_bandwidth (algorithm bandwidth of the
  // all-reduce over the replicas; 0 = infinite); in k buckets, each bucket the latency and a
  // k-th of the bytes.
  std::vector<double> gradient_bytes;
  double reduce_latency = 0.0;
  double reduce_bandwidth = 0.0;

  // F, I, W per micro-batch and stage; B = I + W; each transfer costs `comm`.
  static CostModel uniform(double f, double i, double w, double comm = 0.0);
  double cost(const Action& action) const;
};

// One bucket of k of an all-reduce that takes `whole` time as one message, `latency` of which
// every message pays: the latency and a k-th of the rest. The k buckets together take k - 1
// latencies more than one message. The simulator charges each ALLREDUCE_GRAD this, and the
// planner's data-parallel candidate k of them, so both price buckets alike.
double reduce_bucket_cost(double whole, double latency, int buckets);

struct ActionTiming {
  double start = 0;
  double end = 0;
};

struct RankStats {
  double busy = 0;    // total compute time
  double reduce = 0;  // total time of gradient all-reduces (on their own stream)
  double idle = 0;    // makespan - busy
  double end = 0;     // end of the rank's last action
  InFlight memory;    // peak micro-batches and bytes (see schedule.h)
};

struct SimResult {
  std::vector<std::vector<ActionTiming>> timing;  // parallel to Schedule::ranks
  double makespan = 0;
  double bubble_fraction = 0;  // total idle / (ranks * makespan)
  std::vector<RankStats> ranks;
};

// An action no stream can start: the head of some stream waits forever.
struct StuckAction {
  int rank = -1;
  int index = -1;
  std::string waiting_for;
};

class DeadlockError : public ScheduleError {
 public:
  DeadlockError(const std::string& message, std::vector<StuckAction> stuck)
      : ScheduleError(message), stuck_(std::move(stuck)) {}
  const std::vector<StuckAction>& stuck() const { return stuck_; }

 private:
  std::vector<StuckAction> stuck_;
};

// Expects a schedule that passed the structural checks of validate() (validate() runs this
// with zero costs to prove progress). Throws DeadlockError when the run cannot finish (an
// input that no action produces included), and ScheduleError for a stage, micro-batch or peer
// out of range, for a cost, size or bandwidth that is negative or not finite, and for costs
// whose times add up past the largest double.
SimResult simulate(const Schedule& schedule, const CostModel& costs = {});

// One action of a recorded run (Replay): the action(s) it times, by flat index (rank r's
// position i is first[r] + i), and the actions whose ends it waited for (-1: none).
struct ReplayStep {
  enum Type : uint8_t { kCompute, kTransfer, kReduce };
  int action = -1;    // the compute, the send, or the all-reduce
  int received = -1;  // a transfer's receive, timed as its send
  std::array<int, 3> after{-1, -1, -1};
  int rank = -1, receiver = -1;
  ActionKind kind = ActionKind::kForward;
  int stage = 0;
  Type type = kCompute;
};

// simulate() for one schedule under many cost models, as a search over partitions asks:
// the order in which the actions run and what each waits for depend on the lists alone, so
// they are found once, and each run() is one pass over the recorded steps that takes the same
// maxima and sums as simulate() in the same order, so its times are the same numbers.
// Memory is not counted.
class Replay {
 public:
  // Throws what simulate() throws for the schedule.
  explicit Replay(const Schedule& schedule);
  // The makespan under `costs`, which must hold what simulate() accepts (not checked here);
  // timing() and the rank summaries then hold that run.
  double run(const CostModel& costs);
  const ActionTiming& timing(int rank, int position) const {
    return timing_[static_cast<std::size_t>(first_[static_cast<std::size_t>(rank)] + position)];
  }
  double makespan() const { return makespan_; }
  // The last run as simulate() reports it, memory left empty.
  SimResult result() const;
  // Actions timed per run: the measure of a run's work.
  int64_t actions() const { return static_cast<int64_t>(timing_.size()); }
  // The last run's critical path, from its first step to one that ends at the makespan, as
  // the (kind, stage) each of its steps is costed by (a transfer by its send): each step
  // started when the one before it on the path ended. Under any costs every step still
  // waits for the one before it, so the path's summed costs never exceed that makespan.
  std::vector<Action> critical_path() const;

 private:
  int ranks_ = 0, stages_ = 0;
  std::vector<int> first_;
  std::vector<ReplayStep> steps_;
  std::vector<int> step_of_;      // per action (flat index): the step that times it
  std::vector<int> buckets_;      // all-reduces per stage
  std::vector<Action> slots_;     // the (kind, stage) pairs costed; a step's stage is its slot
  std::vector<double> per_slot_;  // run(): their costs
  std::vector<ActionTiming> timing_;
  std::vector<double> busy_, reduce_, end_;
  double makespan_ = 0;
};

// The same run without times: proves that every stream reaches the end of its list (what
// validate() checks).
void check_progress(const Schedule& schedule);

}  // namespace conveyor::schedule

#pragma once
// Planning a pipeline from measured per-unit costs: the contiguous unit ranges per stage
// (exactly, under a per-device memory cap), the schedule and the micro-batch count, each
// candidate timed by the schedule simulator. Pure code: no device, no model is built.
//
// Memory per rank is what a run allocates there: the state of its units (parameters,
// gradients, optimizer state), the activations its stages hold at the schedule's peak (walked
// over the rank's list in the IR, never from a closed form: kept from F; what the backward
// rebuilds or leaves for W held until W), the boundary tensors waiting to be consumed or sent,
// the largest workspace of one of its units, and the step's ids and losses. A recomputed unit
// (recompute.h) keeps only the input of its run, holds its saved tensors for a moment while its
// forward runs (until the next unit has run), and its forward time is added to its backward
// (B, or I when split).
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/pipeline/partition.h"
#include "engine/pipeline/recompute.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/schedule.h"

namespace conveyor {

// One unit's costs for one micro-batch of UnitCosts::microbatch_tokens tokens.
struct UnitCost {
  double forward = 0;           // seconds
  double backward_input = 0;    // seconds
  double backward_weight = 0;   // seconds
  double activation_bytes = 0;  // saved by the forward until the backward has used it
  double parameter_bytes = 0;   // the weights alone (the size of the gradient all-reduce)
  double state_bytes = 0;       // parameters + gradients + optimizer state
  double optimizer_bytes = 0;   // the optimizer state's part of state_bytes
  double input_bytes = 0;       // the tensor entering the unit (0 for token ids)
  // Allocated for a moment during the unit's F, I or W beyond what it keeps (its output or
  // input gradient, temporaries): what a rank needs on top of its held activations.
  double workspace_bytes = 0;
  // Left by the input gradient for the weight gradient (the output gradients W reads), held
  // from I to W when the backward is split.
  double weight_pending_bytes = 0;
  // The relative standard error of the three times (0: known exactly), and which units share
  // it: units timed as one (profile_units) carry the number of the first of them, and move
  // together; -1: a unit whose error is its own.
  double time_error = 0;
  int64_t group = -1;
  // The element count of each of the unit's parameters, in order: a sharded optimizer keeps a
  // piece of each (sharded_optimizer_bytes), which the allocator rounds up on its own.
  std::vector<int64_t> parameter_elements;

  double compute() const { return forward + backward_input + backward_weight; }
};

struct UnitCosts {
  std::vector<UnitCost> units;
  int64_t microbatch_tokens = 0;  // the micro-batch size the costs were measured at
  double transfer_seconds = 0;    // one boundary activation between two ranks, at that size
};

// Errors of planning (an impossible cap, bad options): the message says what would work.
class PlanError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct PartitionChoice {
  std::vector<StageRange> ranges;  // per stage, in stage order
  double step_seconds = 0;         // the simulated step time of `ranges`
  double bottleneck = 0;           // largest per-rank compute of one micro-batch (F + I + W)
  std::vector<double> rank_bytes;  // per rank, as rank_memory counts it
  // False when the search budget ran out first: `ranges` is the fastest partition simulated,
  // not proven the fastest of all.
  bool proven = true;
  // No partition that fits is faster than this: step_seconds when proven.
  double lower_bound = 0;
  int64_t simulated = 0;  // partitions simulated
};

struct PartitionSearch {
  double memory_cap = 0;  // bytes per rank; 0 = no cap
  // Whether memory_cap is each rank's equal share of one device's memory, less what each
  // rank's context takes from it first (`cap_reserve`, CUDA's cuBLASLt workspace): with more
  // ranks on the device each gets less, (memory_cap + cap_reserve) x ranks / more -
  // cap_reserve, which is what the count of stages that would fit is judged against.
  bool cap_shared_by_ranks = false;
  double cap_reserve = 0;
  std::vector<bool> recomputed;  // per unit (empty: none), as recompute.h marks them
  double transfer_seconds = 0;   // one boundary transfer, as the simulator times it
  // The search's budget: partitions simulated at most, counted as work, so a schedule of n <
  // 4096 actions gets 4096 / n times as many (a short schedule's simulation is as much cheaper).
  int64_t max_simulations = 2000;
};

// The contiguous unit ranges for the stages of `schedule` (each stage at least one unit) with
// the smallest simulated step time (schedule::simulate with the ranges' summed costs and
// `transfer_seconds` per transfer), with every rank's memory within the cap. Exact, by branch
// and bound: a rank runs its computes one at a time, after the forwards of the stages before
// its first and before the gradient steps of the stages below its last, so those sums bound
// the step time from below, as do the critical paths of partitions already simulated and the
// simulation of a prefix with the later stages at their least costs; a prefix of stage ranges
// whose bound already exceeds the best simulated partition is dropped without simulating what
// it leads to (partition_search.h). Among partitions of the same step time (within a
// billionth) the smaller bottleneck, then the earlier cuts, are preferred where the search
// meets them. When `max_simulations` runs out, the fastest partition simulated is returned
// with `proven` false and the lower bound the search proved.
// Throws PlanError when no partition fits the cap, naming the rank (and its stages) that
// overflows in the most balanced partition, by how much, the smallest cap any partition
// fits, and how many stages would let every rank fit, when more would. Recomputed units count
// their forward again in the backward and keep their run's input instead of their activations.
PartitionChoice best_partition(const std::vector<UnitCost>& units,
                               const schedule::Schedule& schedule,
                               const PartitionSearch& search = {});

// Per rank: state of its units plus the peak bytes of activations its stages hold, for the
// given unit ranges per stage (and recomputed units, as best_partition takes them).
std::vector<double> rank_memory(const std::vector<UnitCost>& units,
                                const std::vector<StageRange>& ranges,
                                const schedule::Schedule& schedule,
                                const std::vector<bool>& recomputed = {});

// The costs with each recomputed unit's forward added to its input-gradient time (what the
// simulator's B and I then include).
std::vector<UnitCost> with_recompute_time(const std::vector<UnitCost>& units,
                                          const std::vector<bool>& recomputed);

// The ranges as blocks per stage (what PartitionSpec::explicit_blocks takes), for a model of
// units.size() units whose first and last units are not blocks.
std::vector<int64_t> blocks_of(const std::vector<StageRange>& ranges);

struct PlanOptions {
  int num_ranks = 2;
  int64_t batch_tokens = 0;  // tokens per step, split into micro-batches
  // Each at least 1 and dividing batch_tokens; empty: default_microbatch_counts.
  std::vector<int> microbatch_counts;
  std::vector<int> interleaved_chunks{2};  // each at least 2
  double memory_cap = 0;                   // bytes per rank (a device's share); 0 = unlimited
  // As PartitionSearch has them: whether the cap is a share of one device that more ranks
  // would divide further.
  bool cap_shared_by_ranks = false;
  double cap_reserve = 0;
  double allreduce_bandwidth = 0;  // bytes per second of the data-parallel all-reduce; 0 = free
  double allreduce_latency = 0;    // seconds per all-reduce step
  // The data-parallel candidate's gradients are all-reduced in buckets of at most this many
  // bytes (TrainConfig::gradient_bucket_mib); each bucket pays the latency again. 0: one.
  // Finite and at least 0.
  double gradient_bucket_bytes = 0;
  bool include_data_parallel = true;
  RecomputeSpec recompute;  // of every pipelined candidate
  // With `recompute` none: a pipelined candidate that does not fit the cap is tried again
  // with every unit recomputed (RecomputeSpec::every_unit), listed next to it.
  bool recompute_when_short = true;
  // Each layout's partition search budget (PartitionSearch::max_simulations), per search.
  int64_t max_simulations = PartitionSearch{}.max_simulations;
  // The actions all the searches together may time in their simulations (each run times
  // every action of the schedule): what keeps plan() interactive for large models, whose
  // layouts no search finishes within its own budget.
  int64_t max_search_actions = int64_t{1} << 28;
  // Only the pipelined layouts of this schedule kind, or of this many chunks (what the caller
  // fixed); the data-parallel ones stay.
  std::optional<schedule::ScheduleKind> schedule;
  std::optional<int> chunks;
  // Every unit's relative time error, in place of its UnitCost::time_error.
  std::optional<double> time_error;
};

// How far a step time moves when the times of one group of units (UnitCost::group) are off by
// their error (UnitCost::time_error), up and down: the step time with them grown, and with them
// shrunk, less the step time. Both, since a step time bends where its critical path changes.
struct StepError {
  int64_t group = -1;
  double up = 0, down = 0;
};

struct PlanCandidate {
  std::string layout;  // "1f1b", "interleaved v=2", "data-parallel x2", ...
  bool pipelined = true;
  schedule::ScheduleKind kind = schedule::ScheduleKind::k1F1B;
  int chunks = 1;
  int microbatches = 1;            // per step (data-parallel: per replica)
  std::vector<StageRange> ranges;  // per stage; data-parallel: the whole model
  // Whether `ranges` is proven the fastest partition of this layout that fits. Otherwise the
  // search stopped first: no partition of it could beat the fastest layout's, or its budget
  // ran out.
  bool partition_proven = true;
  // No partition of this layout that fits is faster than this: step_seconds when
  // partition_proven; +inf when none fits.
  double step_lower_bound = 0;
  RecomputeSpec recompute;           // what the pipelined candidate recomputes
  double step_seconds = 0;           // predicted by the simulator (data-parallel: compute + reduce)
  double bubble = 0;                 // idle fraction of the ranks
  std::vector<double> busy_seconds;  // per rank, predicted compute time of a step (pipelined)
  std::vector<double> peak_bytes;    // per rank (data-parallel: per replica)
  bool shard_optimizer = false;      // data-parallel: each replica keeps 1/p of the optimizer state
  std::string rejected;              // non-empty: why this candidate cannot run
  bool short_of_memory = false;      // data-parallel: rejected because the state does not fit
  // The measurement's error of step_seconds, per group of units, the partition kept; filled
  // for the pipelines that could tie with the fastest. And the micro-batch size of the cost
  // table they were planned from: two pipelines of one table move with its groups together.
  std::vector<StepError> step_errors;
  int64_t costs_tokens = 0;
  // `ranges` is not the layout's fastest partition (whose step time is step_lower_bound) but
  // one cut away from it, tied with it and needing less memory (planning::partition_among_tied).
  bool partition_tied = false;
  // A pipeline, its partition proven, whose step time the measurements do not tell apart
  // from the fastest pipeline's (the fastest included): the difference is within two of its
  // standard errors (from step_errors). Never where the times are known exactly.
  bool tied = false;
};

struct Plan {
  // Feasible ones first, by the step time the table shows (a lower bound where the partition
  // was not proven the fastest), the fastest found first, and the fastest pipeline, or the
  // one chosen of those tied with it, before every other pipeline.
  std::vector<PlanCandidate> candidates;
  // The fastest pipeline's step time is proven the least of every pipelined layout's (of the
  // fastest partitions the searches found, before ties: PlanCandidate::partition_tied).
  bool fastest_pipeline_proven = false;
  // The fastest pipeline's step time where the plan chose a slower one tied with it, else 0.
  // Of the tied pipelines (PlanCandidate::tied) the plan chooses the one that needs the least
  // peak memory on its fullest rank, then over all ranks, then the first in the order the
  // planner lists layouts (gpipe, 1f1b, zbh1, zbv, interleaved; fewer chunks, fewer
  // micro-batches, nothing recomputed, the earlier cuts first): keys free of the clock's
  // noise, so that costs measured again choose the same pipeline while the ties stay ties.
  double fastest_pipeline_seconds = 0;
  // The fastest feasible candidate; PlanError when none is.
  const PlanCandidate& best() const;
  // The fastest feasible pipelined candidate, or the one chosen of those tied with it (what a
  // Trainer runs: apply_plan, engine/train/trainer.h); null when none is.
  const PlanCandidate* fastest_pipeline() const;
};

// The micro-batch counts plan() tries unless told: about p, 2p, 4p and 8p for p ranks, each
// the smallest count from there to twice it that splits the batch, so that 3 ranks over 4096
// tokens try 4, 8, 16 and 32 rather than one micro-batch, the whole batch through the ranks
// one after another; {1} when none of those splits it.
std::vector<int> default_microbatch_counts(int num_ranks, int64_t batch_tokens);

// Throws PlanError for options outside the ranges PlanOptions states, naming the field.
// Every schedule kind and micro-batch count of `options`, with the exact partition of each,
// simulated with the costs scaled linearly from the measured micro-batch size to the
// candidate's (batch_tokens / m), and the data-parallel layout when the model fits one device.
// The layouts are searched in the order of their lower bounds, first each only for partitions
// that could beat the fastest found so far, so that the fastest pipeline is proven the fastest
// of all early; then each to the end for its own row, within its budget.
Plan plan(const UnitCosts& costs, const PlanOptions& options);
// The same with costs measured at several micro-batch sizes: each candidate uses the table
// measured nearest its micro-batch size (exactly its size when that was measured), since
// times do not scale linearly across cache sizes.
Plan plan(const std::vector<UnitCosts>& measured, const PlanOptions& options);

// The ranked table: step time, bubble, what is recomputed, peak memory per rank, the
// partition; says plainly when running without a pipeline is faster.
std::string format_plan(const Plan& plan);

}  // namespace conveyor

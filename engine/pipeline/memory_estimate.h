#pragma once
// What a pipeline run needs on each rank before anything is allocated, so a run that cannot
// fit is refused in a moment instead of failing (or swapping) after minutes of set-up: the
// planner's memory model (rank_memory), on the bytes each unit's layer says it keeps instead
// of measured ones. Both use the per-stage and per-rank activation figures below.
#include <cstdint>
#include <string>
#include <vector>

#include "engine/pipeline/partition.h"
#include "engine/pipeline/planner.h"
#include "engine/pipeline/recompute.h"
#include "engine/schedule/schedule.h"
#include "layers/model.h"

namespace conveyor {

// Bytes as the caching allocator counts them, each tensor rounded up (round_size).
struct RankMemoryEstimate {
  double parameter_bytes = 0;   // f32 weights of the rank's units
  double gradient_bytes = 0;    // one f32 gradient per weight
  double optimizer_bytes = 0;   // AdamW: two moments per weight; SGD: one buffer
  double activation_bytes = 0;  // peak of what the stages hold for micro-batches in flight
  double batch_bytes = 0;       // the step's token ids, targets and losses held on the rank
  // On top at the peak: the boundary tensors waiting to be used or sent (with one message per
  // stage and direction received ahead of the list, the most the executor takes ahead) and
  // the largest workspace of one of its units.
  double transient_bytes = 0;
  // False when some unit's layer does not say what it keeps (Layer::activation_memory): its
  // activations are then counted as the tensor entering it, and the estimate is a lower bound.
  bool complete = true;
  double total() const {
    return parameter_bytes + gradient_bytes + optimizer_bytes + activation_bytes + batch_bytes +
           transient_bytes;
  }
};

// One micro-batch's activations on one stage: what its forward keeps until the backward (the
// saved tensors of the units that keep theirs, the input of each recomputed run), what the
// backward allocates again when it re-runs the recomputed units' forward, what a split
// input gradient leaves for the weight gradient on top (the output gradients W reads), and
// what the forward holds for a moment beyond what it keeps: a recomputed unit's saved tensors,
// which go once the next unit has run (the largest of them; its run's kept input aside).
struct StageActivationBytes {
  double kept = 0;
  double rebuilt = 0;
  double weight_pending = 0;
  double forward_extra = 0;
};

// Per stage, from per-unit bytes of one micro-batch: `saved[u]`, what unit u's forward saves
// for its backward; `input[u]`, the tensor entering unit u (what a recomputed run starting at
// u keeps instead); `recomputed[u]`, whether unit u is recomputed (empty: none is);
// `pending[u]`, what unit u's input gradient leaves for its weight gradient (empty: nothing).
std::vector<StageActivationBytes> stage_activation_bytes(const std::vector<double>& saved,
                                                         const std::vector<double>& input,
                                                         const std::vector<StageRange>& ranges,
                                                         const std::vector<bool>& recomputed,
                                                         const std::vector<double>& pending = {});

// Per rank, the peak over its list of the activation bytes its stages hold: F(s, mb) holds
// forward_extra[s] on top while it runs, then adds kept[s]; the backward of (s, mb) — B, or I when
// split — holds rebuilt[s] and weight_pending[s] on top while it runs, then releases kept[s]. With
// `until_weight`, what I used stays until its W instead (kept[s], rebuilt[s] and
// weight_pending[s]), as a split backward keeps it for the weight gradient. With only kept bytes
// this is schedule::in_flight_per_rank's peak bytes (in flight, or held with `until_weight`).
std::vector<double> peak_activation_bytes(const schedule::Schedule& schedule,
                                          const std::vector<StageActivationBytes>& stages,
                                          bool until_weight);

// Per unit of `model`, the bytes of UnitCost that profile_units measures (state, optimizer,
// input, activation, weight-pending and workspace bytes; no times) for micro-batches of
// `microbatch_tokens`, from the description alone: the parameters' shapes and
// ModelDescription::unit_memory. A unit whose layer does not say what it keeps gets the tensor
// entering it as its activation bytes and no workspace, and `complete` (when given) is set
// false.
std::vector<UnitCost> described_unit_costs(const ModelDescription& model, int64_t microbatch_tokens,
                                           const std::string& optimizer_kind,
                                           bool* complete = nullptr);

// What a step of `microbatches` micro-batches of `microbatch_tokens` tokens holds from its
// start to its end: where the first unit lives, the token ids (one i32 tensor); where the
// last one does, the targets (likewise) and one f32 loss tensor per micro-batch.
struct StepInputBytes {
  double first_unit = 0;
  double last_unit = 0;
};
StepInputBytes step_input_bytes(int64_t microbatch_tokens, int microbatches);

// Per rank of `schedule`, for micro-batches of `microbatch_tokens`, what the planner's memory
// model (rank_memory) counts, on unit costs from the description (described_unit_costs) with
// the step's inputs (step_input_bytes): its stages' parameters, gradients and
// `optimizer_kind` state, the peak activations its stages hold at once (kept from F; rebuilt
// by recomputed units, and what a split I leaves for W, from the backward to W), the step's ids
// and losses, the boundary tensors waiting and the largest unit workspace. A unit keeps
// `unit_saved_bytes[u]` per micro-batch when given (measured, e.g. by profile_units) instead
// of what its layer says. Not counted: host memory outside the allocator (a CPU message on
// its way or waiting in the transport for its receiver's list, the data-parallel buckets,
// CUDA's pinned staging); on CUDA each rank's cuBLAS workspace and kernel scratch; and on
// CUDA between threads of one process, a sent message its receiver has not taken yet, which
// keeps the sender's tensor.
std::vector<RankMemoryEstimate> estimate_rank_memory(
    const ModelDescription& model, const std::vector<StageRange>& ranges,
    const schedule::Schedule& schedule, const std::string& optimizer_kind,
    int64_t microbatch_tokens, const RecomputeSpec& recompute = {},
    const std::vector<double>& unit_saved_bytes = {});

// What replica `replica` of `replicas` keeps of `unit`'s optimizer state when the replicas shard
// it (ZeRO-1): its piece of each parameter (replica_piece), each allocated, and so rounded up, on
// its own. More than 1/replicas of the whole state when pieces are small (a bias of 64 elements
// keeps 512 bytes a slot on every replica) or cross a large block's rounding (a piece of 2.5
// MiB takes 4). A unit that does not list its parameters (UnitCost::parameter_elements) is
// counted an even share.
double sharded_optimizer_bytes(const UnitCost& unit, int replica, int replicas);

// Per rank of `replicas` copies of `schedule`'s pipeline (rank r: pipeline rank r mod P of
// replica r div P), what estimate_rank_memory counts for its pipeline rank; with
// `shard_optimizer` the optimizer state of its replica's pieces (sharded_optimizer_bytes).
std::vector<RankMemoryEstimate> estimate_replica_memory(const ModelDescription& model,
                                                        const std::vector<StageRange>& ranges,
                                                        const schedule::Schedule& schedule,
                                                        const std::string& optimizer_kind,
                                                        int64_t microbatch_tokens, int replicas,
                                                        bool shard_optimizer,
                                                        const RecomputeSpec& recompute = {});

// Bytes the CPU can still give: MemAvailable of /proc/meminfo, 0 when unknown.
double cpu_available_bytes();

// "512 B", "20.4 MiB", "1.5 GiB": bytes for people, in the unit that keeps them readable.
std::string bytes_text(double bytes);

}  // namespace conveyor

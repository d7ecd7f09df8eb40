#pragma once
// What a training run checkpoints, in the pipeline's terms: every rank's parameters and
// optimizer state under global names, the stage map, and the model's description and
// fingerprint. Names never mention a stage or a rank, so a checkpoint loads into any layout:
//   <parameter>                              its value, e.g. "blocks.3.fc1.weight"
//   optimizer.m.<parameter>, .v.<parameter>  AdamW's first and second moments
//   optimizer.momentum.<parameter>           SGD's momentum
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/pipeline/executor.h"
#include "engine/pipeline/optimizer.h"
#include "engine/pipeline/partition.h"
#include "engine/schedule/schedule.h"
#include "engine/train/checkpoint.h"
#include "engine/train/data.h"
#include "layers/model.h"

namespace conveyor {

// Names of the optimizer state of `parameter`, in Optimizer::state() order.
std::vector<std::string> optimizer_state_names(const std::string& kind,
                                               const std::string& parameter);

// Throws std::invalid_argument for a model whose name the checkpoint's manifest (JSON) could not
// hold, not being valid UTF-8, or a parameter whose name a checkpoint could not hold as itself:
// one beginning "optimizer." (it would stand for, or collide with, the optimizer state of
// another), the safetensors header's "__metadata__", or one that is not valid UTF-8 (the
// header is JSON). Checked when a run that saves or resumes starts, not at its first save.
void check_checkpoint_names(const ModelDescription& model);
// The same for the data source's describe(), which the manifest records.
void check_checkpoint_source(const TokenSource& source);

// What a rank's shard holds: the optimizer's parameters (values, unless `with_parameters` is
// false), then its state; a sharded optimizer's state as pieces of the parameters' shapes
// (none for a parameter whose range is empty on this rank). The tensors are the live ones
// (no copies): write them while the rank is idle, or read into them.
std::vector<NamedTensor> checkpoint_tensors(Optimizer& optimizer, bool with_parameters = true);
// Rank `rank` of 0..P*D-1. The parameters come from replica 0 (all replicas hold the same);
// replicas d > 0 hold only their pieces of a sharded optimizer state, and nothing otherwise.
std::vector<NamedTensor> rank_checkpoint_tensors(PipelineExecutor& executor, int rank);
// The ranks whose shards a checkpoint of this executor holds: P, or P*D with a sharded
// optimizer state (each replica saves its own pieces).
int checkpoint_shard_count(PipelineExecutor& executor);
// The tensors a checkpoint of this executor's model holds for the replica-0 ranks this
// process holds: every tensor of the model when it holds them all (for
// Checkpoint::check_tensors, which then tells a missing, extra or misshapen one).
std::vector<TensorSpec> checkpoint_tensor_specs(PipelineExecutor& executor);
// Reads rank's tensors (its parameters, and its optimizer's state whole or its range of it)
// from `checkpoint`, wherever and however they were saved, and sets its optimizer's step
// count. Any rank 0..P*D-1; callable from the rank's thread.
void load_rank_checkpoint(const Checkpoint& checkpoint, PipelineExecutor& executor, int rank);
// Checks against their checksums the stored bytes load_rank_checkpoint would read for `rank`,
// loading nothing.
void verify_rank_checkpoint(const Checkpoint& checkpoint, PipelineExecutor& executor, int rank);

// The stage map of a schedule and the unit ranges of its stages.
std::vector<StagePlacement> stage_placements(const schedule::Schedule& schedule,
                                             const std::vector<StageRange>& ranges);

// A description of the reference model (every field of its config); model_fingerprint
// (checkpoint_manifest.h) fingerprints any description.
nlohmann::json describe_model(const ModelConfig& model);

}  // namespace conveyor

#pragma once
// The manifest of a checkpoint (manifest.json in its folder): what the shards hold and what
// the trainer needs besides tensors to resume exactly. docs/checkpoint-format.md shows it.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/pipeline/optimizer.h"
#include "engine/train/checkpoint_shard.h"

namespace conveyor {

// Stage `stage` holds model units [unit_begin, unit_end) and runs on rank `rank`.
struct StagePlacement {
  int stage = 0;
  int rank = 0;
  int64_t unit_begin = 0;
  int64_t unit_end = 0;
  bool operator==(const StagePlacement&) const = default;
};

// Where the learning-rate schedule stands: learning_rate(config, step, total_steps).
struct LrSchedulePosition {
  int64_t step = 0;
  int64_t total_steps = 0;
};

// Where the token source stands (TokenSource::describe(), position(), current_token() and
// contents_digest()).
struct DataPosition {
  std::string source;
  uint64_t position = 0;
  // The token at `position`: restores a Markov source at once instead of replaying it.
  // Absent from checkpoints written before it was recorded, and for sources without one.
  std::optional<int32_t> token;
  // "xxh3_64:<16 hex digits>" of the source's contents (a data file's bytes): a resume then
  // compares contents, not `source`, which names the file as it was typed. Absent from
  // checkpoints written before it was recorded, and for sources without one.
  std::optional<std::string> contents;
};

// Everything a checkpoint records besides the tensors.
struct TrainingState {
  int64_t step = 0;                                 // optimizer steps completed
  nlohmann::json model = nlohmann::json::object();  // a description, e.g. the preset's fields
  // model_fingerprint(model) (below); equal fingerprints: the same model. A commit refuses
  // another value, and the loader a manifest whose two disagree.
  std::string model_fingerprint;
  std::vector<StagePlacement> stages;  // model units -> stage -> rank, by stage
  std::string schedule;                // e.g. "1f1b", or a schedule file
  int64_t microbatches = 1;
  // TrainConfig::data_parallel of the run that saved: another count sums the gradients in
  // another order. Absent from checkpoints written before it was recorded, and from those of
  // writers that are no training run.
  std::optional<int> data_parallel;
  OptimizerConfig optimizer;    // kind and hyper-parameters
  int64_t optimizer_steps = 0;  // Optimizer::steps_taken()
  LrSchedulePosition lr_schedule;
  DataPosition data;
  nlohmann::json rng = nlohmann::json::object();  // the caller's, kept as it is
  // The data-parallel replicas that wrote shards: 1, or D when the optimizer state is sharded
  // over D replicas; then the shard of rank r + d * P (P ranks per replica) holds replica d's
  // pieces of the state of pipeline rank r's stages.
  int replicas = 1;
};

// A shard as the manifest lists it.
struct ShardEntry {
  int rank = 0;
  std::string file;  // a plain file name in the checkpoint's folder
  uint64_t bytes = 0;
  uint64_t checksum = 0;  // XXH3-64 of the whole file
};

struct CheckpointManifest {
  int format_version = kCheckpointFormatVersion;
  TrainingState state;
  std::vector<ShardEntry> shards;  // shards[r] is rank r's
  // state_xxh3_64 as read (the writer sets it to training_state_checksum): shards carry their
  // own checksums, this one covers what a resume takes from the manifest alone. Absent from
  // checkpoints written before it was recorded.
  std::optional<uint64_t> state_checksum;
  // manifest_xxh3_64 as read (the writer sets it to manifest_checksum): every other field of
  // the manifest, those no other check covers (the schedule's) included. Absent from
  // checkpoints written before it was recorded.
  std::optional<uint64_t> manifest_checksum;
};

nlohmann::json manifest_to_json(const CheckpointManifest& manifest);
// Parses the text of `file` and checks every field: types, ranges, the stage map against the
// shards and model.num_units, data.token against model.vocab, the format version. Throws
// CheckpointError naming the file and the field.
CheckpointManifest parse_manifest(std::string_view text, const std::string& file);
// Throws CheckpointError naming the file and the field unless the counters agree with the
// step: optimizer.steps_taken and lr_schedule.step at most step (and lr_schedule.step at most
// total_steps); and in a trainer's manifest, whose rng names batch_tokens (the tokens every
// step draws), steps_taken and lr_schedule.step equal to step and data.position equal to
// step x batch_tokens. open_checkpoint checks this after the folder's step.
void check_manifest_counters(const CheckpointManifest& manifest, const std::string& file);
// Whether the manifest's model is described as a Trainer describes its model (an object with
// name, num_units, vocab and unit_parameters): the checkpoint of a training run, which
// check_trainer_manifest applies to.
bool is_trainer_manifest(const CheckpointManifest& manifest);
// Throws CheckpointError naming the file and the field unless the manifest has what resuming a
// Trainer needs of it before it compares anything with the run: an rng object with the
// batch_tokens every step draws. resume_trainer checks this, and so does `ckpt verify` on a
// trainer's manifest, with the same sentence.
void check_trainer_manifest(const CheckpointManifest& manifest, const std::string& file);
// XXH3-64 of the compact JSON of the manifest's step, optimizer, lr_schedule, data and rng
// (docs/checkpoint-format.md spells out the bytes).
uint64_t training_state_checksum(const CheckpointManifest& manifest);
// Throws CheckpointError when the manifest has a state_xxh3_64 that training_state_checksum
// does not reproduce. open_checkpoint checks this last, after the fields and the counters, so
// that an edit those checks explain is named by them.
void check_manifest_state_checksum(const CheckpointManifest& manifest, const std::string& file);
// The fingerprint of a model description: "xxh3_64:" and the XXH3-64 of its canonical JSON
// (sorted keys, compact), so equal models match.
std::string model_fingerprint(const nlohmann::json& description);
// Throws CheckpointError when the manifest's model_fingerprint is not model_fingerprint of its
// model description: one of the two was edited or corrupted. open_checkpoint checks this
// before the state checksum, and a commit refuses a state whose fingerprint is another.
void check_manifest_model_fingerprint(const CheckpointManifest& manifest, const std::string& file);
// XXH3-64 of the compact JSON (keys sorted) of the manifest as manifest_to_json writes it,
// without its manifest_xxh3_64 (docs/checkpoint-format.md).
uint64_t manifest_checksum(const CheckpointManifest& manifest);
// Throws CheckpointError when the manifest has a manifest_xxh3_64 that manifest_checksum does
// not reproduce. open_checkpoint checks this after every other check of the manifest, so that
// an edit one of those explains is named by it.
void check_manifest_checksum(const CheckpointManifest& manifest, const std::string& file);
// Throws CheckpointError unless `name` is a shard file name the format allows:
// letters, digits, '.', '_', '-', not starting with '.', ending in ".safetensors".
void check_shard_file_name(const std::string& name, const std::string& file);

}  // namespace conveyor

// Resuming a trainer from a checkpoint (trainer_checkpoint.h): everything that must match is
// checked before any rank loads, on every process, and the processes agree at each phase.
#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/core/number_text.h"
#include "engine/core/test_pause.h"
#include "engine/schedule/input_file.h"
#include "engine/train/checkpoint_io.h"
#include "engine/train/checkpoint_model.h"
#include "engine/train/data.h"
#include "engine/train/process_agreement.h"
#include "engine/train/trainer_checkpoint.h"

namespace conveyor {
namespace fs = std::filesystem;

namespace {

using detail::agree_across_processes;
using detail::sum_over_processes_for;

// Failure tests only: with CONVEYOR_TEST_PAUSE_IN_RESUME=<point> a process stops for good
// before the exchange of that part of a resume ("compare": the checkpoints the processes
// opened; "paths": the paths of checkpoints that differ; "count": the tensors they load),
// so that a test sees the others give up at their deadline, saying which exchange it was.
void pause_in_resume_if_asked(const char* point) {
  pause_if_asked("CONVEYOR_TEST_PAUSE_IN_RESUME", point, "in resume at");
}

// "d_model: 64 in the checkpoint, 32 in this run; ..." over the fields that differ.
std::string model_differences(const nlohmann::json& saved, const nlohmann::json& ours,
                              const std::string& prefix = "") {
  std::string out;
  auto add = [&](const std::string& text) { out += (out.empty() ? "" : "; ") + text; };
  if (!saved.is_object() || !ours.is_object()) {
    if (saved != ours)
      add(prefix + " " + saved.dump() + " in the checkpoint, " + ours.dump() + " in this run");
    return out;
  }
  for (const auto& [key, value] : saved.items()) {
    const std::string name = escaped_keeping_backslashes(prefix.empty() ? key : prefix + "." + key);
    if (!ours.contains(key))
      add(name + " only in the checkpoint");
    else if (value != ours[key]) {
      if (value.is_object() && ours[key].is_object())
        add(model_differences(value, ours[key], name));
      else
        add(name + " " + value.dump() + " in the checkpoint, " + ours[key].dump() + " in this run");
    }
  }
  for (const auto& [key, value] : ours.items())
    if (!saved.contains(key))
      add((prefix.empty() ? key : prefix + "." + key) + " only in this run");
  return out;
}

// The path each rank's process opened (`own` in this one), by rank, of `lengths[r]` bytes for
// rank r: a byte a double, which a sum where one process alone writes it gathers exactly. A
// collective.
std::vector<std::string> paths_by_rank(PipelineExecutor& executor, const std::string& own,
                                       const std::vector<size_t>& lengths) {
  const size_t width = std::max<size_t>(1, *std::max_element(lengths.begin(), lengths.end()));
  std::vector<double> bytes(lengths.size() * width, 0.0);
  for (int rank : executor.local_ranks())
    for (size_t i = 0; i < own.size(); ++i)
      bytes[static_cast<size_t>(rank) * width + i] = static_cast<unsigned char>(own[i]);
  pause_in_resume_if_asked("paths");
  sum_over_processes_for(executor, bytes,
                         ", in which the processes gather the paths of the checkpoints they "
                         "opened to resume from, which differ");
  std::vector<std::string> paths(lengths.size());
  for (size_t r = 0; r < lengths.size(); ++r)
    for (size_t i = 0; i < lengths[r]; ++i)
      paths[r] += static_cast<char>(static_cast<unsigned char>(bytes[r * width + i]));
  return paths;
}

// Each process opens the checkpoint by its own path, which may name a copy on its node's own
// disk: the copies must be one checkpoint, or the ranks would resume from different weights,
// steps and data positions and train on as if nothing were wrong. Compared by step and
// manifest checksum (which covers every shard's checksum) over a table of the ranks' values,
// so every process reaches the same verdict and says the same; the paths, which may differ
// between processes, are then gathered too, for the verdict to name each.
void check_one_checkpoint_in_every_process(PipelineExecutor& executor, const Checkpoint& checkpoint,
                                           const fs::path& path) {
  if (executor.holds_all_ranks()) return;
  // Per rank: the step, the checksum (put_u64_in_doubles), the path's length in bytes; a sum
  // of one value and zeros is exact.
  constexpr size_t kSlots = 4;
  const int ranks = executor.num_world_ranks();
  std::vector<double> table(static_cast<size_t>(ranks) * kSlots, 0.0);
  for (int rank : executor.local_ranks()) {
    double* slot = &table[static_cast<size_t>(rank) * kSlots];
    slot[0] = static_cast<double>(checkpoint.step());
    put_u64_in_doubles(manifest_checksum(checkpoint.manifest()), slot + 1);
    slot[3] = static_cast<double>(path.native().size());
  }
  pause_in_resume_if_asked("compare");
  sum_over_processes_for(executor, table,
                         ", in which the processes compare the checkpoints they opened to "
                         "resume from (their steps and manifest checksums)");
  auto step_of = [&](int rank) { return table[static_cast<size_t>(rank) * kSlots]; };
  auto checksum_of = [&](int rank) {
    return u64_from_doubles(&table[static_cast<size_t>(rank) * kSlots + 1]);
  };
  int differing = 1;  // the lowest rank whose checkpoint is not rank 0's
  while (differing < ranks && step_of(differing) == step_of(0) &&
         checksum_of(differing) == checksum_of(0))
    ++differing;
  if (differing == ranks) return;
  std::vector<size_t> lengths(static_cast<size_t>(ranks));
  for (int rank = 0; rank < ranks; ++rank)
    lengths[static_cast<size_t>(rank)] =
        static_cast<size_t>(table[static_cast<size_t>(rank) * kSlots + 3]);
  const std::vector<std::string> paths = paths_by_rank(executor, path.native(), lengths);
  const bool one_path = paths[0] == paths[static_cast<size_t>(differing)];
  auto described = [&](int rank) {
    return "step " + std::to_string(static_cast<int64_t>(step_of(rank))) + " (manifest checksum " +
           checkpoint_io::hex64(checksum_of(rank)) + ")" +
           (one_path ? "" : " at " + checkpoint_io::shown_path(paths[static_cast<size_t>(rank)]));
  };
  throw CheckpointErrorOfEveryProcess(
      "the processes opened different checkpoints" +
      (one_path ? " at " + checkpoint_io::shown_path(paths[0]) : std::string()) +
      ": the process of rank 0 one of " + described(0) + ", that of rank " +
      std::to_string(differing) + " one of " + described(differing) +
      "; give every process the same checkpoint (a folder they share, or the same copy on "
      "each node)");
}

// The checkpoint's data against the run's source.
void check_same_data(Trainer& trainer, const TrainingState& saved, const TrainingState& ours,
                     const std::string& manifest) {
  // A recorded digest identifies the data by its bytes, wherever the file now lies and
  // whatever it is called; without one (a checkpoint written before it was recorded, or a
  // source this run has no digest of) the descriptions must match.
  const std::optional<std::string> contents = trainer.source().contents_digest();
  const std::string saved_source = escaped_keeping_backslashes(saved.data.source);
  if (saved.data.contents && contents) {
    if (*saved.data.contents != *contents)
      throw CheckpointError(manifest + " was trained on " + saved_source +
                            ", whose bytes have digest " + *saved.data.contents +
                            ", but this run reads " + ours.data.source + " with digest " +
                            *contents + ": other data; resume with the data it was trained on");
  } else if (saved.data.source != ours.data.source) {
    // The config's data fields make only the built-in sources; a source of the caller's is
    // the same data when it describes itself the same.
    const TokenSource& source = trainer.source();
    const bool built_in = dynamic_cast<const MarkovSource*>(&source) != nullptr ||
                          dynamic_cast<const FileSource*>(&source) != nullptr;
    throw CheckpointError(
        manifest + " was trained on " + saved_source + " but this run reads " + ours.data.source +
        (built_in ? "; resume with the same data (TrainConfig::data_path) and seed "
                    "(TrainConfig::seed)"
                  : "; resume with the same data: a TokenSource whose describe() is the "
                    "checkpoint's"));
  }
  if (saved.data.token && *saved.data.token >= trainer.source().vocab())
    throw CheckpointError(manifest + ": manifest.data.token is " +
                          std::to_string(*saved.data.token) + " but " + saved_source +
                          " has tokens in [0, " + std::to_string(trainer.source().vocab()) + ")");
}

// Everything that must match before a checkpoint is loaded into the trainer.
void check_resumable(Trainer& trainer, const Checkpoint& checkpoint) {
  const TrainingState ours = trainer_training_state(trainer);
  const TrainingState& saved = checkpoint.state();
  const std::string manifest = checkpoint_io::shown_path(checkpoint.directory() / "manifest.json");
  // A file's bytes against a generated chain (a digest on one side only) is the difference to
  // name: the model may differ only through its vocab, which follows such data (bytes take 256
  // ids), whereas between two chains a vocab is the model's, which is said first.
  const bool digest_on_one_side =
      saved.data.contents.has_value() != trainer.source().contents_digest().has_value();
  if (digest_on_one_side) check_same_data(trainer, saved, ours, manifest);
  if (saved.model_fingerprint != ours.model_fingerprint) {
    std::string differences = model_differences(saved.model, ours.model);
    // The same description under another fingerprint: the fingerprint alone was changed.
    if (differences.empty())
      differences = "model_fingerprint " + checkpoint_io::in_quotes(saved.model_fingerprint) +
                    " in the checkpoint, '" + ours.model_fingerprint +
                    "' in this run, though the model descriptions are the same";
    throw CheckpointOfAnotherModel(manifest + " is a checkpoint of another model: " + differences);
  }
  if (saved.optimizer.kind != ours.optimizer.kind)
    throw CheckpointError(manifest + " holds the state of optimizer " + saved.optimizer.kind +
                          " but this run uses " + ours.optimizer.kind +
                          "; resume with TrainConfig::optimizer.kind " + saved.optimizer.kind);
  if (!digest_on_one_side) check_same_data(trainer, saved, ours, manifest);
  check_trainer_manifest(checkpoint.manifest(), manifest);
  const nlohmann::json& rng = saved.rng;
  if (rng["batch_tokens"] != trainer.config().batch_tokens)
    throw CheckpointError(manifest + " was saved by a run of " + rng["batch_tokens"].dump() +
                          " tokens per step, which fixes where each step's data starts, but "
                          "this run draws " +
                          std::to_string(trainer.config().batch_tokens) +
                          "; resume with TrainConfig::batch_tokens " + rng["batch_tokens"].dump());
  if (saved.step > trainer.config().steps)
    throw CheckpointError(manifest + " is of step " + std::to_string(saved.step) +
                          " but this run has only " + counted(trainer.config().steps, "step") +
                          "; raise TrainConfig::steps to train past the checkpoint");
  PipelineExecutor& executor = trainer.executor();
  if (executor.holds_all_ranks())
    checkpoint.check_tensors(checkpoint_tensor_specs(executor));
  else
    checkpoint.check_holds(checkpoint_tensor_specs(executor));  // the count is checked after
}

// With processes, each checked the tensors of its ranks (check_holds); a tensor belongs to
// one rank, so the checkpoint holds no other when their counts add up to its own.
void check_tensor_count(PipelineExecutor& executor, const Checkpoint& checkpoint) {
  if (executor.holds_all_ranks()) return;
  std::vector<double> count = {static_cast<double>(checkpoint_tensor_specs(executor).size())};
  pause_in_resume_if_asked("count");
  sum_over_processes_for(executor, count,
                         ", in which the processes add up the tensors they load from the "
                         "checkpoint, to compare with the count it holds");
  if (count[0] != static_cast<double>(checkpoint.tensors().size()))
    throw CheckpointOfAnotherModel(
        checkpoint_io::shown_path(checkpoint.directory()) + " holds " +
        std::to_string(checkpoint.tensors().size()) + " tensors but the model " + "has " +
        std::to_string(static_cast<int64_t>(count[0])) + "; it is a checkpoint of another model");
}

}  // namespace

std::vector<std::string> resume_setting_changes(const Trainer& trainer, const TrainingState& saved,
                                                const std::string& microbatches_origin) {
  const TrainConfig& config = trainer.config();
  std::vector<std::string> out;
  auto compare = [&](const std::string& setting, const nlohmann::json& then,
                     const nlohmann::json& now, const std::string& effect = "") {
    if (then != now)
      out.push_back("resuming with " + setting + " " + now.dump() +
                    " where the checkpoint was saved with " + then.dump() + effect);
  };
  const OptimizerConfig& o = saved.optimizer;
  compare("TrainConfig::optimizer.lr", o.lr, config.optimizer.lr);
  compare("TrainConfig::optimizer.min_lr", o.min_lr, config.optimizer.min_lr);
  compare("TrainConfig::optimizer.warmup_steps", o.warmup_steps, config.optimizer.warmup_steps);
  compare("TrainConfig::optimizer.weight_decay", o.weight_decay, config.optimizer.weight_decay);
  compare("TrainConfig::optimizer.clip_norm", o.clip_norm, config.optimizer.clip_norm);
  compare("TrainConfig::optimizer.beta1", o.beta1, config.optimizer.beta1);
  compare("TrainConfig::optimizer.beta2", o.beta2, config.optimizer.beta2);
  compare("TrainConfig::optimizer.eps", o.eps, config.optimizer.eps);
  compare("TrainConfig::optimizer.momentum", o.momentum, config.optimizer.momentum);
  compare("TrainConfig::steps", saved.lr_schedule.total_steps, config.steps,
          " (the learning-rate schedule now spans " + counted(config.steps, "step") + ")");
  const std::string reordered =
      " (the gradients are summed in another order, so the run departs from an uninterrupted "
      "one by rounding)";
  // A schedule file fixes the count (make_schedule), which no setting of the caller's chose.
  const int d = config.data_parallel;
  const std::string origin =
      !config.schedule_file.empty()
          ? "from schedule file " + quoted_file_name(config.schedule_file) +
                (d > 1 ? " (" + std::to_string(config.microbatches / d) + " for each of " +
                             std::to_string(d) + " replicas)"
                       : std::string())
          : microbatches_origin;
  if (origin.empty())
    compare("TrainConfig::microbatches", saved.microbatches, config.microbatches, reordered);
  else if (saved.microbatches != config.microbatches)
    out.push_back("resuming with " + counted(config.microbatches, "micro-batch", "micro-batches") +
                  " " + origin + " where the checkpoint was saved with " +
                  std::to_string(saved.microbatches) + reordered);
  // A checkpoint written before the count was recorded says nothing of it.
  if (saved.data_parallel)
    compare("TrainConfig::data_parallel", *saved.data_parallel, config.data_parallel, reordered);
  // resume_trainer let the data through on equal contents; another path is said.
  const TokenSource& source = trainer.source();
  const std::string described = source.describe();
  // The seed draws the initial weights, which the checkpoint's replace, and the Markov chain,
  // whose seed resume_trainer holds to the saved one; on any other data it does nothing.
  const nlohmann::json& rng = saved.rng;
  if (dynamic_cast<const MarkovSource*>(&source) == nullptr && rng.contains("seed") &&
      rng["seed"].is_number_integer())
    compare("TrainConfig::seed", rng["seed"], config.seed,
            ", to no effect: the seed draws the initial weights and the Markov chain's tokens, "
            "and this run takes its weights from the checkpoint and its tokens from " +
                described);
  if (saved.data.contents && saved.data.contents == source.contents_digest() &&
      saved.data.source != described)
    out.push_back("resuming on " + described + " where the checkpoint was trained on " +
                  escaped_keeping_backslashes(saved.data.source) + ": the same bytes (" +
                  *saved.data.contents + ") under another path");
  return out;
}

Checkpoint resume_trainer(Trainer& trainer, const fs::path& path) {
  check_checkpoint_names(trainer.model());
  check_checkpoint_source(trainer.source());
  PipelineExecutor& executor = trainer.executor();
  std::optional<Checkpoint> opened;
  std::exception_ptr error;
  try {
    // A process holding every rank checks every byte before it loads any. Processes holding
    // some of the ranks check every shard's layout and the bytes of the tensors they load:
    // together that is all the run loads, and none of them reads the whole checkpoint (on
    // N processes that would be N times its size, from one shared file system). Each does so
    // before any touches its model, since the first agreement below is on it.
    // A failed step may have left a transport aborted, which no restore repairs; a resume
    // into it would succeed and every step after it be refused.
    if (const std::string& failure = trainer.failure(); !failure.empty())
      throw std::logic_error("cannot resume into an unusable trainer (" + failure +
                             "); make a new Trainer and resume into that");
    const bool whole = executor.holds_all_ranks();
    opened =
        open_checkpoint(path, whole ? CheckpointCheck::kEveryByte : CheckpointCheck::kLayoutOnly);
    check_resumable(trainer, *opened);
    if (!whole)
      for (int rank : executor.local_ranks()) verify_rank_checkpoint(*opened, executor, rank);
  } catch (...) {
    error = std::current_exception();
  }
  agree_across_processes(executor, error, "opening checkpoint " + checkpoint_io::shown_path(path));
  Checkpoint& checkpoint = *opened;
  check_one_checkpoint_in_every_process(executor, checkpoint, path);
  check_tensor_count(executor, checkpoint);
  const TrainingState& saved = checkpoint.state();

  // The data source first, before any tensor is touched: the caller's own source may fail to
  // go to the saved position.
  try {
    trainer.source().restore(saved.data.position, saved.data.token);
  } catch (...) {
    error = std::current_exception();
  }
  agree_across_processes(executor, error, "positioning the data source at the checkpoint's step");

  // Every replica starts from the saved weights (a data-parallel run saves replica 0's,
  // which all replicas share) and the saved moments, whole or its range of them: the saved
  // pieces are assembled, so any (stages, replicas, sharded or not) resumes any other.
  const std::vector<int> ranks = executor.local_ranks();
  std::vector<std::exception_ptr> errors(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i)
    threads.emplace_back([&, i] {
      try {
        load_rank_checkpoint(checkpoint, executor, ranks[i]);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  error = nullptr;
  for (const std::exception_ptr& e : errors)
    if (e && !error) error = e;
  try {
    agree_across_processes(executor, error,
                           "loading checkpoint " + checkpoint_io::shown_path(path));
  } catch (const std::exception& e) {
    // Some tensors may hold the checkpoint's values, others not.
    trainer.mark_unusable("loading checkpoint " + checkpoint_io::shown_path(path) +
                          " failed part-way (" + e.what() + ")");
    throw;
  }
  trainer.resume_at(saved.step);
  return std::move(checkpoint);
}

}  // namespace conveyor

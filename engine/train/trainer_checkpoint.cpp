#include "engine/train/trainer_checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <system_error>
#include <utility>

#include "engine/core/allocator.h"
#include "engine/train/checkpoint_io.h"
#include "engine/train/checkpoint_model.h"

namespace conveyor {
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// What identifies the model: its units and their sizes, and for the reference model every
// field of its config (so a refusal can name the field that differs).
nlohmann::json trainer_model_description(Trainer& trainer) {
  const ModelDescription& model = trainer.model();
  nlohmann::json out = {{"name", model.name},
                        {"num_units", model.num_units},
                        {"vocab", model.vocab},
                        {"unit_parameters", model.unit_parameter_counts()}};
  if (model.name == reference_model(trainer.config().model).name)
    out["config"] = describe_model(trainer.config().model);
  return out;
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
    const std::string name = prefix.empty() ? key : prefix + "." + key;
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

// Host copies of a rank's tensors: what a background save writes while training goes on.
std::vector<NamedTensor> host_snapshot(const std::vector<NamedTensor>& tensors,
                                       const std::shared_ptr<CachingAllocator>& host) {
  std::vector<NamedTensor> out;
  out.reserve(tensors.size());
  for (const NamedTensor& t : tensors) {
    Tensor copy = Tensor::empty(t.tensor.shape(), t.tensor.dtype(), host);
    copy_tensor(copy, t.tensor);
    out.push_back({t.name, std::move(copy), t.piece});
  }
  return out;
}

bool holds_rank_zero(PipelineExecutor& executor) {
  const std::vector<int> ranks = executor.local_ranks();
  return std::find(ranks.begin(), ranks.end(), 0) != ranks.end();
}

// When the ranks are processes, a phase of a save or a resume succeeds on every process or
// fails on all: each says whether it failed (`local`: its own error, rethrown), and one that
// did not names the lowest rank whose process did. A process failing alone would end while
// the others train on and wait for it until their timeout. In one process: rethrows `local`.
void agree_across_processes(PipelineExecutor& executor, std::exception_ptr local,
                            const std::string& what) {
  std::vector<double> failed(executor.num_world_ranks(), 0.0);
  if (local)
    for (int r : executor.local_ranks()) failed[r] = 1.0;
  executor.sum_over_processes(failed);
  if (local) std::rethrow_exception(local);
  for (size_t r = 0; r < failed.size(); ++r)
    if (failed[r] != 0.0)
      throw CheckpointError(what + " failed in the process of rank " + std::to_string(r) +
                            "; its error says why");
}

// Everything that must match before a checkpoint is loaded into the trainer.
void check_resumable(Trainer& trainer, const Checkpoint& checkpoint) {
  const TrainingState ours = trainer_training_state(trainer);
  const TrainingState& saved = checkpoint.state();
  const std::string manifest = checkpoint_io::shown_path(checkpoint.directory() / "manifest.json");
  if (saved.model_fingerprint != ours.model_fingerprint) {
    std::string differences = model_differences(saved.model, ours.model);
    // The same description under another fingerprint: the fingerprint alone was changed.
    if (differences.empty())
      differences = "model_fingerprint " + checkpoint_io::in_quotes(saved.model_fingerprint) +
                    " in the checkpoint, '" + ours.model_fingerprint +
                    "' in this run, though the model descriptions are the same";
    throw CheckpointError(manifest + " is a checkpoint of another model: " + differences);
  }
  if (saved.optimizer.kind != ours.optimizer.kind)
    throw CheckpointError(manifest + " holds the state of optimizer " + saved.optimizer.kind +
                          " but this run uses " + ours.optimizer.kind +
                          "; resume with --optimizer " + saved.optimizer.kind);
  if (saved.data.source != ours.data.source)
    throw CheckpointError(manifest + " was trained on " + saved.data.source +
                          " but this run reads " + ours.data.source +
                          "; resume with the same data and seed");
  if (saved.data.token && *saved.data.token >= trainer.source().vocab())
    throw CheckpointError(manifest + ": manifest.data.token is " +
                          std::to_string(*saved.data.token) + " but " + saved.data.source +
                          " has tokens in [0, " + std::to_string(trainer.source().vocab()) + ")");
  // The library lets a caller keep any rng; a trainer always writes its batch size there,
  // and a resume without it could not tell that another batch size starts elsewhere.
  const nlohmann::json& rng = saved.rng;
  if (!rng.is_object() || !rng.contains("batch_tokens")) {
    std::string seen = rng.dump();
    if (seen.size() > 80) seen = seen.substr(0, 80) + "...";
    throw CheckpointError(manifest + ": manifest.rng is " + seen +
                          ", expected the {\"seed\", \"batch_tokens\"} a training run saves: "
                          "without batch_tokens a resume cannot check that this run draws as "
                          "many tokens per step as the saved one");
  }
  if (rng["batch_tokens"] != trainer.config().batch_tokens)
    throw CheckpointError(manifest + " was saved by a run of " + rng["batch_tokens"].dump() +
                          " tokens per step, which fixes where each step's data starts, but "
                          "this run draws " +
                          std::to_string(trainer.config().batch_tokens) +
                          "; resume with --batch-tokens " + rng["batch_tokens"].dump());
  if (saved.step > trainer.config().steps)
    throw CheckpointError(manifest + " is of step " + std::to_string(saved.step) +
                          " but this run has only " + std::to_string(trainer.config().steps) +
                          " steps; raise --steps to train past the checkpoint");
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
  executor.sum_over_processes(count);
  if (count[0] != static_cast<double>(checkpoint.tensors().size()))
    throw CheckpointError(checkpoint_io::shown_path(checkpoint.directory()) + " holds " +
                          std::to_string(checkpoint.tensors().size()) + " tensors but the model " +
                          "has " + std::to_string(static_cast<int64_t>(count[0])) +
                          "; it is a checkpoint of another model");
}

}  // namespace

TrainingState trainer_training_state(Trainer& trainer) {
  const TrainConfig& config = trainer.config();
  PipelineExecutor& executor = trainer.executor();
  TrainingState state;
  state.step = trainer.steps_done();
  state.model = trainer_model_description(trainer);
  state.model_fingerprint = model_fingerprint(state.model);
  state.stages = stage_placements(executor.schedule(), trainer.stage_ranges());
  state.schedule = executor.schedule().name;
  state.microbatches = config.microbatches;
  state.optimizer = config.optimizer;
  // Every rank's optimizer has taken the same steps; ask one this process holds.
  state.optimizer_steps = executor.optimizer(executor.local_ranks().front()).steps_taken();
  state.lr_schedule = {trainer.steps_done(), config.steps};
  state.data = {trainer.source().describe(), trainer.source().position(),
                trainer.source().current_token()};
  // The built-in source and the weights are functions of the seed and the position alone;
  // the batch size fixes how the next step draws.
  state.rng = {{"seed", config.seed}, {"batch_tokens", config.batch_tokens}};
  state.replicas = checkpoint_shard_count(executor) / executor.num_ranks();
  return state;
}

void check_checkpoint_directory(const fs::path& dir) {
  checkpoint_io::create_checkpoint_folder(dir);
  std::error_code ec;
  // Named per process: the processes of one run probe one shared folder at the same time.
  const fs::path probe = dir / (".conveyor_write_test." + std::to_string(::getpid()));
  {
    std::ofstream out(probe);
    out << "probe\n";
    if (!out.good())
      throw CheckpointError("cannot write into checkpoint folder " +
                            checkpoint_io::shown_path(dir) + "; choose a writable --save-dir");
  }
  fs::remove(probe, ec);
}

TrainerCheckpointer::TrainerCheckpointer(Trainer& trainer, TrainerCheckpointOptions options)
    : trainer_(trainer), options_(std::move(options)) {
  check_checkpoint_names(trainer_.model());
  if (options_.every < 0)
    throw std::invalid_argument("save every N steps needs N >= 0, got " +
                                std::to_string(options_.every));
  if (options_.keep_last < 0)
    throw std::invalid_argument("keep the last K checkpoints needs K >= 0, got " +
                                std::to_string(options_.keep_last));
  if (!options_.warn)
    options_.warn = [](const std::string& text) {
      std::fprintf(stderr, "conveyor: warning: %s\n", text.c_str());
    };
  std::exception_ptr error;
  try {
    check_checkpoint_directory(options_.directory);
  } catch (const CheckpointError&) {
    error = std::current_exception();
  }
  agree_across_processes(
      trainer_.executor(), error,
      "the check of checkpoint folder " + checkpoint_io::shown_path(options_.directory));
  trainer_.set_save_handler([this] { save(); });
}

TrainerCheckpointer::~TrainerCheckpointer() {
  trainer_.set_save_handler(nullptr);
  if (background_.joinable()) background_.join();
}

void TrainerCheckpointer::after_step() {
  if (pending_commit_) {
    // Commit once every process has written its shards; all of them learn it in the same
    // step, so they all commit together (or keep training and look again after the next).
    PipelineExecutor& executor = trainer_.executor();
    std::vector<double> written(executor.num_world_ranks(), 0.0);
    if (background_written_.load())
      for (int r : executor.local_ranks()) written[r] = 1.0;
    executor.sum_over_processes(written);
    if (std::all_of(written.begin(), written.end(), [](double w) { return w != 0.0; }))
      wait_for_background();
  }
  if (options_.every > 0 && trainer_.steps_done() % options_.every == 0) save();
}

void TrainerCheckpointer::failed(const std::exception& e) {
  if (options_.on_error == SaveErrorPolicy::kStop) throw;
  options_.warn(std::string("checkpoint not saved, training goes on: ") + e.what());
}

void TrainerCheckpointer::wait_for_background() {
  if (background_.joinable()) background_.join();
  std::exception_ptr error = std::exchange(background_error_, nullptr);
  if (pending_commit_) {
    PendingCommit pending = std::move(*pending_commit_);
    pending_commit_.reset();
    try {
      complete(*pending.writer, pending.state, error);
      pending.timing->committed = true;
      error = nullptr;
    } catch (...) {
      error = std::current_exception();
    }
    pending.timing->write_end = Clock::now();
  }
  if (!error) return;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    failed(e);
  }
}

std::unique_ptr<CheckpointWriter> TrainerCheckpointer::prepare(int64_t step) {
  PipelineExecutor& executor = trainer_.executor();
  const int shards = checkpoint_shard_count(executor);
  const bool commits = holds_rank_zero(executor);
  std::unique_ptr<CheckpointWriter> writer;
  std::exception_ptr error;
  try {
    if (commits)
      writer = std::make_unique<CheckpointWriter>(options_.directory, step, shards,
                                                  CheckpointWriterOptions{options_.keep_last});
  } catch (...) {
    error = std::current_exception();
  }
  const std::string what = "the save of step " + std::to_string(step);
  agree_across_processes(executor, error, what);
  // The others join the folder that rank 0's process has made by now.
  try {
    if (!commits) writer = CheckpointWriter::join(options_.directory, step, shards);
  } catch (...) {
    error = std::current_exception();
  }
  agree_across_processes(executor, error, what);
  return writer;
}

void TrainerCheckpointer::write_shards(CheckpointWriter& writer,
                                       const std::vector<RankShard>& shards) {
  std::vector<std::exception_ptr> errors(shards.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < shards.size(); ++i)
    threads.emplace_back([&, i] {
      try {
        writer.write_shard(shards[i].rank, shards[i].tensors);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);  // the first rank's error names its file
}

void TrainerCheckpointer::complete(CheckpointWriter& writer, const TrainingState& state,
                                   std::exception_ptr write_error) {
  PipelineExecutor& executor = trainer_.executor();
  const std::string step = std::to_string(state.step);
  agree_across_processes(executor, write_error, "writing the shards of step " + step);
  const int shards = checkpoint_shard_count(executor);
  const bool commits = holds_rank_zero(executor);
  if (!executor.holds_all_ranks()) {
    // Each shard's size and checksum, for rank 0's manifest: the checksum in two 32-bit
    // halves and the size below 2^53, so the doubles of the sum carry them exactly.
    std::vector<double> info(3 * static_cast<size_t>(shards), 0.0);
    for (int r : executor.local_ranks()) {
      if (r >= shards) continue;
      const ShardFileInfo written = *writer.written(r);
      info[3 * r] = static_cast<double>(written.bytes);
      info[3 * r + 1] = static_cast<double>(written.checksum & 0xffffffffu);
      info[3 * r + 2] = static_cast<double>(written.checksum >> 32);
    }
    executor.sum_over_processes(info);
    if (commits)
      for (int r = 0; r < shards; ++r)
        if (!writer.written(r))
          writer.add_written(r, {static_cast<uint64_t>(info[3 * r]),
                                 static_cast<uint64_t>(info[3 * r + 1]) |
                                     static_cast<uint64_t>(info[3 * r + 2]) << 32});
  }
  std::exception_ptr commit_error;
  if (commits) {
    try {
      const CommitResult result = writer.commit(state);
      for (const std::string& w : result.warnings) options_.warn(w);
    } catch (...) {
      commit_error = std::current_exception();
    }
  }
  agree_across_processes(executor, commit_error, "the commit of step " + step);
}

void TrainerCheckpointer::save() {
  const auto start = Clock::now();
  wait_for_background();
  const int64_t step = trainer_.steps_done();
  if (step == last_saved_step_) {
    last_stall_seconds_ = seconds_since(start);
    return;
  }
  PipelineExecutor& executor = trainer_.executor();
  const TrainingState state = trainer_training_state(trainer_);
  std::vector<RankShard> shards;
  if (options_.async && !snapshot_memory_) {
    // Pinned when a rank is on a GPU, so the snapshot that holds training up copies at the
    // bus's speed; kept for the next saves, whose snapshots have the same sizes.
    const std::vector<Device>& devices = trainer_.rank_devices();
    const bool on_gpu =
        std::any_of(devices.begin(), devices.end(), [](Device d) { return d.is_cuda(); });
    snapshot_memory_ = on_gpu ? make_pinned_host_allocator() : make_cpu_allocator();
  }
  const auto host = options_.async ? snapshot_memory_ : nullptr;
  const int shard_count = checkpoint_shard_count(executor);
  for (int r : executor.local_ranks()) {
    if (r >= shard_count) continue;
    std::vector<NamedTensor> tensors = rank_checkpoint_tensors(executor, r);
    shards.push_back({r, host ? host_snapshot(tensors, host) : std::move(tensors)});
  }
  timings_.push_back({step, options_.async, false, start, {}, {}, {}});
  SaveTiming& timing = timings_.back();
  auto held = [&] {
    timing.hold_end = Clock::now();
    last_stall_seconds_ = seconds_since(start);
  };
  std::unique_ptr<CheckpointWriter> writer;
  try {
    writer = prepare(step);
  } catch (const std::exception& e) {
    timing.write_begin = timing.write_end = Clock::now();
    held();
    failed(e);
    return;
  }
  if (options_.async) {
    last_saved_step_ = step;
    // Processes commit together from this thread (the transport serves one thread at a
    // time), once all of them have written; one process commits from the background.
    const bool commits_in_background = executor.holds_all_ranks();
    background_written_ = false;
    CheckpointWriter* target = writer.get();
    if (!commits_in_background) pending_commit_ = PendingCommit{std::move(writer), state, &timing};
    // The entry is written by the background thread alone until the next wait joins it.
    background_ = std::thread([this, state, target, commits_in_background,
                               owned = commits_in_background ? std::move(writer) : nullptr,
                               shards = std::move(shards), timing = &timing] {
      timing->write_begin = Clock::now();
      try {
        write_shards(*target, shards);
        if (commits_in_background) {
          complete(*target, state, nullptr);
          timing->committed = true;
        }
      } catch (...) {
        background_error_ = std::current_exception();
      }
      if (commits_in_background) timing->write_end = Clock::now();
      background_written_ = true;
    });
    held();
    return;
  }
  timing.write_begin = Clock::now();
  try {
    std::exception_ptr write_error;
    try {
      write_shards(*writer, shards);
    } catch (...) {
      write_error = std::current_exception();
    }
    complete(*writer, state, write_error);
    last_saved_step_ = step;
    timing.committed = true;
  } catch (const std::exception& e) {
    timing.write_end = Clock::now();
    held();
    failed(e);  // throws under kStop
    return;
  }
  timing.write_end = Clock::now();
  held();
}

void TrainerCheckpointer::finish() {
  save();
  wait_for_background();
}

std::vector<std::string> resume_setting_changes(const Trainer& trainer,
                                                const TrainingState& saved) {
  const TrainConfig& config = trainer.config();
  std::vector<std::string> out;
  auto compare = [&](const std::string& setting, const nlohmann::json& then,
                     const nlohmann::json& now, const std::string& effect = "") {
    if (then != now)
      out.push_back("resuming with " + setting + " " + now.dump() +
                    " where the checkpoint was saved with " + then.dump() + effect);
  };
  const OptimizerConfig& o = saved.optimizer;
  compare("--lr", o.lr, config.optimizer.lr);
  compare("--min-lr", o.min_lr, config.optimizer.min_lr);
  compare("--warmup", o.warmup_steps, config.optimizer.warmup_steps);
  compare("--weight-decay", o.weight_decay, config.optimizer.weight_decay);
  compare("--clip", o.clip_norm, config.optimizer.clip_norm);
  compare("beta1", o.beta1, config.optimizer.beta1);
  compare("beta2", o.beta2, config.optimizer.beta2);
  compare("eps", o.eps, config.optimizer.eps);
  compare("momentum", o.momentum, config.optimizer.momentum);
  compare("--steps", saved.lr_schedule.total_steps, config.steps,
          " (the learning-rate schedule now spans " + std::to_string(config.steps) + " steps)");
  compare("--microbatches", saved.microbatches, config.microbatches,
          " (the gradients are summed in another order, so the run departs from an "
          "uninterrupted one by rounding)");
  return out;
}

Checkpoint resume_trainer(Trainer& trainer, const fs::path& path) {
  check_checkpoint_names(trainer.model());
  PipelineExecutor& executor = trainer.executor();
  std::optional<Checkpoint> opened;
  std::exception_ptr error;
  try {
    // A process holding every rank checks every byte before it loads any. Processes holding
    // some of the ranks check every shard's layout and the bytes of the tensors they load:
    // together that is all the run loads, and none of them reads the whole checkpoint (on
    // N processes that would be N times its size, from one shared file system). Each does so
    // before any touches its model, since the first agreement below is on it.
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
  check_tensor_count(executor, checkpoint);
  const TrainingState& saved = checkpoint.state();

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
  agree_across_processes(executor, error, "loading checkpoint " + checkpoint_io::shown_path(path));
  trainer.source().restore(saved.data.position, saved.data.token);
  trainer.resume_at(saved.step);
  return std::move(checkpoint);
}

}  // namespace conveyor

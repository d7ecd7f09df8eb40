#include "engine/train/trainer_checkpoint.h"

#include <cstdio>
#include <fstream>
#include <system_error>
#include <utility>

#include "engine/core/allocator.h"
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
  state.optimizer_steps = executor.optimizer(0).steps_taken();
  state.lr_schedule = {trainer.steps_done(), config.steps};
  state.data = {trainer.source().describe(), trainer.source().position()};
  // The built-in source and the weights are functions of the seed and the position alone;
  // the batch size fixes how the next step draws.
  state.rng = {{"seed", config.seed}, {"batch_tokens", config.batch_tokens}};
  state.replicas = checkpoint_shard_count(executor) / executor.num_ranks();
  return state;
}

void check_checkpoint_directory(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw CheckpointError("cannot create checkpoint folder " + dir.string() + ": " +
                          (ec ? ec.message() : "a file of that name is in the way"));
  const fs::path probe = dir / ".conveyor_write_test";
  {
    std::ofstream out(probe);
    out << "probe\n";
    if (!out.good())
      throw CheckpointError("cannot write into checkpoint folder " + dir.string() +
                            "; choose a writable --save-dir");
  }
  fs::remove(probe, ec);
}

TrainerCheckpointer::TrainerCheckpointer(Trainer& trainer, TrainerCheckpointOptions options)
    : trainer_(trainer), options_(std::move(options)) {
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
  check_checkpoint_directory(options_.directory);
  trainer_.set_save_handler([this] { save(); });
}

TrainerCheckpointer::~TrainerCheckpointer() {
  trainer_.set_save_handler(nullptr);
  if (background_.joinable()) background_.join();
}

void TrainerCheckpointer::after_step() {
  if (options_.every > 0 && trainer_.steps_done() % options_.every == 0) save();
}

void TrainerCheckpointer::failed(const std::exception& e) {
  if (options_.on_error == SaveErrorPolicy::kStop) throw;
  options_.warn(std::string("checkpoint not saved, training goes on: ") + e.what());
}

void TrainerCheckpointer::wait_for_background() {
  if (background_.joinable()) background_.join();
  if (!background_error_) return;
  std::exception_ptr error = std::exchange(background_error_, nullptr);
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    failed(e);
  }
}

void TrainerCheckpointer::write(int64_t step, const std::vector<std::vector<NamedTensor>>& shards,
                                const TrainingState& state) {
  CheckpointWriter writer(options_.directory, step, static_cast<int>(shards.size()),
                          {options_.keep_last});
  std::vector<std::exception_ptr> errors(shards.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < shards.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        writer.write_shard(static_cast<int>(r), shards[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);  // the first rank's error names its file
  const CommitResult result = writer.commit(state);
  for (const std::string& w : result.warnings) options_.warn(w);
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
  std::vector<std::vector<NamedTensor>> shards;
  timings_.push_back({step, options_.async, false, start, {}, {}, {}});
  if (options_.async) {
    const auto host = make_cpu_allocator();
    for (int r = 0; r < checkpoint_shard_count(executor); ++r)
      shards.push_back(host_snapshot(rank_checkpoint_tensors(executor, r), host));
    last_saved_step_ = step;
    // The entry is written by the background thread alone until the next wait joins it.
    SaveTiming* timing = &timings_.back();
    background_ = std::thread([this, step, state, shards = std::move(shards), timing] {
      timing->write_begin = Clock::now();
      try {
        write(step, shards, state);
        timing->committed = true;
      } catch (...) {
        background_error_ = std::current_exception();
      }
      timing->write_end = Clock::now();
    });
    timings_.back().hold_end = Clock::now();
    last_stall_seconds_ = seconds_since(start);
    return;
  }
  for (int r = 0; r < checkpoint_shard_count(executor); ++r)
    shards.push_back(rank_checkpoint_tensors(executor, r));
  SaveTiming& timing = timings_.back();
  timing.write_begin = Clock::now();
  try {
    write(step, shards, state);
    last_saved_step_ = step;
    timing.committed = true;
  } catch (const std::exception& e) {
    timing.write_end = timing.hold_end = Clock::now();
    last_stall_seconds_ = seconds_since(start);
    failed(e);
  }
  timing.write_end = timing.hold_end = Clock::now();
  last_stall_seconds_ = seconds_since(start);
}

void TrainerCheckpointer::finish() {
  save();
  wait_for_background();
}

Checkpoint resume_trainer(Trainer& trainer, const fs::path& path) {
  Checkpoint checkpoint = open_checkpoint(path);
  const TrainingState ours = trainer_training_state(trainer);
  const TrainingState& saved = checkpoint.state();
  const std::string manifest = (checkpoint.directory() / "manifest.json").string();
  if (saved.model_fingerprint != ours.model_fingerprint)
    throw CheckpointError(manifest + " is a checkpoint of another model: " +
                          model_differences(saved.model, ours.model));
  if (saved.optimizer.kind != ours.optimizer.kind)
    throw CheckpointError(manifest + " holds the state of optimizer " + saved.optimizer.kind +
                          " but this run uses " + ours.optimizer.kind +
                          "; resume with --optimizer " + saved.optimizer.kind);
  if (saved.data.source != ours.data.source)
    throw CheckpointError(manifest + " was trained on " + saved.data.source +
                          " but this run reads " + ours.data.source +
                          "; resume with the same data and seed");
  if (saved.step > trainer.config().steps)
    throw CheckpointError(manifest + " is of step " + std::to_string(saved.step) +
                          " but this run has only " + std::to_string(trainer.config().steps) +
                          " steps; raise --steps to train past the checkpoint");
  PipelineExecutor& executor = trainer.executor();
  checkpoint.check_tensors(checkpoint_tensor_specs(executor));

  // Every replica starts from the saved weights (a data-parallel run saves replica 0's,
  // which all replicas share) and the saved moments, whole or its range of them: the saved
  // pieces are assembled, so any (stages, replicas, sharded or not) resumes any other.
  std::vector<std::exception_ptr> errors(executor.num_world_ranks());
  std::vector<std::thread> threads;
  for (int r = 0; r < executor.num_world_ranks(); ++r)
    threads.emplace_back([&, r] {
      try {
        load_rank_checkpoint(checkpoint, executor, r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  trainer.source().seek(saved.data.position);
  trainer.resume_at(saved.step);
  return checkpoint;
}

}  // namespace conveyor

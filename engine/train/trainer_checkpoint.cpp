#include "engine/train/trainer_checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <utility>

#include "engine/core/allocator.h"
#include "engine/core/enum_value.h"
#include "engine/train/checkpoint_io.h"
#include "engine/train/checkpoint_model.h"
#include "engine/train/process_agreement.h"

namespace conveyor {
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// What identifies the model: its units and their sizes, and for the reference model every
// field of its config (so a refusal can name the field that differs). A trainer of a
// description of the caller's does not use its config's model, which may not be valid.
nlohmann::json trainer_model_description(Trainer& trainer) {
  const ModelDescription& model = trainer.model();
  nlohmann::json out = {{"name", model.name},
                        {"num_units", model.num_units},
                        {"vocab", model.vocab},
                        {"unit_parameters", model.unit_parameter_counts()}};
  // A description of the caller's built as reference_model(config.model) is described as
  // the trainer of config.model is, so that either resumes the other's checkpoints.
  bool reference = false;
  try {
    reference = model.name == reference_model(trainer.config().model).name;
  } catch (const std::invalid_argument&) {
    // config.model is not valid, so not this model's: a trainer of a description of the
    // caller's does not use it.
  }
  if (reference) out["config"] = describe_model(trainer.config().model);
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
  state.data_parallel = config.data_parallel;
  state.optimizer = config.optimizer;
  // Every rank's optimizer has taken the same steps; ask one this process holds.
  state.optimizer_steps = executor.optimizer(executor.local_ranks().front()).steps_taken();
  state.lr_schedule = {trainer.steps_done(), config.steps};
  state.data = {trainer.source().describe(), trainer.source().position(),
                trainer.source().current_token(), trainer.source().contents_digest()};
  // The built-in source and the weights are functions of the seed and the position alone;
  // the batch size fixes how the next step draws.
  state.rng = {{"seed", config.seed}, {"batch_tokens", config.batch_tokens}};
  state.replicas = checkpoint_shard_count(executor) / executor.num_ranks();
  return state;
}

void check_checkpoint_directory(const fs::path& dir) {
  checkpoint_io::create_checkpoint_folder(dir);
  // Named per process: the processes of one run probe one shared folder at the same time.
  const fs::path probe = dir / (".conveyor_write_test." + std::to_string(::getpid()));
  // Written unbuffered, so that a full disk or a file size limit fails here, with the
  // system's reason, and not only at the first save, after the steps before it.
  static constexpr char kText[] = "probe\n";
  int error = 0;
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    error = errno;
  } else {
    const ssize_t n = ::write(fd, kText, sizeof kText - 1);
    if (n != static_cast<ssize_t>(sizeof kText - 1)) error = n < 0 ? errno : ENOSPC;
    if (::close(fd) != 0 && error == 0) error = errno;
    ::unlink(probe.c_str());
  }
  if (error != 0)
    throw CheckpointError("cannot write into checkpoint folder " + checkpoint_io::shown_path(dir) +
                          ": " + std::strerror(error) +
                          "; choose a writable folder (TrainerCheckpointOptions::directory)");
}

TrainerCheckpointer::TrainerCheckpointer(Trainer& trainer, TrainerCheckpointOptions options)
    : trainer_(trainer), options_(std::move(options)) {
  // A second checkpointer would replace the first one's handlers, and the first would then
  // neither hear of the trainer's end (its background write and destructor reading a freed
  // trainer) nor keep its handlers once the second one's destructor cleared them.
  if (trainer_.has_destroy_handler())
    throw std::logic_error(
        "the trainer already has a TrainerCheckpointer (or a handler of its own, "
        "Trainer::set_destroy_handler); a trainer saves through one checkpointer at a time: "
        "destroy the other one first");
  check_checkpoint_names(trainer_.model());
  check_checkpoint_source(trainer_.source());
  // Named by the options' fields: a program sets those, and the command line shows its flags.
  if (options_.directory.empty())
    throw std::invalid_argument(
        "TrainerCheckpointOptions::directory is empty; give the folder to save checkpoints into");
  if (options_.every < 0)
    throw std::invalid_argument(
        "TrainerCheckpointOptions::every must be at least 0 (0: save on request and at the "
        "end), got " +
        std::to_string(options_.every));
  if (options_.keep_last < 0)
    throw std::invalid_argument(
        "TrainerCheckpointOptions::keep_last must be at least 0 (0: keep every checkpoint), "
        "got " +
        std::to_string(options_.keep_last));
  // A value cast from outside the enum went on past a failed save as kContinue does.
  check_enum_value(options_.on_error, {SaveErrorPolicy::kStop, SaveErrorPolicy::kContinue},
                   "TrainerCheckpointOptions::on_error", "SaveErrorPolicy::kStop or kContinue");
  if (!options_.warn)
    options_.warn = [](const std::string& text) {
      std::fprintf(stderr, "conveyor: warning: %s\n", text.c_str());
    };
  std::exception_ptr error;
  try {
    check_checkpoint_directory(options_.directory);
    if (holds_rank_zero(trainer_.executor())) lock_folder();  // the process that commits
  } catch (const CheckpointError&) {
    error = std::current_exception();
  }
  detail::agree_across_processes(
      trainer_.executor(), error,
      "the check of checkpoint folder " + checkpoint_io::shown_path(options_.directory));
  trainer_.set_save_handler([this] { save(); });
  trainer_.set_destroy_handler([this] {
    // The background write reads the trainer's executor as it commits.
    if (background_.joinable()) background_.join();
    // A write that committed on its own thread (one process) is saved, as wait_for_background
    // would have recorded; one whose commit waits for the other processes never commits.
    if (!background_error_ && !pending_commit_ && background_step_ >= 0)
      last_saved_step_ = background_step_;
    trainer_gone_ = true;
  });
}

void TrainerCheckpointer::check_trainer_alive(const char* action) const {
  if (trainer_gone_)
    throw std::logic_error(std::string("the checkpointer cannot ") + action +
                           ": its trainer was destroyed (a trainer must outlive its "
                           "checkpointer; finish() before destroying it saves the last step)");
}

TrainerCheckpointer::~TrainerCheckpointer() {
  if (!trainer_gone_) {
    trainer_.set_save_handler(nullptr);
    trainer_.set_destroy_handler(nullptr);
  }
  if (background_.joinable()) background_.join();
  if (folder_lock_ >= 0) ::close(folder_lock_);  // and with it the lock
}

void TrainerCheckpointer::lock_folder() {
  const std::string shown = checkpoint_io::shown_path(options_.directory);
  folder_lock_ = ::open(options_.directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (folder_lock_ < 0)
    throw CheckpointError("cannot open checkpoint folder " + shown +
                          " to lock it: " + std::strerror(errno));
  if (::flock(folder_lock_, LOCK_EX | LOCK_NB) == 0) return;
  const int err = errno;
  ::close(folder_lock_);
  folder_lock_ = -1;
  if (err == EWOULDBLOCK)
    throw CheckpointError("checkpoint folder " + shown +
                          " is being saved into by another run (it holds the folder's lock); "
                          "give this run a folder of its own, or wait for that run to end");
  throw CheckpointError("cannot lock checkpoint folder " + shown + ": " + std::strerror(err));
}

void TrainerCheckpointer::lock_folder_again_if_replaced() {
  checkpoint_io::create_checkpoint_folder(options_.directory);
  struct stat held {};
  struct stat now {};
  // A removed folder has no links left, and its inode number may be the new one's. A lock
  // that a failed save could not take again is taken by the next.
  if (folder_lock_ >= 0 && ::fstat(folder_lock_, &held) == 0 && held.st_nlink > 0 &&
      ::stat(options_.directory.c_str(), &now) == 0 && held.st_dev == now.st_dev &&
      held.st_ino == now.st_ino)
    return;
  if (folder_lock_ >= 0) ::close(folder_lock_);
  folder_lock_ = -1;
  lock_folder();
}

void TrainerCheckpointer::after_step() {
  check_trainer_alive("save after a step");
  if (pending_commit_) {
    // Commit once every process has written its shards; all of them learn it in the same
    // step, so they all commit together (or keep training and look again after the next).
    PipelineExecutor& executor = trainer_.executor();
    std::vector<double> written(executor.num_world_ranks(), 0.0);
    if (background_written_.load())
      for (int r : executor.local_ranks()) written[r] = 1.0;
    checkpoint_io::pause_for_crash_test("written");
    detail::sum_over_processes_for(executor, written,
                                   ", in which the processes ask whether every shard of step " +
                                       std::to_string(pending_commit_->state.step) +
                                       " is written, its save being in the background");
    if (std::all_of(written.begin(), written.end(), [](double w) { return w != 0.0; }))
      wait_for_background();
  }
  if (options_.every > 0 && trainer_.steps_done() % options_.every == 0) save();
}

void TrainerCheckpointer::failed(const std::exception& e) {
  if (options_.on_error == SaveErrorPolicy::kStop) throw;
  options_.warn(std::string(finishing_ ? "checkpoint not saved at the end of the run: "
                                       : "checkpoint not saved; the run does not stop for it: ") +
                e.what());
}

void TrainerCheckpointer::wait_for_background() {
  if (background_.joinable()) background_.join();
  std::exception_ptr error = std::exchange(background_error_, nullptr);
  const int64_t step = std::exchange(background_step_, -1);
  if (pending_commit_) {
    PendingCommit pending = std::move(*pending_commit_);
    pending_commit_.reset();
    try {
      complete(trainer_.executor(), *pending.writer, pending.state, error);
      pending.timing->committed = true;
      error = nullptr;
    } catch (...) {
      error = std::current_exception();
    }
    pending.timing->write_end = Clock::now();
  }
  if (!error) {
    if (step >= 0) last_saved_step_ = step;
    return;
  }
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    failed(e);
  }
}

std::unique_ptr<CheckpointWriter> TrainerCheckpointer::prepare(int64_t step,
                                                               std::exception_ptr error) {
  PipelineExecutor& executor = trainer_.executor();
  const int shards = checkpoint_shard_count(executor);
  const bool commits = holds_rank_zero(executor);
  std::unique_ptr<CheckpointWriter> writer;
  try {
    if (commits && !error) {
      lock_folder_again_if_replaced();
      writer = std::make_unique<CheckpointWriter>(
          options_.directory, step, shards,
          CheckpointWriterOptions{options_.keep_last, continues_folder_,
                                  /*refuse_non_finite=*/true});
    }
  } catch (...) {
    error = std::current_exception();
  }
  const std::string what = "the save of step " + std::to_string(step);
  detail::agree_across_processes(executor, error, what);
  // The others join the folder that rank 0's process has made by now.
  try {
    if (!commits)
      writer = CheckpointWriter::join(options_.directory, step, shards,
                                      CheckpointWriterOptions{.refuse_non_finite = true});
  } catch (...) {
    error = std::current_exception();
  }
  detail::agree_across_processes(executor, error, what);
  return writer;
}

void TrainerCheckpointer::write_shards(CheckpointWriter& writer,
                                       const std::vector<RankShard>& shards) {
  std::vector<std::exception_ptr> errors(shards.size());
  auto write = [&](size_t i) {
    // Nested: the message of a bad_alloc needs memory too, and an exception that left a
    // writing thread would end the process.
    try {
      try {
        writer.write_shard(shards[i].rank, shards[i].tensors);
      } catch (const std::bad_alloc& e) {  // "std::bad_alloc" alone would not say whose
        throw std::runtime_error(
            "cannot write " +
            checkpoint_io::shown_path(writer.temp_directory() /
                                      CheckpointWriter::shard_file_name(shards[i].rank)) +
            ": " + error_sentence(e));
      }
    } catch (...) {
      errors[i] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  // Before any thread starts: a vector that grew past its room, out of memory, would throw
  // with threads running, and destroying a running std::thread ends the process.
  threads.reserve(shards.size());
  for (size_t i = 0; i < shards.size(); ++i) {
    try {
      threads.emplace_back(write, i);
    } catch (const std::system_error&) {
      write(i);  // no thread to be had (a memory or process limit): written by this one
    }
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);  // the first rank's error names its file
}

void TrainerCheckpointer::complete(PipelineExecutor& executor, CheckpointWriter& writer,
                                   const TrainingState& state, std::exception_ptr write_error) {
  const std::string step = std::to_string(state.step);
  detail::agree_across_processes(executor, write_error, "writing the shards of step " + step);
  const int shards = checkpoint_shard_count(executor);
  const bool commits = holds_rank_zero(executor);
  if (!executor.holds_all_ranks()) {
    // Each shard's size and checksum, for rank 0's manifest: the size below 2^53 and the
    // checksum in halves (put_u64_in_doubles), so the doubles of the sum carry them exactly.
    std::vector<double> info(3 * static_cast<size_t>(shards), 0.0);
    for (int r : executor.local_ranks()) {
      if (r >= shards) continue;
      const ShardFileInfo written = *writer.written(r);
      info[3 * r] = static_cast<double>(written.bytes);
      put_u64_in_doubles(written.checksum, &info[3 * r + 1]);
    }
    checkpoint_io::pause_for_crash_test("sizes");
    detail::sum_over_processes_for(
        executor, info,
        ", in which the processes gather the sizes and checksums of the shards of step " + step +
            " for the manifest");
    if (commits)
      for (int r = 0; r < shards; ++r)
        if (!writer.written(r))
          writer.add_written(
              r, {static_cast<uint64_t>(info[3 * r]), u64_from_doubles(&info[3 * r + 1])});
  }
  std::exception_ptr commit_error;
  if (commits) {
    try {
      const CommitResult result = writer.commit(state);
      // Each save meets a folder it cannot remove again: said once a run.
      for (const std::string& w : result.warnings)
        if (warned_.insert(w).second) options_.warn(w);
    } catch (...) {
      commit_error = std::current_exception();
    }
  }
  detail::agree_across_processes(executor, commit_error, "the commit of step " + step);
}

void TrainerCheckpointer::save() {
  check_trainer_alive("save");
  const auto start = Clock::now();
  wait_for_background();  // a save started before a failure holds the weights of its step
  if (const std::string& failure = trainer_.failure(); !failure.empty()) {
    // A failed step leaves some weights updated and some not, a partial restore some of a
    // checkpoint's: saved, they would be published as `latest` over the last good step.
    last_stall_seconds_ = seconds_since(start);
    try {
      throw std::logic_error("cannot save a checkpoint: the trainer is unusable (" + failure + ")");
    } catch (const std::exception& e) {
      failed(e);  // throws under kStop
    }
    return;
  }
  const int64_t step = trainer_.steps_done();
  if (step == last_started_step_) {
    last_stall_seconds_ = seconds_since(start);
    return;
  }
  last_started_step_ = step;
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
  // A snapshot that does not fit fails this save as a write that fails does, on every process
  // alike (prepare agrees on it): under SaveErrorPolicy::kContinue training goes on.
  std::exception_ptr snapshot_error;
  for (int r : executor.local_ranks()) {
    if (r >= shard_count) continue;
    std::vector<NamedTensor> tensors = rank_checkpoint_tensors(executor, r);
    if (!host) {
      shards.push_back({r, std::move(tensors)});
      continue;
    }
    try {
      shards.push_back({r, host_snapshot(tensors, host)});
    } catch (const std::exception& e) {
      if (dynamic_cast<const OutOfMemoryError*>(&e) == nullptr &&
          dynamic_cast<const std::bad_alloc*>(&e) == nullptr)
        throw;
      // The allocator's sentence alone does not say what the memory was for.
      snapshot_error = std::make_exception_ptr(
          std::runtime_error("cannot save step " + std::to_string(step) +
                             ": the host copy of its weights, which an asynchronous save "
                             "writes from, does not fit in memory: " +
                             error_sentence(e)));
      // The copies made so far go back to the system, for training to use: kept in the
      // snapshots' cache, they would leave the next step short of the memory this one had.
      shards.clear();
      snapshot_memory_->release_cache();
      break;
    }
  }
  timings_.push_back({step, options_.async, false, start, {}, {}, {}});
  SaveTiming& timing = timings_.back();
  auto held = [&] {
    timing.hold_end = Clock::now();
    last_stall_seconds_ = seconds_since(start);
  };
  std::unique_ptr<CheckpointWriter> writer;
  try {
    writer = prepare(step, snapshot_error);
  } catch (const std::exception& e) {
    timing.write_begin = timing.write_end = Clock::now();
    held();
    failed(e);
    return;
  }
  if (options_.async) {
    background_step_ = step;  // saved once the write is waited for and did not fail
    // Processes commit together from this thread (the transport serves one thread at a
    // time), once all of them have written; one process commits from the background.
    const bool commits_in_background = executor.holds_all_ranks();
    background_written_ = false;
    CheckpointWriter* target = writer.get();
    if (!commits_in_background) pending_commit_ = PendingCommit{std::move(writer), state, &timing};
    // The entry is written by the background thread alone until the next wait joins it.
    try {
      background_ = std::thread([this, run = &executor, state, target, commits_in_background,
                                 owned = commits_in_background ? std::move(writer) : nullptr,
                                 shards = std::move(shards), timing = &timing] {
        timing->write_begin = Clock::now();
        try {
          write_shards(*target, shards);
          if (commits_in_background) {
            complete(*run, *target, state, nullptr);
            timing->committed = true;
          }
        } catch (...) {
          background_error_ = std::current_exception();
        }
        if (commits_in_background) timing->write_end = Clock::now();
        background_written_ = true;
      });
    } catch (const std::exception& e) {
      // No thread runs (the system refused one, or its state could not be allocated): the
      // save is undone, so that the next wait finds nothing pending.
      background_step_ = -1;
      pending_commit_.reset();
      throw std::runtime_error(
          "cannot save step " + std::to_string(step) +
          ": cannot start the thread that writes it in the background: " + error_sentence(e));
    }
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
    complete(executor, *writer, state, write_error);
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

void TrainerCheckpointer::resumed_from(const std::filesystem::path& checkpoint) {
  std::error_code ec;
  continues_folder_ = std::filesystem::equivalent(checkpoint.parent_path(), options_.directory, ec);
}

void TrainerCheckpointer::finish() {
  check_trainer_alive("finish");
  finishing_ = true;
  save();
  wait_for_background();
}

}  // namespace conveyor

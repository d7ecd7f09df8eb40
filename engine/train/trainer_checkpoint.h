#pragma once
// Checkpoints of a Trainer: periodic saves (every rank's shard written concurrently, one
// commit), optionally in the background from a host snapshot, and an exact resume — the
// parameters, optimizer state, step, learning-rate position and data position of a
// checkpoint, into any stage layout and schedule (tensor names are global). With the same
// micro-batches, a resumed CPU run continues bit for bit as the uninterrupted one would.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "engine/core/allocator.h"
#include "engine/train/checkpoint.h"
#include "engine/train/trainer.h"

namespace conveyor {

// What a failed save does: end the run with the error, or report it and train on. Either way
// the previous checkpoint and `latest` stay as they were.
enum class SaveErrorPolicy : uint8_t { kStop, kContinue };

struct TrainerCheckpointOptions {
  std::filesystem::path directory;  // DIR of DIR/step_<N>, DIR/latest
  int64_t every = 0;                // save after every N-th step; 0: only on request / at the end
  int keep_last = 0;                // 0 keeps every checkpoint
  SaveErrorPolicy on_error = SaveErrorPolicy::kStop;
  bool async = false;  // snapshot to host memory, write in the background
  // Where a failure under kContinue, and removal warnings (each once), are reported; stderr
  // by default.
  std::function<void(const std::string&)> warn;
};

// The manifest's state of the trainer as it stands now (between steps).
TrainingState trainer_training_state(Trainer& trainer);

// Creates `dir` if needed and checks that a file can be written in it. Throws CheckpointError
// naming the folder and the system's reason otherwise (a read-only or full file system).
void check_checkpoint_directory(const std::filesystem::path& dir);

// When one save held the training loop and when its files were written, on the steady clock:
// with --async-save the write runs on its own thread while training goes on.
struct SaveTiming {
  int64_t step = 0;
  bool async = false;
  bool committed = false;  // false: the save failed
  std::chrono::steady_clock::time_point hold_begin, hold_end, write_begin, write_end;
};

// When the ranks are processes (MPI), every process saves and resumes with its own
// TrainerCheckpointer and resume_trainer, at the same points of the run: each writes the
// shards of the ranks it holds into one folder that all of them see (a shared file system),
// the process of rank 0 prepares and commits the save, and every phase ends with the
// processes agreeing, so a failure on one is a failure on all (each names the rank whose
// process failed) instead of a process that ends while the others wait for it.
class TrainerCheckpointer {
 public:
  // Checks the folder (check_checkpoint_directory), locks it against other checkpointers
  // (another run saving into it is refused with a CheckpointError) and installs
  // Trainer::save_now. A trainer has one checkpointer at a time: one that already has a
  // checkpointer (or a destroy handler of its own) is refused with a std::logic_error.
  TrainerCheckpointer(Trainer& trainer, TrainerCheckpointOptions options);
  // Waits for a background save; its error is dropped, see finish(). The trainer should
  // outlive its checkpointer; one destroyed first waits for the background write in its own
  // destructor, and the checkpointer then refuses save() and finish() (std::logic_error).
  ~TrainerCheckpointer();
  TrainerCheckpointer(const TrainerCheckpointer&) = delete;
  TrainerCheckpointer& operator=(const TrainerCheckpointer&) = delete;

  // Call after every step: saves when the step is a multiple of `every`. With processes,
  // also commits a background save once every process has written its shards.
  void after_step();
  // Saves the trainer's current step unless a save of that step was made already (a failed
  // one is not tried again: its failure was reported once). Synchronous: returns once
  // committed. Async: returns once the snapshot is taken (after waiting for the previous
  // save). Under kStop a failure throws CheckpointError (an async one from the next call).
  // A trainer that is unusable (Trainer::failure()) is not saved: the refusal is a
  // std::logic_error under kStop, a warning under kContinue, and the checkpoints already
  // committed (a background save of an earlier step too) stay as they are.
  void save();
  // The end of the run: saves the last step if needed and waits for the background save.
  void finish();
  // The trainer was resumed from `checkpoint` (a DIR/step_<N> folder). From the checkpointer's
  // own folder, the run continues that folder's run, and its saves may replace the step
  // folders newer than `latest` that the run's earlier saves left unpublished; from anywhere
  // else, they replace nothing.
  void resumed_from(const std::filesystem::path& checkpoint);
  bool continues_folder() const { return continues_folder_; }

  // Seconds the last save() held the training loop (the whole save, or wait + snapshot).
  double last_stall_seconds() const { return last_stall_seconds_; }
  // The newest step whose checkpoint is committed (-1: none yet); with async saves, as of
  // the last wait for the background write (finish() waits for the last one).
  int64_t last_saved_step() const { return last_saved_step_; }
  // The newest step a save was started for, committed, failed or still being written.
  int64_t last_started_step() const { return last_started_step_; }
  // The step whose background write is under way or not yet waited for (-1: none); a save
  // that failed before its write began (its folder could not be made) has none.
  int64_t background_step() const { return background_step_; }
  // Every save of this checkpointer so far; a background save's entry is complete once the
  // next save() or finish() has waited for it.
  const std::vector<SaveTiming>& save_timings() const { return timings_; }

 private:
  void lock_folder();  // throws CheckpointError when another holds it
  // The folder removed or replaced during the run (the save makes it again): the lock went
  // with the old one, so a second run could take the new folder and remove this one's
  // unfinished saves. Locks the folder as it is now, unless the lock is still on it; called
  // by the process that commits before each save.
  void lock_folder_again_if_replaced();
  // Throws std::logic_error once the trainer was destroyed.
  void check_trainer_alive(const char* action) const;
  struct RankShard {
    int rank = 0;
    std::vector<NamedTensor> tensors;
  };
  // The phases of a save; prepare and complete are collectives when the ranks are processes.
  // `error`: this process's failure before the save could start (its snapshot), which every
  // process then fails the save with.
  std::unique_ptr<CheckpointWriter> prepare(int64_t step, std::exception_ptr error);
  void write_shards(CheckpointWriter& writer, const std::vector<RankShard>& shards);
  // Agrees on the writes (`write_error`: this process's), then commits on rank 0's process.
  // `executor` is the trainer's, taken between steps: a background commit runs while the
  // next step does, when Trainer::executor() refuses.
  void complete(PipelineExecutor& executor, CheckpointWriter& writer, const TrainingState& state,
                std::exception_ptr write_error);
  void wait_for_background();
  void failed(const std::exception& e);

  Trainer& trainer_;
  TrainerCheckpointOptions options_;
  std::thread background_;
  std::exception_ptr background_error_;
  std::atomic<bool> background_written_{false};
  // A background save whose commit waits for the other processes (set only with processes).
  struct PendingCommit {
    std::unique_ptr<CheckpointWriter> writer;
    TrainingState state;
    SaveTiming* timing = nullptr;
  };
  std::optional<PendingCommit> pending_commit_;
  int64_t last_saved_step_ = -1;
  int64_t last_started_step_ = -1;
  int64_t background_step_ = -1;  // the step of the background save not yet waited for
  bool continues_folder_ = false;
  bool finishing_ = false;  // in finish(): no training goes on after a failure
  double last_stall_seconds_ = 0.0;
  std::vector<SaveTiming> timings_;  // appended only after the background save is joined
  std::set<std::string> warned_;     // the commits' warnings said so far (complete())
  // The folder's lock (flock on the folder itself), held by the process of rank 0, which
  // commits, for the checkpointer's life: a second run saving into the same folder would
  // remove this one's unfinished step as a crash's leftover and prune its checkpoints.
  int folder_lock_ = -1;
  // The trainer was destroyed first (its destructor waited for the background write).
  bool trainer_gone_ = false;
  // Host memory of the async snapshots (pinned on CUDA), made at the first and reused: a
  // snapshot's blocks return to it when its background write ends, before the next save.
  std::shared_ptr<CachingAllocator> snapshot_memory_;
};

// Restores the checkpoint `path` names (DIR, DIR/latest or DIR/step_<N>) into the trainer:
// first checks every file, the model fingerprint, the tensors this layout expects, the data
// source and the batch size, then reads every rank's parameters and optimizer state (one
// thread per rank), and sets the step and the data position. Throws CheckpointError naming
// what does not match; the trainer is untouched when a check fails. An unusable trainer
// (Trainer::failure()) is refused with std::logic_error: make a new one to resume into.
Checkpoint resume_trainer(Trainer& trainer, const std::filesystem::path& path);

// The settings of this run that differ from those the checkpoint `saved` was trained with
// and that a resume may change (learning rate, its schedule and warm-up, weight decay,
// clipping, the optimizer's constants, the total steps, the micro-batches, the data-parallel
// replicas when the checkpoint records them, the data file's path when its bytes are the
// same, and the seed on data other than the Markov chain, where it changes nothing): one
// sentence each, e.g. "resuming with TrainConfig::optimizer.lr 0.1 where the checkpoint was
// saved with 0.001" (a count a schedule file fixes is said as the file's), for the caller to
// show. The batch size is not among them: resume_trainer refuses another one, since it fixes
// where each step's tokens start. `microbatches_origin`, when given, is where the caller's
// micro-batch count came from (a plan it chose, say), said in place of the setting: "resuming with
// 8 micro-batches <origin> where the checkpoint was saved with 4".
std::vector<std::string> resume_setting_changes(const Trainer& trainer, const TrainingState& saved,
                                                const std::string& microbatches_origin = {});

}  // namespace conveyor

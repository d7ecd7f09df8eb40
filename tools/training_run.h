#pragma once
// One `conveyor train` run once its config is resolved and its device placed (train_command.cpp):
// the outputs it opens before any work, the trainer it builds, the checkpoint it resumes from,
// its steps with their lines, saves and --eval-every evaluations, its close (the closing save
// and evaluation, the log) and what it says at the end, with its exit status. The parts are
// called once each, in the order declared.
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "engine/core/device.h"
#include "engine/train/trainer.h"
#include "engine/train/trainer_checkpoint.h"
#include "tools/held_out_evaluation.h"
#include "tools/mpi_launch.h"
#include "tools/output_file.h"
#include "tools/run_trace.h"
#include "tools/train_flags.h"
#include "tools/train_report.h"

namespace CLI {
class App;  // tools/cli_flags.h includes CLI11 where flags are declared or read
}  // namespace CLI

namespace conveyor::cli {

class TrainingRun {
 public:
  // Opens every output file (and locks the log) before any work. `device`: the one this
  // process trains on, config.device.
  TrainingRun(const TrainFlags& f, const CLI::App& cmd, const MpiSession& mpi,
              const TrainConfig& config, Device device);
  // The executor's stop request reads the run's output flag where it is.
  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;

  // Reads --data, builds the model, its optimizer state and the pipeline, and says what the
  // run is.
  void build();
  // Resumes when asked, makes the checkpointer, and refuses or notes what the run's limits
  // (--steps, --stop-after, --eval-every, --warmup, --save-dir) make of it.
  void resume_and_check_limits();
  // Takes the signals over: from here on a signal, or a failed write of stdout or --log-json,
  // stops the run after the step it comes in, on every process.
  void watch_signals_and_outputs();
  // The steps, each with its line, its save and its --eval-every evaluation.
  void train_steps();
  // The closing save and evaluation, the log's close, and a failed output ending every process.
  void close();
  // The summary, the evaluation's loss, the bubble and the weights' checksum.
  void report();
  // Where a run stopped by SIGPIPE stopped, and the exit status.
  void end();

 private:
  StepStats run_step(int64_t s);
  void print_step_line(int64_t s, const StepStats& st, RunTrace::Clock::time_point loop_begin);
  void save_after_step(int64_t s);
  // False when the run stops there.
  bool evaluate_between_steps(int64_t s);
  void finish_saves();
  void print_weights_checksum();

  std::shared_ptr<TokenSource> read_data() const;
  void print_limit_notes() const;
  void refuse_saves_the_folder_would_refuse() const;
  const char* limit_flag() const { return stops_early_ ? "--stop-after" : "--steps"; }

  void write_log(const std::string& text);
  void check_stdout();
  int stop_for_output(int request);
  double evaluate_and_record(bool announce);

  const TrainFlags& f_;
  const CLI::App& cmd_;
  const MpiSession& mpi_;
  const TrainConfig& config_;
  const Device device_;
  std::optional<OutputFile> json_log_;
  std::optional<ReplacedFile> trace_;
  std::unique_ptr<Trainer> trainer_;
  bool stops_early_ = false;  // by --stop-after
  int64_t last_step_to_run_ = 0;
  std::optional<HeldOutData> held_out_;
  std::unique_ptr<TrainerCheckpointer> checkpointer_;
  int64_t first_step_ = 0;  // past a resumed run's steps
  // The first failed write of the --log-json file (rank 0's: the only one that writes it). The
  // run stops as on a signal, with the last finished step saved, and fails with this error.
  std::string output_error_;
  std::atomic<bool> output_failed_{false};
  // Stopping for a failed output: at once in one process; under MPI after the step whose
  // all-reduce carried rank 0's request, the others knowing of the failure only from it.
  bool output_stop_ = false;
  bool one_process_ = false;
  RunTrace run_trace_;
  PipelineStepResult last_step_;
  RunTotals totals_;
  int signal_ = 0;
  // Each save is said once: a periodic one as it happens (announced_save_), except one of the
  // run's last step, said at the end with the folder and how long it held training.
  int64_t announced_save_ = -1;
  std::optional<double> last_step_save_held_;
  const int64_t eval_tokens_;
  bool last_step_unsaved_ = false;
  std::optional<double> eval_loss_;
};

}  // namespace conveyor::cli

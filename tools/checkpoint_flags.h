#pragma once
// `conveyor train`'s checkpoint flags: --save-dir, --save-every, --keep, --on-save-error,
// --async-save, --resume and --stop-after; their checks before any work, and the resume and
// checkpointer they ask for once the trainer exists.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/train/trainer.h"
#include "engine/train/trainer_checkpoint.h"

namespace CLI {
class App;  // tools/cli_flags.h includes CLI11 where flags are declared or read
}  // namespace CLI

namespace conveyor::cli {

struct CheckpointFlags {
  std::string save_dir;
  int64_t save_every = 0;
  int keep = 0;
  std::string on_save_error = "stop";
  bool async_save = false;
  std::string resume;
  int64_t stop_after = 0;
  // Not a flag: the settings a resume took from its checkpoint for the flags left out
  // (inherit_resumed_settings), said after the `resume` line.
  std::vector<std::string> inherited;
  // Not a flag: the model flags given with --resume (as "--d-model"), with which the model is
  // the flags' and not the checkpoint's, so that a refusal of another model can say why.
  std::vector<std::string> model_flags_given;
  // Not a flag: what the resume takes from the checkpoint (settings_left_to_checkpoint), which
  // the processes under mpirun compare as left out rather than by the flags' defaults.
  std::vector<std::string> left_to_checkpoint;
};

// The checkpoint path --resume names: the --save-dir folder for `latest`.
std::string resume_path(const CheckpointFlags& flags);

void add_checkpoint_flags(CLI::App* cmd, CheckpointFlags& flags);

// The saving flags on their own, before any work: each of them means nothing without
// --save-dir, and one given without it is refused rather than ignored (UsageError); and a
// --resume that names no checkpoint (UsageError).
void check_checkpoint_flags(const CheckpointFlags& flags, const CLI::App& cmd);

// Resumes (when asked) and makes the checkpointer (when saving, else null); checkpoint errors
// of the resume are the user's to fix, so they end the run as usage errors. `eval_batches`:
// the held-out batches the run evaluates (--eval-batches), which with --data follow the
// --steps training batches, so a resume under another --steps says they moved.
// `microbatches_origin`: what chose the micro-batch count, when no --microbatches did
// ("chosen by --partition auto"), for a resume under another count to say so.
std::unique_ptr<TrainerCheckpointer> setup_checkpoints(const CheckpointFlags& flags,
                                                       Trainer& trainer, int64_t eval_batches,
                                                       const std::string& microbatches_origin);

}  // namespace conveyor::cli

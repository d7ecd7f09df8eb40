#include "tools/checkpoint_flags.h"

#include <cstdio>
#include <utility>

#include "engine/train/checkpoint.h"
#include "engine/train/train_config.h"
#include "tools/cli_common.h"
#include "tools/cli_flags.h"
#include "tools/flag_terms.h"
#include "tools/output_file.h"

namespace conveyor::cli {

void add_checkpoint_flags(CLI::App* cmd, CheckpointFlags& f) {
  add_path_flag(cmd, "--save-dir", f.save_dir,
                "Save checkpoints into DIR (DIR/step_<N>, DIR/latest), and at the end of the run",
                "a folder name")
      ->type_name("DIR");
  add_int_flag(cmd, "--save-every", f.save_every, 0, 1000000000,
               "Save every N steps (0: only at the end)");
  add_int_flag(cmd, "--keep", f.keep, 0, 1000000, "Keep the newest K checkpoints (0: all)");
  cmd->add_option("--on-save-error", f.on_save_error,
                  "stop (end the run) or continue (report and train on) when a save fails")
      ->capture_default_str();
  add_switch(cmd, "--async-save", f.async_save,
             "Snapshot to host memory and write checkpoints in the background");
  add_path_flag(cmd, "--resume", f.resume,
                "Resume from checkpoint DIR, DIR/step_<N>, or latest (of --save-dir); the model, "
                "batch, seed, steps, optimizer and micro-batches left out are the checkpoint's",
                "a checkpoint (DIR, DIR/step_<N> or latest)")
      ->type_name("PATH");
  add_int_flag(cmd, "--stop-after", f.stop_after, 0, 1000000000,
               "Stop after step N (the learning-rate schedule still spans --steps; 0: never)");
}

namespace {

// A refusal of another model, where a model flag was given: the model's other settings are
// then the flags' defaults, not the checkpoint's, which the user may not expect.
std::string with_model_flags_given(const CheckpointFlags& f, const std::string& message) {
  if (f.model_flags_given.empty()) return message;
  return message + " (with " + listed(f.model_flags_given) +
         " given, --resume takes none of the model's settings from the checkpoint and the "
         "model flags left out keep their defaults; give the checkpoint's model flags, or none)";
}

}  // namespace

std::string resume_path(const CheckpointFlags& f) {
  return f.resume == "latest" ? f.save_dir : f.resume;
}

void check_checkpoint_flags(const CheckpointFlags& f, const CLI::App& cmd) {
  if (f.on_save_error != "stop" && f.on_save_error != "continue")
    throw not_one_of("--on-save-error", "stop or continue", f.on_save_error);
  if (f.resume == "latest" && f.save_dir.empty())
    throw UsageError("--resume latest needs --save-dir (the folder whose latest to resume)");
  // A path that names no checkpoint is refused before the model is built and the run is
  // described, as a missing input file is. Each process looks at its own path (a copy on its
  // node's own disk); what the checkpoint holds is checked as the resume opens it.
  if (!f.resume.empty()) {
    try {
      resolve_checkpoint_directory(resume_path(f));
    } catch (const CheckpointError& e) {
      throw UsageError(e.what());
    }
  }
  if (!f.save_dir.empty()) {
    refuse_kernel_file_system(f.save_dir,
                              "--save-dir folder '" + escaped_for_message(f.save_dir) + "'");
    return;
  }
  for (const char* flag : {"--save-every", "--keep", "--on-save-error", "--async-save"})
    if (cmd.count(flag))
      throw UsageError(std::string(flag) +
                       " says how to save checkpoints, and the run saves none without --save-dir "
                       "DIR; give --save-dir or leave " +
                       flag + " out");
}

std::unique_ptr<TrainerCheckpointer> setup_checkpoints(const CheckpointFlags& f, Trainer& trainer,
                                                       int64_t eval_batches,
                                                       const std::string& microbatches_origin) {
  std::unique_ptr<TrainerCheckpointer> checkpointer;
  try {
    if (!f.save_dir.empty()) {
      TrainerCheckpointOptions options;
      options.directory = f.save_dir;
      options.every = f.save_every;
      options.keep_last = f.keep;
      options.on_error =
          f.on_save_error == "stop" ? SaveErrorPolicy::kStop : SaveErrorPolicy::kContinue;
      options.async = f.async_save;
      checkpointer = std::make_unique<TrainerCheckpointer>(trainer, std::move(options));
    }
    if (!f.resume.empty()) {
      const Checkpoint ckpt = resume_trainer(trainer, resume_path(f));
      if (checkpointer) checkpointer->resumed_from(ckpt.directory());
      std::printf("resume %s at step %lld (saved with %zu stage(s), schedule %s)\n",
                  escaped_for_message(ckpt.directory().native()).c_str(),
                  static_cast<long long>(ckpt.step()), ckpt.state().stages.size(),
                  escaped_keeping_backslashes(ckpt.state().schedule).c_str());
      if (!f.inherited.empty()) {
        std::string list;
        for (const std::string& setting : f.inherited) list += (list.empty() ? "" : ", ") + setting;
        std::printf("note   the checkpoint's settings, for the flags left out: %s\n", list.c_str());
      }
      for (const std::string& change :
           resume_setting_changes(trainer, ckpt.state(), microbatches_origin))
        std::printf("note   %s\n", in_flag_terms(change).c_str());
      const int64_t saved_steps = ckpt.state().lr_schedule.total_steps;
      const TrainConfig& config = trainer.config();
      // Said of the saved run's held-out batches, not its evaluations: it may have run none.
      if (eval_batches > 0 && !config.data_path.empty() && saved_steps != config.steps)
        std::printf(
            "note   the held-out batches of --data follow the --steps training "
            "batches: now those after batch %lld, where the saved run's were those "
            "after batch %lld; evaluations before and after this resume do not "
            "compare\n",
            static_cast<long long>(config.steps), static_cast<long long>(saved_steps));
    }
  } catch (const CheckpointErrorOfEveryProcess& e) {
    throw ErrorOfEveryProcess(e.what(), kExitUsage);
  } catch (const CheckpointOfAnotherModel& e) {
    throw UsageError(with_model_flags_given(f, e.what()));
  } catch (const CheckpointError& e) {
    throw UsageError(e.what());
  }
  return checkpointer;
}

}  // namespace conveyor::cli

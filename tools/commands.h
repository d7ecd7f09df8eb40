#pragma once
// Each subcommand of `conveyor` registers itself here; its callback runs the command and
// throws cli::UsageError for bad input.
#include <CLI/CLI.hpp>

namespace conveyor::cli {

void register_train_command(CLI::App& app);     // tools/train_command.cpp
void register_schedule_command(CLI::App& app);  // tools/schedule_command.cpp
void register_ckpt_command(CLI::App& app);      // tools/ckpt_command.cpp
void register_plan_command(CLI::App& app);      // tools/plan_command.cpp

inline void register_commands(CLI::App& app) {
  register_train_command(app);
  register_schedule_command(app);
  register_ckpt_command(app);
  register_plan_command(app);
}

}  // namespace conveyor::cli

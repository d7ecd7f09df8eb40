#include "tools/cli_common.h"
#include "tools/commands.h"

namespace conveyor::cli {
// Replaced by the trainer's command (issue 2).
void register_train_command(CLI::App& app) {
  app.add_subcommand("train", "Train a model (not wired yet)");
}
}  // namespace conveyor::cli

#include "tools/cli_common.h"
#include "tools/commands.h"

namespace conveyor::cli {
// Replaced by the schedule IR's command (issue 3).
void register_schedule_command(CLI::App& app) {
  app.add_subcommand("schedule", "Generate, check, simulate and draw pipeline schedules (not wired yet)");
}
}  // namespace conveyor::cli

// The `conveyor` command line: `train`, `schedule`, ... Each subcommand registers itself with
// CLI11 and runs from its callback; errors end here as one line and a non-zero exit.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "engine/core/version.h"
#include "tools/cli_common.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"Conveyor: pipeline-parallel training engine"};
  app.set_version_flag("--version", conveyor::version());
  app.require_subcommand(1);
  conveyor::cli::register_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints help/version itself (exit 0) and parse errors as one message (exit 2).
    const int code = app.exit(e);
    return code == 0 ? 0 : conveyor::cli::kExitUsage;
  } catch (const conveyor::cli::UsageError& e) {
    std::fprintf(stderr, "conveyor: error: %s\n", e.what());
    return conveyor::cli::kExitUsage;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "conveyor: error: %s\n", e.what());
    return conveyor::cli::kExitUsage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "conveyor: error: %s\n", e.what());
    return conveyor::cli::kExitFailure;
  }
  return 0;
}

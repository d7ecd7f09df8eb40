// The `conveyor` command line: `train`, `schedule`, ... Each subcommand registers itself with
// CLI11 and runs from its callback; errors end here as one line and a non-zero exit.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <new>
#include <string>

#include "engine/core/version.h"
#include "tools/cli_common.h"
#include "tools/commands.h"

namespace {

// One error line: control characters in the message (echoed file names) are shown escaped,
// line breaks kept for the validator's grid that may follow the sentence. Backslashes pass
// as they are: many messages hold names escaped already, whose \t would otherwise print as
// \\t. What the command printed before goes out first, so that in one file or pipe the
// error comes last.
void print_error(const char* message) {
  std::fflush(stdout);
  std::string text;
  for (const char* c = message; *c; ++c)
    text += *c == '\n' || *c == '\\' ? std::string(1, *c)
                                     : conveyor::cli::escape_for_message(std::string(1, *c));
  std::fprintf(stderr, "conveyor: error: %s\n", text.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Conveyor: pipeline-parallel training engine"};
  app.set_version_flag("--version", conveyor::version());
  app.require_subcommand(1);
  app.footer(std::string("Example: conveyor train --stages 2 --steps 50\n") +
             conveyor::cli::kExitStatusText);
  conveyor::cli::register_commands(app);
  // CLI11 would only say "A subcommand is required"; name the word it did not know.
  if (argc > 1 && argv[1][0] != '-') {
    std::string known;
    bool found = false;
    for (const CLI::App* sub : app.get_subcommands({})) {
      known += (known.empty() ? "" : ", ") + sub->get_name();
      found = found || sub->get_name() == argv[1];
    }
    if (!found) {
      std::fprintf(stderr, "conveyor: error: unknown subcommand '%s', expected one of: %s\n",
                   conveyor::cli::escape_for_message(argv[1]).c_str(), known.c_str());
      return conveyor::cli::kExitUsage;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Help and version are CLI11's to print (exit 0); its parse errors (an unknown flag, a
    // missing value or argument) get the one line every other error gets.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    print_error((std::string(e.what()) + " (see --help)").c_str());
    return conveyor::cli::kExitUsage;
  } catch (const conveyor::cli::ExitRequest& e) {
    return e.code;
  } catch (const std::bad_alloc&) {
    print_error("out of memory while setting up the command; use smaller sizes");
    return conveyor::cli::kExitUsage;
  } catch (const conveyor::cli::UsageError& e) {
    print_error(e.what());
    return conveyor::cli::kExitUsage;
  } catch (const std::invalid_argument& e) {
    print_error(e.what());
    return conveyor::cli::kExitUsage;
  } catch (const std::exception& e) {
    print_error(e.what());
    return conveyor::cli::kExitFailure;
  }
  return 0;
}

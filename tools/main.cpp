// The `conveyor` command line: `train`, `schedule`, ... Each subcommand registers itself with
// CLI11 and runs from its callback; errors end here as one line and a non-zero exit.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <new>
#include <regex>
#include <string>

#include "engine/core/allocator.h"
#include "engine/core/version.h"
#include "tools/cli_common.h"
#include "tools/commands.h"
#include "tools/error_line.h"
#include "tools/interrupt.h"

using conveyor::cli::print_error_line;
using conveyor::cli::print_usage_error_line;

int main(int argc, char** argv) {
  // Before any command makes a file: an interrupt removes the temporaries of output files.
  conveyor::cli::install_cleanup_handlers();
  CLI::App app{"Conveyor: pipeline-parallel training engine"};
  app.set_version_flag("--version", conveyor::version());
  app.require_subcommand(1);
  app.footer(std::string("Example: conveyor train --stages 2 --steps 50\n") +
             conveyor::cli::kExitStatusText);
  conveyor::cli::register_commands(app);
  // CLI11 would only say "A subcommand is required"; name the word it did not know, at the
  // top (`conveyor trian`) and under a command of subcommands (`conveyor ckpt verfy`).
  CLI::App* level = &app;
  auto offered = [](const CLI::App* parent) {
    std::string known;
    for (const CLI::App* sub : parent->get_subcommands({}))
      if (!sub->get_group().empty())  // hidden ones (`ckpt demo`) are not offered
        known += (known.empty() ? "" : ", ") + sub->get_name();
    return known;
  };
  int i = 1;
  for (; i < argc && argv[i][0] != '-' && !level->get_subcommands({}).empty(); ++i) {
    CLI::App* found = nullptr;
    for (CLI::App* sub : level->get_subcommands({}))
      if (sub->get_name() == argv[i]) found = sub;
    if (found == nullptr) {
      const std::string of = level == &app ? "" : level->get_name() + " ";
      print_usage_error_line("unknown " + of + "subcommand '" +
                             conveyor::escaped_for_message(argv[i]) +
                             "', expected one of: " + offered(level));
      return conveyor::cli::kExitUsage;
    }
    level = found;
  }
  if (i == argc && level != &app && !level->get_subcommands({}).empty()) {
    print_usage_error_line(level->get_name() + " needs a subcommand, one of: " + offered(level));
    return conveyor::cli::kExitUsage;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ExtrasError&) {
    // CLI11 lists what it did not expect last first ("3 --chunks zbv --schedule"); the
    // command line's own order reads as typed, and names the command that refused it.
    std::string extras;
    for (const std::string& word : app.remaining(true))
      extras += (extras.empty() ? "" : " ") + conveyor::escaped_for_message(word);
    std::string command = "conveyor";
    for (const CLI::App* sub = level; sub != &app; sub = sub->get_parent())
      command.insert(8, " " + sub->get_name());
    print_usage_error_line(command + " does not take '" + extras + "'; " + command +
                           " --help lists what it takes");
    return conveyor::cli::kExitUsage;
  } catch (const CLI::ParseError& e) {
    // Help and version are CLI11's to print (exit 0); its parse errors (an unknown flag, a
    // missing value or argument) get the one line every other error gets.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    // A flag given twice reads "--steps: At Most 1 required but received 2" in CLI11's words.
    static const std::regex twice(R"(^(-[^:]+): At Most 1 required but received ([0-9]+)$)");
    std::cmatch given;
    if (std::regex_match(e.what(), given, twice)) {
      print_usage_error_line(
          given.str(1) + " was given " + given.str(2) +
          " times; give it once (a later value does not replace an earlier one)");
      return conveyor::cli::kExitUsage;
    }
    print_usage_error_line(std::string(e.what()) + " (see --help)");
    return conveyor::cli::kExitUsage;
  } catch (const conveyor::cli::ExitRequest& e) {
    return e.code;
  } catch (const std::bad_alloc& e) {
    // Commands that know where they were say so themselves (train: building the model, a
    // training step); one that reaches here may have failed at any point of its work.
    print_error_line(conveyor::error_sentence(e) + "; use smaller sizes or free some memory");
    return conveyor::cli::kExitUsage;
  } catch (const conveyor::cli::ErrorOfEveryProcess& e) {
    if (!conveyor::cli::waited_for_the_first_process()) print_error_line(e.what());
    return e.status();
  } catch (const conveyor::cli::UsageError& e) {
    print_usage_error_line(e.what());
    return conveyor::cli::kExitUsage;
  } catch (const std::invalid_argument& e) {
    print_usage_error_line(e.what());
    return conveyor::cli::kExitUsage;
  } catch (const std::exception& e) {
    print_error_line(e.what());
    return conveyor::cli::kExitFailure;
  }
  return 0;
}

#pragma once
// CLI11's parse errors ("--steps: 1 required INT missing", "path is required", "--memory-cap
// excludes --memory-limit-mb") said as the command line's other errors are: what was wrong,
// what was expected, with the flag or argument the user gives.
#include <CLI/CLI.hpp>
#include <cstddef>
#include <string>
#include <vector>

namespace conveyor::cli {

// "conveyor ckpt inspect": the words that name `command`, a subcommand of the top app (or the
// top app itself: "conveyor").
std::string command_words(const CLI::App& command);

// The subcommands of `parent` a user is offered, as "inspect, verify" (hidden ones left out).
std::string offered_subcommands(const CLI::App& parent);

// CLI11 reads a switch given `=` and nothing (`--quiet=`, or `--quiet={}`) as the switch
// alone. Such words of `words` (argv, from index `first`: those after `command`'s name, up to
// a `--`) are marked so that the parse refuses them as it refuses `--quiet=maybe`, and
// parse_error_sentence says them as typed.
void mark_empty_switch_values(const CLI::App& command, std::vector<std::string>& words,
                              size_t first);

// The sentence of the error line for `error`, thrown by `app.parse` while it read `command`'s
// flags and arguments (main.cpp finds `command` from the words before it parses). Words the
// command does not take are named first, whatever CLI11 threw: `ckpt inspect --jsn` is said
// as the unknown --jsn, not as the missing PATH after it. `typed` holds the words that followed
// `command`'s name, which tell an unknown flag's value from a PATH after it.
std::string parse_error_sentence(const CLI::ParseError& error, const CLI::App& app,
                                 const CLI::App& command, const std::vector<std::string>& typed);

}  // namespace conveyor::cli

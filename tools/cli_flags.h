#pragma once
// Flags as the commands declare them with CLI11: integers, switches, floats and paths checked
// as they are parsed, and the model a command's flags describe. Kept apart from
// tools/cli_common.h so that the files that only check and print do not compile CLI11,
// whose header costs each file that includes it about five seconds.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "layers/model.h"
#include "tools/cli_common.h"

namespace conveyor::cli {

// A flag's value as typed, escaped, or `value` where the flag was left out: messages quote
// what the user gave, not the double it became.
inline std::string given_number(const CLI::App& cmd, const std::string& flag, double value) {
  const CLI::Option* option = cmd.get_option_no_throw(flag);
  if (option == nullptr || option->count() == 0) return format_number(value);
  return escaped_for_message(option->results().front());
}

// An integer flag of any width, parsed by parse_int and checked against [lo, hi] (which must
// fit in T, so nothing narrows silently). The help shows the range and the default.
template <typename T>
CLI::Option* add_int_flag(CLI::App* cmd, const std::string& name, T& target, int64_t lo, int64_t hi,
                          const std::string& description) {
  static_assert(std::is_integral_v<T>);
  if (lo < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
      static_cast<uint64_t>(hi) > static_cast<uint64_t>(std::numeric_limits<T>::max()))
    throw std::logic_error("range of " + name + " does not fit its type");
  const std::string flag = name.substr(0, name.find(','));
  CLI::Option* opt = cmd->add_option_function<std::string>(
      name,
      [&target, flag, lo, hi](const std::string& text) {
        target = static_cast<T>(parse_int(text, flag, lo, hi));
      },
      description + " [" + std::to_string(lo) + ".." + std::to_string(hi) + "]");
  opt->type_name("INT")->default_str(std::to_string(target));
  return opt;
}

// A switch, on when given. Given twice it is refused as every other flag is (CLI11 reads a
// repeated switch once without a word), so a duplicated line in a script is seen.
inline CLI::Option* add_switch(CLI::App* cmd, const std::string& name, bool& target,
                               const std::string& description) {
  return cmd->add_flag(name, target, description)
      ->multi_option_policy(CLI::MultiOptionPolicy::Throw);
}

// A floating-point flag checked by parse_float at parse time, a number too small to compute
// with refused (refuse_vanishing).
inline CLI::Option* add_float_flag(CLI::App* cmd, const std::string& name, double& target,
                                   double lo, double hi, bool lo_open,
                                   const std::string& description) {
  const std::string flag = name.substr(0, name.find(','));
  CLI::Option* opt = cmd->add_option_function<std::string>(
      name,
      [&target, flag, lo, hi, lo_open](const std::string& text) {
        target = refuse_vanishing(parse_float(text, flag, lo, hi, lo_open), text, flag,
                                  !lo_open && lo <= 0.0);
      },
      description);
  opt->type_name("NUM")->default_str(format_number(target));
  return opt;
}

// A flag naming a file or a folder. An empty name is refused: `--save-dir "$DIR"` with DIR
// unset would otherwise train without saving, `--resume ""` start afresh and `--plan ""`
// run uniform stages, each without a word.
inline CLI::Option* add_path_flag(CLI::App* cmd, const std::string& name, std::string& target,
                                  const std::string& description,
                                  const std::string& expected = "a file name") {
  const std::string flag = name.substr(0, name.find(','));
  return cmd->add_option_function<std::string>(
      name,
      [&target, flag, expected](const std::string& text) {
        if (text.empty()) throw UsageError(flag + " expects " + expected + ", got an empty one");
        target = text;
      },
      description);
}

// The model of --preset with what --d-model, --layers, --hidden and --vocab override (train
// and plan take the same model flags). Without --hidden, a given --d-model keeps the preset's
// 4x MLP width.
inline ModelConfig preset_with_overrides(const std::string& preset, int64_t d_model, int64_t layers,
                                         int64_t hidden, int64_t vocab, const CLI::App& cmd) {
  ModelConfig model;
  try {
    model = model_preset(preset);
  } catch (const std::invalid_argument&) {
    throw not_one_of("--preset", "tiny, small or medium", preset);
  }
  if (cmd.count("--d-model")) model.d_model = d_model;
  if (cmd.count("--layers")) model.n_layers = layers;
  if (cmd.count("--hidden"))
    model.hidden = hidden;
  else if (cmd.count("--d-model"))
    model.hidden = 4 * d_model;
  if (cmd.count("--vocab")) model.vocab = vocab;
  return model;
}

}  // namespace conveyor::cli

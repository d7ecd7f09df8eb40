#include "tools/parse_errors.h"

#include <algorithm>
#include <cctype>
#include <optional>
#include <regex>
#include <string_view>
#include <vector>

#include "engine/schedule/input_file.h"  // escaped_for_message

namespace conveyor::cli {
namespace {

// Flags that CLI::Option::excludes keeps apart, and why: the refusal says what both do, so
// that the user knows which one to drop. A pair missing here is refused in general words.
struct ExclusivePair {
  std::string_view first;
  std::string_view second;
  std::string_view both;  // what both flags do, after "A and B both"
};
constexpr ExclusivePair kExclusivePairs[] = {
    {"--memory-cap", "--memory-limit-mb",
     "set each device's memory cap (--memory-limit-mb is the same cap in MiB)"},
};

std::string_view why_exclusive(const std::string& a, const std::string& b) {
  for (const ExclusivePair& pair : kExclusivePairs)
    if ((a == pair.first && b == pair.second) || (a == pair.second && b == pair.first))
      return pair.both;
  return {};
}

// What a value of CLI11's type name is, for the sentence of a flag given without one; TEXT
// and names it does not know are left to the flag's help.
std::string value_kind(const std::string& type) {
  if (type == "INT") return ", a whole number";
  if (type == "NUM") return ", a number";
  if (type == "FILE") return ", a file name";
  if (type == "DIR") return ", a folder name";
  if (type == "PATH") return ", a path";
  if (type == "SIZE") return ", a size such as 512MiB";
  return "";
}

// A flag as the user may have typed it: "-p/--stages" where it has a short name too, which
// CLI11's messages leave out.
std::string flag_names(const CLI::App& command, const std::string& name) {
  const CLI::Option* option = command.get_option_no_throw(name);
  if (option == nullptr) return name;
  std::string names;
  for (const std::string& s : option->get_snames()) names += "-" + s + "/";
  return names + name;
}

// `command`'s example, from the help's footer ("Example: conveyor ckpt inspect runs/ckpt/latest"),
// where it is one of this command (a subcommand without a footer of its own shows its parent's).
std::string footer_example(const CLI::App& command) {
  const std::string footer = command.get_footer();
  const std::string tag = "Example: ";
  if (footer.rfind(tag + command_words(command) + " ", 0) != 0) return "";
  return footer.substr(tag.size(), footer.find('\n') - tag.size());
}

// The sentence of a missing required argument (a positional such as ckpt inspect's PATH):
// what it is, from its help, and the command's usage with an example.
std::string missing_argument(const CLI::App& command, const CLI::Option& argument) {
  const std::string words = command_words(command);
  const std::string name = argument.get_name(true);
  std::string out = words + " needs " + name;
  std::string description = argument.get_description();
  // "A checkpoint folder ..." within the sentence; "DIR, ..." stays as it is.
  if (description.size() > 1 && std::isupper(static_cast<unsigned char>(description[0])) &&
      !std::isupper(static_cast<unsigned char>(description[1])))
    description[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(description[0])));
  if (!description.empty()) out += ", " + description;
  out += "; usage: " + words + " [OPTIONS] " + name;
  const std::string example = footer_example(command);
  if (!example.empty()) out += ", such as " + example;
  return out;
}

// The words of `typed` (what followed `command`'s name) that `command` does not take, in the
// order typed, or nothing where CLI11 read the line in a way this does not follow. CLI11 gives
// the word after a flag it does not know to the next free positional (`ckpt inspect --steps 1
// DIR` takes 1 as PATH and leaves DIR over); where words are left over, a word right after an
// unknown flag is that flag's value, as it would be were the flag known.
std::optional<std::vector<std::string>> unexpected_words(const CLI::App& command,
                                                         const std::vector<std::string>& typed) {
  std::vector<size_t> unknown;  // flags `command` does not know
  std::vector<size_t> loose;    // words neither a flag nor a known flag's value
  bool after_separator = false;
  for (size_t k = 0; k < typed.size(); ++k) {
    const std::string& word = typed[k];
    if (!after_separator && word == "--") {
      after_separator = true;
    } else if (after_separator || word.size() < 2 || word[0] != '-') {
      for (const CLI::App* sub : command.get_subcommands({}))
        if (sub->check_name(word)) return std::nullopt;
      loose.push_back(k);
    } else if (const CLI::Option* option =
                   command.get_option_no_throw(word.substr(0, word.find('=')))) {
      if (word.find('=') == std::string::npos && option->get_items_expected_min() > 0) ++k;
    } else {
      unknown.push_back(k);
    }
  }
  size_t positionals = 0;
  for (const CLI::Option* option : command.get_options())
    if (option->get_positional() && !option->nonpositional())
      positionals += static_cast<size_t>(std::max(option->get_items_expected_max(), 0));
  size_t spare = loose.size() > positionals ? loose.size() - positionals : 0;
  std::vector<bool> taken(typed.size(), false);  // words that are not the command's to read
  for (size_t k : unknown) {
    taken[k] = true;
    const bool is_loose = std::find(loose.begin(), loose.end(), k + 1) != loose.end();
    if (spare > 0 && typed[k].find('=') == std::string::npos && is_loose) {
      taken[k + 1] = true;
      --spare;
    }
  }
  // The loose words left fill the positionals in order; those after them are over.
  size_t filled = 0;
  for (size_t k : loose)
    if (!taken[k] && filled++ >= positionals) taken[k] = true;
  std::vector<std::string> words;
  for (size_t k = 0; k < typed.size(); ++k)
    if (taken[k]) words.push_back(typed[k]);
  return words;
}

// The same words, flags the same and as many, as CLI11's: whose reading of the line this
// follows.
bool same_reading(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  const auto flags = [](const std::vector<std::string>& words) {
    std::vector<std::string> out;
    for (const std::string& word : words)
      if (word.size() > 1 && word[0] == '-') out.push_back(word);
    std::sort(out.begin(), out.end());
    return out;
  };
  return a.size() == b.size() && flags(a) == flags(b);
}

// Put before the value of a switch that CLI11 would read as the switch alone, so that it
// refuses the word as one it cannot read as on or off; taken off again in the sentence.
constexpr std::string_view kUnreadMark = "\x1f";

}  // namespace

void mark_empty_switch_values(const CLI::App& command, std::vector<std::string>& words,
                              size_t first) {
  for (size_t k = first; k < words.size() && words[k] != "--"; ++k) {
    std::string& word = words[k];
    const size_t equals = word.find('=');
    if (word.size() < 3 || word[0] != '-' || equals == std::string::npos) continue;
    const std::string value = word.substr(equals + 1);
    if (!value.empty() && value != "{}") continue;
    const CLI::Option* option = command.get_option_no_throw(word.substr(0, equals));
    if (option != nullptr && option->get_items_expected_max() == 0 &&
        option != command.get_help_ptr() && option != command.get_help_all_ptr() &&
        option != command.get_version_ptr())
      word.insert(equals + 1, kUnreadMark);
  }
}

std::string command_words(const CLI::App& command) {
  std::string words;
  for (const CLI::App* sub = &command; sub->get_parent() != nullptr; sub = sub->get_parent())
    words.insert(0, " " + sub->get_name());
  return "conveyor" + words;
}

std::string offered_subcommands(const CLI::App& parent) {
  std::string known;
  for (const CLI::App* sub : parent.get_subcommands({}))
    if (!sub->get_group().empty())  // hidden ones (`ckpt demo`) are not offered
      known += (known.empty() ? "" : ", ") + sub->get_name();
  return known;
}

std::string parse_error_sentence(const CLI::ParseError& error, const CLI::App& app,
                                 const CLI::App& command, const std::vector<std::string>& typed) {
  const std::string words = command_words(command);
  const std::string help = words + " --help lists what it takes";
  // CLI11 lists what it did not expect last first ("3 --chunks zbv --schedule"); the command
  // line's own order reads as typed.
  std::vector<std::string> extras = app.remaining(true);
  if (!extras.empty()) {
    if (std::optional<std::vector<std::string>> unexpected = unexpected_words(command, typed);
        unexpected && same_reading(*unexpected, extras))
      extras = std::move(*unexpected);
    std::string shown;
    for (const std::string& word : extras)
      shown += (shown.empty() ? "" : " ") + escaped_for_message(word);
    return words + " does not take '" + shown + "'; " + help;
  }
  const std::string what = error.what();
  std::smatch m;
  // A flag given twice.
  static const std::regex twice(R"(^(-[^:]+): At Most 1 required but received ([0-9]+)$)");
  if (std::regex_match(what, m, twice))
    return m.str(1) + " was given " + m.str(2) +
           " times; give it once (a later value does not replace an earlier one)";
  // A flag at the end of the line, or followed by `=` and nothing, without its value.
  static const std::regex no_value(R"(^(-[^:]+): 1 required (\S+) missing$)");
  if (std::regex_match(what, m, no_value))
    return flag_names(command, m.str(1)) + " was given without a value; expected " + m.str(1) +
           " " + m.str(2) + value_kind(m.str(2)) + " (" + help + ")";
  // A switch given a value it cannot read as on or off (--tf32=maybe).
  static const std::regex not_a_switch_value(R"(^Could not convert: (-\S+) = (.*)$)");
  if (std::regex_match(what, m, not_a_switch_value)) {
    std::string value = m.str(2);
    if (value.starts_with(kUnreadMark)) value.erase(0, kUnreadMark.size());
    return m.str(1) + " is a switch: give it alone (or as " + m.str(1) + "=true or " + m.str(1) +
           "=false), got '" + escaped_for_message(value) + "'";
  }
  static const std::regex excludes(R"(^(-\S+) excludes (-\S+)$)");
  if (std::regex_match(what, m, excludes)) {
    const std::string_view both = why_exclusive(m.str(1), m.str(2));
    if (!both.empty())
      return m.str(1) + " and " + m.str(2) + " both " + std::string(both) +
             "; give only one of them";
    return m.str(1) + " and " + m.str(2) + " cannot be given together; give only one of them";
  }
  static const std::regex requires_flag(R"(^(-\S+) requires (-\S+)$)");
  if (std::regex_match(what, m, requires_flag))
    return m.str(1) + " needs " + m.str(2) + " too; give " + m.str(2) + ", or leave " + m.str(1) +
           " out";
  if (what == "A subcommand is required")
    return words + " needs a subcommand, one of: " + offered_subcommands(command);
  static const std::regex required(R"(^(\S+) is required$)");
  if (std::regex_match(what, m, required))
    if (const CLI::Option* argument = command.get_option_no_throw(m.str(1)))
      return missing_argument(command, *argument);
  return what + " (" + help + ")";
}

}  // namespace conveyor::cli

#include "tools/parse_errors.h"

#include <cctype>
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

}  // namespace

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
                                 const CLI::App& command) {
  const std::string words = command_words(command);
  const std::string help = words + " --help lists what it takes";
  // CLI11 lists what it did not expect last first ("3 --chunks zbv --schedule"); the command
  // line's own order reads as typed.
  const std::vector<std::string> extras = app.remaining(true);
  if (!extras.empty()) {
    std::string typed;
    for (const std::string& word : extras)
      typed += (typed.empty() ? "" : " ") + escaped_for_message(word);
    return words + " does not take '" + typed + "'; " + help;
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
  if (std::regex_match(what, m, not_a_switch_value))
    return m.str(1) + " is a switch: give it alone (or as " + m.str(1) + "=true or " + m.str(1) +
           "=false), got '" + escaped_for_message(m.str(2)) + "'";
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

#pragma once
// Shared by the subcommands of the `conveyor` command line.
#include <stdexcept>
#include <string>

#include "engine/schedule/generators.h"

namespace conveyor::cli {

// Bad flags, impossible configurations, malformed input files: printed as one line
// "conveyor: error: <message>" and the process exits with status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline constexpr int kExitUsage = 2;
inline constexpr int kExitFailure = 1;

// Every schedule kind, as help texts list them: "gpipe, 1f1b, interleaved, zbh1 or zbv".
// Read from the schedule module's own list, so a new kind shows up here by itself.
inline std::string schedule_choices_text() {
  const auto kinds = schedule::schedule_kinds();
  std::string out;
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (i > 0) out += i + 1 == kinds.size() ? " or " : ", ";
    out += kinds[i].name;
  }
  return out;
}

}  // namespace conveyor::cli

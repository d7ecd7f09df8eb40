#pragma once
// Shared by the subcommands of the `conveyor` command line.
#include <stdexcept>

namespace conveyor::cli {

// Bad flags, impossible configurations, malformed input files: printed as one line
// "conveyor: error: <message>" and the process exits with status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline constexpr int kExitUsage = 2;
inline constexpr int kExitFailure = 1;

}  // namespace conveyor::cli

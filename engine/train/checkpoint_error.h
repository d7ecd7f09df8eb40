#pragma once
// The one error of checkpoint files: a file that cannot be written or read, a file that is
// corrupt or not a checkpoint, or a checkpoint that does not fit the model that loads it. The
// message names the file and the problem, so a user can act on it.
#include <stdexcept>

namespace conveyor {

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace conveyor

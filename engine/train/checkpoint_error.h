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

// A path that names no checkpoint at all (nothing there, an ordinary file, a folder holding
// neither `latest` nor a manifest, an unfinished save), as opposed to a checkpoint that fails
// a check: a tool that checks checkpoints reports the first as bad input, the second as its
// finding.
class NotACheckpointError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

// A checkpoint whose tensors or model description are not those of the model that loads it:
// a program that chose the model from settings of its own may say which of them did.
class CheckpointOfAnotherModel : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

// A CheckpointError that several processes of a run throw with the same text: those that did
// not fail a phase, pointing to the process that did, and every process after a check of a
// table they all gathered. A program may say it once for the whole run.
class CheckpointErrorOfEveryProcess : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

}  // namespace conveyor

#pragma once
// What a checkpoint's save and resume share when the ranks are processes: a phase that
// succeeds on all of them or fails on all. Only engine/train/*.cpp include this.
#include <exception>
#include <string>
#include <vector>

#include "comm/transport.h"
#include "engine/pipeline/executor.h"
#include "engine/train/checkpoint_error.h"

namespace conveyor::detail {

// When the ranks are processes, a phase of a save or a resume succeeds on every process or
// fails on all: each says whether it failed (`local`: its own error, rethrown), and one that
// did not names the lowest rank whose process did (CheckpointErrorOfEveryProcess: every such
// process throws the same text). A process failing alone would end while
// the others train on and wait for it until their timeout. In one process: rethrows `local`.
// A transport error of the agreement itself (a peer that never came to it) says `what` it was.
inline void agree_across_processes(PipelineExecutor& executor, std::exception_ptr local,
                                   const std::string& what) {
  std::vector<double> failed(executor.num_world_ranks(), 0.0);
  if (local)
    for (int r : executor.local_ranks()) failed[r] = 1.0;
  try {
    executor.sum_over_processes(failed);
  } catch (const comm::TransportAborted&) {
    throw;  // another rank's failure, which its own message names
  } catch (const comm::TransportError& e) {
    // A wait given up says only that the sum's values did not come: say what the sum was.
    throw comm::TransportError(std::string(e.what()) + ", in which the processes agree whether " +
                               what + " succeeded");
  }
  if (local) std::rethrow_exception(local);
  for (size_t r = 0; r < failed.size(); ++r)
    if (failed[r] != 0.0)
      throw CheckpointErrorOfEveryProcess(what + " failed in the process of rank " +
                                          std::to_string(r) + "; its error says why");
}

}  // namespace conveyor::detail

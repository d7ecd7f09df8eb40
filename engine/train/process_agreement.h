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

// PipelineExecutor::sum_over_processes for a part of a save or a resume: a wait given up says
// only that the sum's values did not come, so its error goes on with `purpose` (", in which
// the processes ..."). Another rank's failure (TransportAborted) passes as it is: its own
// message names it.
inline void sum_over_processes_for(PipelineExecutor& executor, std::vector<double>& values,
                                   const std::string& purpose) {
  try {
    executor.sum_over_processes(values);
  } catch (const comm::TransportAborted&) {
    throw;
  } catch (const comm::TransportError& e) {
    throw comm::TransportError(std::string(e.what()) + purpose);
  }
}

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
  sum_over_processes_for(executor, failed,
                         ", in which the processes agree whether " + what + " succeeded");
  if (local) std::rethrow_exception(local);
  for (size_t r = 0; r < failed.size(); ++r)
    if (failed[r] != 0.0)
      throw CheckpointErrorOfEveryProcess(what + " failed in the process of rank " +
                                          std::to_string(r) + "; its error says why");
}

}  // namespace conveyor::detail

#pragma once
// The whole run on one clock, for `train --trace`: every step's and every held-out
// evaluation's span on the training loop, every checkpoint save's hold of the loop and its write
// (on a thread of its own with
// --async-save), the last step's per-rank timeline placed where that step ran, and the
// simulator's timeline of that step under its measured costs, from the same start. Opened in
// Perfetto or chrome://tracing, it shows whether a background save overlaps training, and the
// predicted step under the measured one.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "engine/train/trainer_checkpoint.h"

namespace conveyor {

class RunTrace {
 public:
  using Clock = std::chrono::steady_clock;
  // Steps beyond this are dropped from the front: the trace stays small enough to open.
  static constexpr size_t kMaxSteps = 20000;

  explicit RunTrace(Clock::time_point start = Clock::now()) : start_(start) {}
  // `pipeline_seconds`: the part of the step its pipeline ran (StepStats::seconds), its end;
  // the step's batch was drawn before it.
  void add_step(int64_t step, Clock::time_point begin, Clock::time_point end,
                double pipeline_seconds);
  // A held-out evaluation with the weights of `after_step`, on the training loop.
  void add_evaluation(int64_t after_step, Clock::time_point begin, Clock::time_point end);

  // The run's own process. The last step's measured ranks are the processes below it (tools
  // such as bench/planner_accuracy.py count them as those), its simulated ranks those from
  // kSimulatedPid, drawn after both.
  static constexpr int64_t kRunPid = 1000000;
  static constexpr int64_t kSimulatedPid = 2000000;

  // `last_step_trace`: chrome_trace_json of the last step (microseconds from its first
  // action), or empty; `simulated_step_trace`: chrome_trace_json of its simulation, on the
  // same clock, with processes from kSimulatedPid, or empty; `first_action_us`: when that
  // first action started, in microseconds from the start of the step's pipeline. Returns one
  // trace-event JSON document.
  std::string to_json(const std::string& last_step_trace, const std::string& simulated_step_trace,
                      double first_action_us, const std::vector<SaveTiming>& saves) const;

 private:
  // Times in nanoseconds from start_: the clock's own ticks, which the trace writes exactly.
  struct Step {
    int64_t step;
    int64_t begin_ns, end_ns;
    int64_t pipeline_begin_ns = 0;  // of a training step
  };
  int64_t ns(Clock::time_point t) const;

  Clock::time_point start_;
  std::deque<Step> steps_;
  std::vector<Step> evaluations_;  // by the step whose weights they evaluate
  size_t dropped_ = 0;
};

}  // namespace conveyor

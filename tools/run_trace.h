#pragma once
// The whole run on one clock, for `train --trace`: every step's span on the training loop,
// every checkpoint save's hold of the loop and its write (on a thread of its own with
// --async-save), and the last step's per-rank timeline placed where that step ran. Opened in
// Perfetto or chrome://tracing, it shows whether a background save overlaps training.
#include <chrono>
#include <cstddef>
#include <cstdint>
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
  void add_step(int64_t step, Clock::time_point begin, Clock::time_point end);

  // `last_step_trace`: chrome_trace_json of the last step (microseconds from its start), or
  // empty. Returns one trace-event JSON document.
  std::string to_json(const std::string& last_step_trace,
                      const std::vector<SaveTiming>& saves) const;

 private:
  struct Step {
    int64_t step;
    double begin_us, end_us;
  };
  double us(Clock::time_point t) const;

  Clock::time_point start_;
  std::vector<Step> steps_;
  size_t dropped_ = 0;
};

}  // namespace conveyor

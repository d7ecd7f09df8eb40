#pragma once
// The validator: runs before every execution and on loaded files. It proves that
//  - every action names a stage, micro-batch and peer that exist, on the rank owning the stage;
//  - every (stage, mb) has exactly one F and one backward (B, or I followed by W), F first;
//  - data crosses stages in order: locally (F of s before F of s+1, backward of s+1 before
//    backward of s) or through exactly one send after the producer and one receive before
//    the consumer;
//  - on every link (src -> dst) the sends and receives name the same messages in the same
//    order (FIFO), so an in-order transport such as NCCL matches them correctly;
//  - with replicas > 1, every stage has exactly one ALLREDUCE_GRAD, after every weight-gradient
//    action (B or W) of the stage; with replicas = 1, none;
//  - a simulated run (zero costs) reaches the end: no deadlock.
// On failure it throws ValidationError naming rank, position, action and rule, followed by
// the rank x step grid with the offending action marked.
#include <string>

#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"

namespace conveyor::schedule {

class ValidationError : public ScheduleError {
 public:
  ValidationError(const std::string& message, int rank, int index, std::string rule)
      : ScheduleError(message), rank_(rank), index_(index), rule_(std::move(rule)) {}
  int rank() const { return rank_; }
  int index() const { return index_; }
  // One of: "shape", "placement", "peer", "duplicate", "missing", "order", "allreduce", "fifo",
  // "deadlock".
  const std::string& rule() const { return rule_; }

 private:
  int rank_, index_;
  std::string rule_;
};

void validate(const Schedule& schedule);

// validate(), then simulate(schedule, costs), with the one run of simulate proving progress
// where validate() runs a run of its own: the same errors (ValidationError, a deadlock
// included) and the same result, in about the time of simulate alone.
SimResult validate_and_simulate(const Schedule& schedule, const CostModel& costs);

}  // namespace conveyor::schedule

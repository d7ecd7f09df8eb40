#include "engine/pipeline/plan_format.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/partition_sums.h"
#include "engine/pipeline/planner.h"

namespace conveyor {
namespace planning {

std::string ranges_text(const std::vector<StageRange>& ranges) {
  std::ostringstream out;
  for (size_t s = 0; s < ranges.size(); ++s)
    out << (s ? " " : "") << "[" << ranges[s].begin << "," << ranges[s].end << ")";
  return out.str();
}

}  // namespace planning

namespace {

using namespace planning;

std::string milliseconds(double seconds) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(3) << seconds * 1e3;
  return out.str();
}

// The step column: the step time, or "≥ bound" for a partition not proven the fastest (the
// sign takes three bytes and one column).
std::string step_column(const PlanCandidate& c) {
  std::ostringstream out;
  if (c.partition_proven)
    out << std::setw(14) << milliseconds(c.step_seconds);
  else
    out << std::setw(16) << "\u2265 " + milliseconds(c.step_lower_bound);
  return out.str();
}

// What a row not proven the fastest of its layout says of its partition: the fastest found,
// and why the search stopped.
std::string unproven_note(const PlanCandidate& c, const PlanCandidate* fastest, int fastest_rank) {
  const std::string found = " (fastest found " + milliseconds(c.step_seconds) + " ms; ";
  if (fastest && c.step_lower_bound >= fastest->step_seconds * (1 - kSlack))
    return found + "no partition of it beats #" + std::to_string(fastest_rank) +
           ", so the search stopped there)";
  return found + "not proven fastest: the partition search ran out of budget)";
}

// Each rank's peak, or one figure for ranks that all peak alike (the data-parallel row, whose
// rank list would otherwise run on for as many ranks as the plan has).
std::string memory_column(const std::vector<double>& peaks) {
  const std::string first = peaks.empty() ? std::string() : bytes_text(peaks.front());
  const bool alike = peaks.size() > 2 && std::all_of(peaks.begin(), peaks.end(), [&](double b) {
                       return bytes_text(b) == first;
                     });
  if (alike) return first + " on each of " + std::to_string(peaks.size());
  std::string out;
  for (size_t r = 0; r < peaks.size(); ++r) {
    if (r > 0) out += ' ';
    out += bytes_text(peaks[r]);
  }
  return out;
}

// "#3": a row's place by step time.
std::string row_number(int place) {
  std::string text = "#";
  text += std::to_string(place);
  return text;
}

std::string feasible_row(const PlanCandidate& c, const PlanCandidate* fastest, int fastest_rank) {
  std::ostringstream out;
  const std::string memory = memory_column(c.peak_bytes);
  out << step_column(c) << std::fixed << std::setprecision(1) << std::setw(8) << c.bubble * 100
      << "%  " << std::left << std::setw(11) << (c.pipelined ? to_string(c.recompute) : "none")
      << std::right << memory << " / "
      << (c.pipelined         ? ranges_text(c.ranges)
          : c.shard_optimizer ? "whole model on every device, optimizer state sharded "
                                "(TrainConfig::shard_optimizer)"
                              : "whole model on every device")
      << (c.partition_proven ? "" : unproven_note(c, fastest, fastest_rank));
  return out.str();
}

// A layout that cannot run: none of its partitions fits, or none that fits was found within
// the budget (then how fast one would be at best).
std::string rejected_row(const PlanCandidate& c) {
  const bool missed = c.pipelined && std::isfinite(c.step_lower_bound);
  std::string out = missed ? "  none found fitting" : "  does not fit";
  if (c.recompute.any()) out += " recomputing " + to_string(c.recompute);
  if (c.shard_optimizer) out += " sharing the optimizer state";
  out += ": " + c.rejected;
  if (missed)
    out += "; one that fits would take at least " + milliseconds(c.step_lower_bound) + " ms";
  return out;
}

}  // namespace

std::string format_plan(const Plan& plan) {
  std::ostringstream out;
  // Rows are numbered "#1", "#2", ... by step time: "rank" is a pipeline rank everywhere else.
  out << std::left << std::setw(5) << "#" << std::setw(20) << "layout" << std::right << std::setw(5)
      << "m" << std::setw(14) << "step (ms)" << std::setw(9) << "bubble"
      << "  " << std::left << std::setw(11) << "recompute"
      << "peak memory per rank / partition\n";
  int rank = 0, best_pipe_rank = 0;
  const PlanCandidate* best_pipe = nullptr;
  const PlanCandidate* dp = nullptr;
  for (const auto& c : plan.candidates) {
    if (c.rejected.empty()) {
      ++rank;
      if (c.pipelined && !best_pipe) best_pipe = &c, best_pipe_rank = rank;
      if (!c.pipelined && !dp) dp = &c;
    }
    out << std::left << std::setw(5) << (c.rejected.empty() ? row_number(rank) : std::string("-"))
        << std::setw(20) << c.layout << std::right << std::setw(5)
        << (c.microbatches > 0 ? std::to_string(c.microbatches) : "-")
        << (c.rejected.empty() ? feasible_row(c, best_pipe, best_pipe_rank) : rejected_row(c))
        << "\n";
  }
  if (best_pipe) {
    out << "#" << best_pipe_rank << " (" << best_pipe->layout << ", m=" << best_pipe->microbatches;
    if (plan.fastest_pipeline_proven)
      out << ") is proven the fastest pipeline: no partition of another layout beats it\n";
    else
      out << ") is the fastest pipeline found, not proven the fastest: a partition search ran "
             "out of budget first\n";
  }
  const std::string replicas =
      dp ? dp->layout + (dp->shard_optimizer
                             ? " sharing the optimizer state (TrainConfig::shard_optimizer)"
                             : "")
         : std::string();
  if (dp && !best_pipe)
    out << "no pipeline layout fits; " << replicas << " does\n";
  else if (dp && dp->step_seconds <= best_pipe->step_seconds)
    out << "pipelining loses for this model and batch: " << replicas
        << " is faster than the best pipeline (" << best_pipe->layout << ")\n";
  return out.str();
}

}  // namespace conveyor

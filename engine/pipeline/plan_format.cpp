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

// The step column: the step time, "~time" for a pipeline tied with others (PlanCandidate::tied),
// or "≥ bound" for a partition not proven the fastest (the sign takes three bytes and one
// column).
std::string step_column(const PlanCandidate& c, bool ties) {
  std::ostringstream out;
  if (c.partition_proven) {
    std::string step = c.tied && ties ? "~" : "";
    step += milliseconds(c.step_seconds);
    out << std::setw(14) << step;
  } else
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

std::string feasible_row(const PlanCandidate& c, const PlanCandidate* fastest, int fastest_rank,
                         bool ties) {
  std::ostringstream out;
  const std::string memory = memory_column(c.peak_bytes);
  out << step_column(c, ties) << std::fixed << std::setprecision(1) << std::setw(8)
      << c.bubble * 100 << "%  " << std::left << std::setw(11)
      << (c.pipelined ? to_string(c.recompute) : "none") << std::right << memory << " / "
      << (c.pipelined         ? ranges_text(c.ranges)
          : c.shard_optimizer ? "whole model on every device, optimizer state sharded "
                                "(TrainConfig::shard_optimizer)"
                              : "whole model on every device")
      << (c.partition_proven ? "" : unproven_note(c, fastest, fastest_rank))
      << (c.partition_tied
              ? " (tied with the fastest partition, " + milliseconds(c.step_lower_bound) +
                    " ms; chosen by memory, then the earlier cuts)"
              : "");
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

// "#1 (zbh1, m=8)".
std::string row_name(const PlanCandidate& c, int place) {
  return row_number(place) + " (" + c.layout + ", m=" + std::to_string(c.microbatches) + ")";
}

// "#1, #2 and #4".
std::string places_text(const std::vector<int>& places) {
  std::string out;
  for (size_t k = 0; k < places.size(); ++k)
    out += (k == 0 ? "" : k + 1 == places.size() ? " and " : ", ") + row_number(places[k]);
  return out;
}

// What the table says of the pipeline it puts first (`chosen`, at `place`): proven the fastest
// or not, and, where others tie with it (`tied`, the places of all of them), which and why it
// was chosen; `fastest` (at `fastest_place`) is the fastest where it gave way to `chosen`.
std::string fastest_line(const Plan& plan, const PlanCandidate& chosen, int place,
                         const PlanCandidate* fastest, int fastest_place,
                         const std::vector<int>& tied) {
  const std::string proof = plan.fastest_pipeline_proven
                                ? " is proven the fastest pipeline: no partition of another "
                                  "layout beats it"
                                : " is the fastest pipeline found, not proven the fastest: a "
                                  "partition search ran out of budget first";
  if (tied.size() < 2) return row_name(chosen, place) + proof + "\n";
  const std::string rows = places_text(tied) + " (marked ~)";
  const std::string ties =
      " differ from the fastest by less than two standard errors of the timing, too little for "
      "the measurements to tell apart; it needs the least memory of them";
  if (!fastest) return row_name(chosen, place) + proof + "; " + rows + ties + "\n";
  return row_name(chosen, place) + " is chosen: " + rows + ties + "; the fastest, " +
         row_name(*fastest, fastest_place) + "," + proof + "\n";
}

}  // namespace

std::string format_plan(const Plan& plan) {
  std::ostringstream out;
  // Rows are numbered "#1", "#2", ... by step time: "rank" is a pipeline rank everywhere else.
  out << std::left << std::setw(5) << "#" << std::setw(20) << "layout" << std::right << std::setw(5)
      << "m" << std::setw(14) << "step (ms)" << std::setw(9) << "bubble"
      << "  " << std::left << std::setw(11) << "recompute"
      << "peak memory per rank / partition\n";
  const bool ties = std::count_if(plan.candidates.begin(), plan.candidates.end(),
                                  [](const PlanCandidate& c) { return c.tied; }) > 1;
  int rank = 0, best_pipe_rank = 0, fastest_rank = 0;
  const PlanCandidate* best_pipe = nullptr;
  const PlanCandidate* fastest = nullptr;  // the fastest pipeline, where a tied one was chosen
  const PlanCandidate* dp = nullptr;
  std::vector<int> tied;
  for (const auto& c : plan.candidates) {
    if (c.rejected.empty()) {
      ++rank;
      if (c.pipelined && !best_pipe) best_pipe = &c, best_pipe_rank = rank;
      if (!c.pipelined && !dp) dp = &c;
      if (c.tied) tied.push_back(rank);
      if (c.tied && plan.fastest_pipeline_seconds > 0 && !fastest && &c != best_pipe &&
          c.step_seconds == plan.fastest_pipeline_seconds)
        fastest = &c, fastest_rank = rank;
    }
    out << std::left << std::setw(5) << (c.rejected.empty() ? row_number(rank) : std::string("-"))
        << std::setw(20) << c.layout << std::right << std::setw(5)
        << (c.microbatches > 0 ? std::to_string(c.microbatches) : "-")
        << (c.rejected.empty() ? feasible_row(c, best_pipe, best_pipe_rank, ties) : rejected_row(c))
        << "\n";
  }
  if (best_pipe) out << fastest_line(plan, *best_pipe, best_pipe_rank, fastest, fastest_rank, tied);
  const std::string replicas =
      dp ? dp->layout + (dp->shard_optimizer
                             ? " sharing the optimizer state (TrainConfig::shard_optimizer)"
                             : "")
         : std::string();
  if (dp && !best_pipe)
    out << "no pipeline layout fits; " << replicas << " does\n";
  else if (dp && dp->step_seconds <= (fastest ? fastest : best_pipe)->step_seconds)
    out << "pipelining loses for this model and batch: " << replicas
        << " is faster than the best pipeline (" << best_pipe->layout << ")\n";
  return out.str();
}

}  // namespace conveyor

#include "engine/pipeline/plan_ties.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <map>
#include <numeric>
#include <tuple>

namespace conveyor::planning {
namespace {

// Where a candidate stands in the order the planner lists layouts (kinds in plan()'s order,
// fewer chunks and micro-batches first, nothing recomputed first, the earlier cuts first): a
// key free of the clock's noise.
auto listing_order(const PlanCandidate& c) {
  using schedule::ScheduleKind;
  constexpr ScheduleKind kinds[] = {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZBH1,
                                    ScheduleKind::kZBV, ScheduleKind::kInterleaved};
  const auto kind = std::find(std::begin(kinds), std::end(kinds), c.kind) - std::begin(kinds);
  std::vector<int64_t> cuts;
  for (const StageRange& r : c.ranges) cuts.push_back(r.end);
  return std::make_tuple(kind, c.chunks, c.microbatches, c.recompute.any(), cuts);
}

// The least peak memory on the fullest rank, then over all ranks, then the first listed.
auto preference(const PlanCandidate& c) {
  const double total = std::accumulate(c.peak_bytes.begin(), c.peak_bytes.end(), 0.0);
  return std::make_tuple(*std::max_element(c.peak_bytes.begin(), c.peak_bytes.end()), total,
                         listing_order(c));
}

// A group's larger move.
double larger(const StepError& e) { return std::max(std::abs(e.up), std::abs(e.down)); }

double squares(const std::vector<StepError>& errors) {
  double sum = 0;
  for (const StepError& e : errors) sum += larger(e) * larger(e);
  return sum;
}

// The standard error of the difference of two step times planned from one table: its groups
// move both together.
double same_table_error(const std::vector<StepError>& a, const std::vector<StepError>& b) {
  std::map<int64_t, StepError> difference;
  for (const StepError& e : a) difference[e.group].up += e.up, difference[e.group].down += e.down;
  for (const StepError& e : b) difference[e.group].up -= e.up, difference[e.group].down -= e.down;
  double sum = 0;
  for (const auto& [group, e] : difference) sum += larger(e) * larger(e);
  return std::sqrt(sum);
}

}  // namespace

std::vector<StepError> step_errors(const LayoutSearch& layout, const std::vector<UnitCost>& units,
                                   const std::vector<StageRange>& ranges, double step) {
  // Groups by number; a unit of group -1 as group -1 - u, a number no group has.
  std::map<int64_t, std::vector<size_t>> groups;
  for (size_t u = 0; u < units.size(); ++u)
    if (units[u].time_error > 0)
      groups[units[u].group >= 0 ? units[u].group : -1 - static_cast<int64_t>(u)].push_back(u);
  std::vector<StepError> out;
  std::vector<UnitCost> moved = units;
  auto step_at = [&](const std::vector<size_t>& members, double sign) {
    for (const size_t u : members) {
      // An error past 100 % (a handful of runs, most slowed) shrinks the times to 0, not below.
      const double by = std::max(0.0, 1 + sign * units[u].time_error);
      moved[u].forward = units[u].forward * by,
      moved[u].backward_input = units[u].backward_input * by;
      moved[u].backward_weight = units[u].backward_weight * by;
    }
    const double moved_step = layout.step_with(moved, ranges);
    for (const size_t u : members) moved[u] = units[u];
    return moved_step - step;
  };
  for (const auto& [group, members] : groups)
    out.push_back({group, step_at(members, 1), step_at(members, -1)});
  return out;
}

double difference_error(const PlanCandidate& a, const PlanCandidate& b) {
  if (a.costs_tokens != b.costs_tokens)
    return std::sqrt(squares(a.step_errors) + squares(b.step_errors));
  return same_table_error(a.step_errors, b.step_errors);
}

TimedPartition partition_among_tied(const LayoutSearch& layout, const std::vector<UnitCost>& units,
                                    TimedPartition fastest) {
  auto key = [](const TimedPartition& p) {
    const double total = std::accumulate(p.peak_bytes.begin(), p.peak_bytes.end(), 0.0);
    std::vector<int64_t> cuts;
    for (const StageRange& r : p.ranges) cuts.push_back(r.end);
    return std::make_tuple(*std::max_element(p.peak_bytes.begin(), p.peak_bytes.end()), total,
                           cuts);
  };
  TimedPartition chosen = fastest;
  for (size_t k = 1; k < fastest.ranges.size(); ++k)
    for (const int64_t move : {-1, 1}) {
      TimedPartition next;
      next.ranges = fastest.ranges;
      next.ranges[k - 1].end += move, next.ranges[k].begin += move;
      if (next.ranges[k - 1].end <= next.ranges[k - 1].begin ||
          next.ranges[k].end <= next.ranges[k].begin || !layout.fits_memory(next.ranges))
        continue;
      next.step = layout.step_with(units, next.ranges);
      next.errors = step_errors(layout, units, next.ranges, next.step);
      if (next.step - fastest.step > kTieErrors * same_table_error(next.errors, fastest.errors))
        continue;
      next.peak_bytes = layout.memory(next.ranges);
      if (key(next) < key(chosen)) chosen = std::move(next);
    }
  return chosen;
}

std::vector<PlanCandidate>::iterator choose_among_tied(std::vector<PlanCandidate>& candidates,
                                                       const PlanCandidate& fastest) {
  auto chosen = candidates.end();
  for (auto it = candidates.begin(); it != candidates.end(); ++it) {
    PlanCandidate& c = *it;
    c.tied = false;
    if (!c.pipelined || !c.rejected.empty() || !c.partition_proven || c.peak_bytes.empty() ||
        c.step_errors.empty() || fastest.step_errors.empty())
      continue;
    c.tied = &c == &fastest ||
             c.step_seconds - fastest.step_seconds <= kTieErrors * difference_error(c, fastest);
    if (c.tied && (chosen == candidates.end() || preference(c) < preference(*chosen))) chosen = it;
  }
  return chosen;
}

}  // namespace conveyor::planning

// The search stage by stage: each prefix of stages bounded, the complete partitions simulated.
#include <algorithm>
#include <vector>

#include "engine/pipeline/partition_searcher.h"

namespace conveyor::planning {

void PartitionSearcher::Impl::finish() {
  double least = 0;
  for (int q = 0; q < ranks; ++q) least = std::max(least, bound.rank(q, f, i, w, stages));
  if (drop(least)) return;
  const PathBound path = path_bound(stages, n);
  if (drop(std::max(least, path.growing))) {
    if (path.growing > least) touch(path.growing_path);
    return;
  }
  least = std::max(least, path.growing);
  if (!one_stage_per_rank && !fits_cap(ranges)) return;
  if (exhausted || simulated_here >= budget.simulations || !affords_run()) {
    exhausted = true;
    return leave_open(least);
  }
  try_partition(ranges);
}

double PartitionSearcher::Impl::remaining(int k, int64_t e) {
  if (one_stage_per_rank) return completion[k + 1][e];
  levels.clear();
  for (int r : ranks_after[k]) levels.push_back(bound.busy(r, f, i, w, k + 1));
  std::sort(levels.begin(), levels.end());
  double water = bound.multiple * sums.compute.over(e, n), level = levels.front();
  size_t under = 1;
  for (; under < levels.size() && water >= (levels[under] - level) * under; ++under)
    water -= (levels[under] - level) * under, level = levels[under];
  return level + water / under;
}

bool PartitionSearcher::Impl::completes_within(int k, int64_t e, double level) {
  const double known_forwards = sums.forward.over(0, e);
  for (int r = 0; r < ranks; ++r) {
    double tail = 0, later = 0;
    for (int s = 0; s < std::min(bound.last[r], k + 1); ++s)
      tail += bound.split[s] ? i[s] : i[s] + w[s];
    for (int s : bound.own[r])
      if (s <= k) later += bound.after[r][s] * w[s];
    double head = known_forwards;
    if (bound.first[r] <= k) {
      head = 0;
      for (int s = 0; s < bound.first[r]; ++s) head += f[s];
    }
    rank_base[r] = head + bound.busy(r, f, i, w, k + 1);
    rank_slack[r] = tail - later;
  }
  int64_t at = e;
  for (int s = k + 1; s < stages; ++s) {
    const int r = schedule.placement.rank_of(s);
    const StepBound::Count& c = bound.counts[r][s];
    auto within = [&](int64_t end) {
      const double weight = sums.weight.over(at, end);
      const double rank = rank_base[r] + c.f * sums.forward.over(at, end) +
                          c.i * sums.input.over(at, end) + c.w * weight +
                          std::max(0.0, rank_slack[r] - bound.after[r][s] * weight);
      return rank <= level && fits(state[r] + sums.state.over(at, end), cap);
    };
    int64_t end = at;
    while (end < n && within(end + 1)) ++end;
    at = end;
  }
  return at == n;
}

void PartitionSearcher::Impl::place(int k, int64_t b) {
  const int r = schedule.placement.rank_of(k);
  const int64_t last_end = k == stages - 1 ? n : n - (stages - 1 - k);
  for (int64_t e = k == stages - 1 ? n : b + 1; e <= last_end; ++e) {
    // One stage per rank: the stage's memory is its own, checked here. Several: what the
    // rank's known stages hold only grows with more units, so past the cap no later cut
    // helps.
    ranges[k] = {b, e};
    if (one_stage_per_rank && !stage_fits(k, b, e)) continue;
    if (!one_stage_per_rank && cap > 0 && !fits(memory_of.known_stages(r, ranges, k + 1), cap))
      break;
    known = k + 1;
    f[k] = sums.forward.over(b, e), i[k] = sums.input.over(b, e), w[k] = sums.weight.over(b, e);
    // The rank's bound only grows with e: past the limit, stop.
    const double own = bound.rank(r, f, i, w, k + 1);
    if (drop(own)) break;
    if (k == stages - 1) {
      finish();
      break;
    }
    // Too few units here leave too much for the rest: try a later cut.
    double least = std::max(own, remaining(k, e));
    // Two stages a rank in a V: the ranks whose both stages are still to come.
    if (paired && k + 1 <= ranks) least = std::max(least, paired->after_prefix(k + 1, e));
    // Two stages a rank in a loop: the ranks whose both stages are still to come, or,
    // past the middle cut, those whose second stage is.
    if (looped && k + 1 <= ranks) least = std::max(least, looped->after_prefix(k + 1, e));
    if (looped && k + 1 > ranks)
      least = std::max(
          least, looped->inner(ranges[ranks - 1].end, k + 1 - ranks, ranges[k - ranks].end, e));
    if (drop(least)) continue;
    if (!one_stage_per_rank && !completes_within(k, e, limit())) {
      drop_beyond_limit();
      continue;
    }
    // Grows with e, as the relaxed simulation does, which it bounds from below.
    const PathBound path = path_bound(k + 1, e);
    if (drop(path.growing)) {
      touch(path.growing_path);
      break;
    }
    if (drop(path.spread)) {
      touch(path.spread_path);
      continue;
    }
    least = std::max(least, path.spread);
    if (relaxes(k)) {
      ++relaxed_here, ++out.relaxed, actions_here += replay.actions();
      const Relaxed relaxed = relaxed_step(schedule, replay, timed, f, i, w, k + 1, e, transfer);
      remember_path();
      // Only grows with e (each later stage's least unit is taken over fewer units), so
      // past the limit, stop.
      if (drop(relaxed.simulated)) break;
      least = std::max(least, relaxed.simulated);
    }
    if (exhausted || visits_here >= visit_limit || !affords_run()) {
      exhausted = true;
      leave_open(least);
      continue;
    }
    ++visits_here, ++out.visits;
    state[r] += sums.state.over(b, e);
    place(k + 1, e);
    state[r] -= sums.state.over(b, e);
  }
  f[k] = i[k] = w[k] = 0;
}

}  // namespace conveyor::planning

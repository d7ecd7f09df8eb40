#include "engine/pipeline/partition_search.h"

#include <algorithm>
#include <functional>

#include "engine/pipeline/partition_searcher.h"

namespace conveyor::planning {

double bottleneck_of(const Sums& sums, const std::vector<StageRange>& ranges,
                     const schedule::Placement& placement) {
  std::vector<double> per_rank(placement.num_ranks, 0.0);
  for (int s = 0; s < static_cast<int>(ranges.size()); ++s)
    per_rank[placement.rank_of(s)] += sums.compute.over(ranges[s]);
  return *std::max_element(per_rank.begin(), per_rank.end());
}

// The simulator's costs of a partition: per stage, the sums over its units.
schedule::CostModel cost_model(const std::vector<UnitCost>& units,
                               const std::vector<StageRange>& ranges, double transfer) {
  schedule::CostModel costs;
  costs.forward.clear(), costs.backward_input.clear(), costs.backward_weight.clear();
  for (const auto& r : ranges) {
    double f = 0, i = 0, w = 0, a = 0;
    for (int64_t u = r.begin; u < r.end; ++u)
      f += units[u].forward, i += units[u].backward_input, w += units[u].backward_weight,
          a += units[u].activation_bytes;
    costs.forward.push_back(f);
    costs.backward_input.push_back(i);
    costs.backward_weight.push_back(w);
    costs.activation_bytes.push_back(a);
  }
  costs.latency = transfer;
  return costs;
}

// Min over contiguous partitions of max over stages of cost(stage, begin, end), where a cost of
// +inf marks a stage that is not allowed: O(S · U²) dynamic programming. Empty when every
// partition has an infinite stage.
std::vector<StageRange> min_max_partition(
    int64_t units, int stages, const std::function<double(int, int64_t, int64_t)>& cost) {
  // best[s][u]: the smallest largest-stage cost putting units [0, u) into stages [0, s).
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(units + 1, kInf));
  std::vector<std::vector<int64_t>> cut(stages + 1, std::vector<int64_t>(units + 1, -1));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s)
    for (int64_t u = s; u <= units - (stages - s); ++u)
      for (int64_t start = s - 1; start < u; ++start) {
        if (best[s - 1][start] == kInf) continue;
        const double c = std::max(best[s - 1][start], cost(s - 1, start, u));
        if (c < best[s][u]) best[s][u] = c, cut[s][u] = start;
      }
  if (best[stages][units] == kInf) return {};
  std::vector<StageRange> ranges(stages);
  for (int s = stages, u = static_cast<int>(units); s >= 1; --s) {
    ranges[s - 1] = {cut[s][u], u};
    u = static_cast<int>(cut[s][u]);
  }
  return ranges;
}

PartitionSearcher::Impl::Impl(const Sums& sums, const std::vector<UnitCost>& timed,
                              const PartitionMemory& memory_of, const schedule::Schedule& schedule,
                              double cap, double transfer)
    : sums(sums),
      timed(timed),
      memory_of(memory_of),
      schedule(schedule),
      cap(cap),
      transfer(transfer),
      n(static_cast<int64_t>(timed.size())),
      stages(schedule.num_stages()),
      ranks(schedule.num_ranks()),
      one_stage_per_rank(schedule.placement.chunks == 1),
      bound(schedule),
      paired(PairedStageBound::applies(schedule.placement)
                 ? std::make_unique<PairedStageBound>(schedule, sums)
                 : nullptr),
      looped(LoopedPairBound::applies(schedule.placement)
                 ? std::make_unique<LoopedPairBound>(schedule, sums)
                 : nullptr),
      replay(schedule),
      budget_scale(std::max<int64_t>(kBudgetActions / std::max<int64_t>(replay.actions(), 1), 1)) {
  if (one_stage_per_rank && cap > 0) stage_fit.assign(stages * (n + 1) * (n + 1), -1);
  if (one_stage_per_rank) fill_completion();
  f.assign(stages, 0.0), i.assign(stages, 0.0), w.assign(stages, 0.0), state.assign(ranks, 0.0);
  rank_base.assign(ranks, 0.0), rank_slack.assign(ranks, 0.0), rank_compute.assign(ranks, 0.0);
  ranges.resize(stages);
  ranks_after.resize(stages);
  for (int k = 0; k < stages; ++k)
    for (int r = 0; r < ranks; ++r)
      if (std::any_of(bound.own[r].begin(), bound.own[r].end(), [&](int s) { return s > k; }))
        ranks_after[k].push_back(r);
  fill_least_units();
  node_f.assign(stages, 0.0), node_i.assign(stages, 0.0), node_w.assign(stages, 0.0);
}

bool PartitionSearcher::Impl::stage_fits(int k, int64_t b, int64_t e) {
  if (stage_fit.empty()) return true;
  int8_t& known = stage_fit[(k * (n + 1) + b) * (n + 1) + e];
  if (known < 0) known = fits(memory_of.stage(k, b, e), cap) ? 1 : 0;
  return known == 1;
}

void PartitionSearcher::Impl::fill_completion() {
  completion.assign(stages + 1, std::vector<double>(n + 1, kInf));
  completion[stages][n] = 0;
  for (int k = stages - 1; k >= 0; --k)
    for (int64_t b = k; b <= n - (stages - k); ++b) {
      double least = kInf;
      for (int64_t e = k == stages - 1 ? n : b + 1; e <= n - (stages - 1 - k); ++e) {
        if (completion[k + 1][e] == kInf || !stage_fits(k, b, e)) continue;
        least = std::min(least, std::max(bound.lone_stage(sums, k, b, e), completion[k + 1][e]));
      }
      completion[k][b] = least;
    }
}

void PartitionSearcher::Impl::fill_least_units() {
  least_f.assign((n + 1) * (n + 1), kInf), least_i = least_f, least_w = least_f;
  for (int64_t lo = 0; lo < n; ++lo) {
    double lf = kInf, li = kInf, lw = kInf;
    for (int64_t hi = lo; hi < n; ++hi) {
      lf = std::min(lf, timed[hi].forward), li = std::min(li, timed[hi].backward_input),
      lw = std::min(lw, timed[hi].backward_weight);
      least_f[lo * (n + 1) + hi] = lf, least_i[lo * (n + 1) + hi] = li,
                             least_w[lo * (n + 1) + hi] = lw;
    }
  }
}

void PartitionSearcher::Impl::remember_path() {
  CostPath path(replay.critical_path(), stages);
  for (const CostPath& known : paths)
    if (known.same_counts(path)) return;
  path.fill_completion(sums);
  path.used = ++path_clock, path.serial = ++path_serial;
  if (paths.size() < kPaths) return paths.push_back(std::move(path));
  *std::min_element(paths.begin(), paths.end(), [](const CostPath& a, const CostPath& b) {
    return a.used < b.used;
  }) = std::move(path);
}

PartitionSearcher::Impl::PathBound PartitionSearcher::Impl::path_bound(int known, int64_t end) {
  PathBound out;
  if (paths.empty()) return out;
  for (int s = known; s < stages; ++s) {
    // The last stage ends with the last unit.
    const int64_t lo = s == stages - 1 ? n - 1 : end + (s - known), hi = n - stages + s;
    node_f[s] = least_f[lo * (n + 1) + hi], node_i[s] = least_i[lo * (n + 1) + hi],
    node_w[s] = least_w[lo * (n + 1) + hi];
  }
  for (CostPath& path : paths) {
    const double prefix = path.known_length(f, i, w, known, transfer);
    double least = 0;
    for (int s = known; s < stages; ++s)
      least += path.f[s] * node_f[s] + path.i[s] * node_i[s] + path.w[s] * node_w[s];
    if (prefix + least > out.growing) out.growing = prefix + least, out.growing_path = &path;
    const double spread = prefix + path.completion[known][end];
    if (spread > out.spread) out.spread = spread, out.spread_path = &path;
  }
  return out;
}

bool PartitionSearcher::Impl::may_win_tie() {
  std::fill(rank_compute.begin(), rank_compute.end(), 0.0);
  for (int s = 0; s < known; ++s)
    rank_compute[schedule.placement.rank_of(s)] += sums.compute.over(ranges[s]);
  const double least = *std::max_element(rank_compute.begin(), rank_compute.end());
  if (least != best_bottleneck) return least < best_bottleneck;
  for (int s = 0; s < known; ++s)
    if (ranges[s].end != out.ranges[s].end) return ranges[s].end < out.ranges[s].end;
  return true;
}

void PartitionSearcher::Impl::try_partition(const std::vector<StageRange>& partition) {
  ++simulated_here, ++out.simulated, actions_here += replay.actions();
  const double step = replay.run(cost_model(timed, partition, transfer));
  remember_path();
  const double bottleneck = bottleneck_of(sums, partition, schedule.placement);
  if (out.ranges.empty() ||
      preferred(step, bottleneck, partition, out.step, best_bottleneck, out.ranges))
    out.ranges = partition, out.step = step, best_bottleneck = bottleneck;
}

void PartitionSearcher::Impl::take_root_bound() {
  if (rooted) return;
  rooted = true;
  std::vector<double> none(stages, 0.0);
  double least =
      RankWork(schedule, replay, 0,
               relaxed_step(schedule, replay, timed, none, none, none, 0, 0, transfer).extra)
          .level();
  if (one_stage_per_rank) least = std::max(least, completion[0][0]);
  if (paired) least = std::max(least, paired->inner(0, 0, n));
  if (looped) {
    prepare_looped();
    least = std::max(least, looped->least());
  }
  proved = std::max(proved, least);
}

bool PartitionSearcher::Impl::walk() {
  least_open = kInf;
  prepare_looped();
  // Under a cap, stage by stage: a prefix's memory is known there, and it prunes the most.
  // The loop's pairs only under a ceiling below the best found: its own-stage bounds fall
  // far short of its step times (7 % at the optimum of bench_planner's 26-unit model at p =
  // 8), which the stage-by-stage bounds (relaxed simulations, critical paths) see, while
  // under a ceiling near the DP's least the pair tables drop nearly every choice (there, at
  // 50 units, 510 prefixes prove a bound above zbv's step time where the stages by stage
  // took 90 thousand).
  if (paired && cap <= 0)
    place_pairs(0, {});
  else if (looped && cap <= 0 && ceiling < out.step)
    place_middles();
  else
    place(0, 0);
  // A prefix left with a bound tied with the best could only have won the tie.
  return least_open == kInf || (!out.ranges.empty() && least_open >= out.step * (1 - kSlack));
}

void PartitionSearcher::Impl::count_dropped(double value) {
  if (!counting || value >= counted_top) return;
  const double at = (value - ceiling) / (counted_top - ceiling) * kBuckets;
  ++dropped_above[std::clamp(static_cast<int>(at), 0, kBuckets - 1)];
}

Searched PartitionSearcher::Impl::search(const SearchBudget& asked, double asked_ceiling) {
  budget = {asked.simulations * budget_scale, asked.visits, asked.relaxed * budget_scale,
            asked.actions};
  relaxed_here = visits_here = actions_here = 0;
  exhausted = false;
  const bool deepens = cap <= 0 && (paired || (looped && asked_ceiling < out.step));
  if (deepens) take_root_bound();
  if (next_ceiling < 0) next_ceiling = proved;
  const int64_t lower_visits = budget.visits / kLowerShare;
  bool proven = false;
  for (int walks = 0;; ++walks) {
    const double top = std::min(asked_ceiling, out.step);  // kInf while none found
    const bool lower = deepens && walks < kMaxWalks && visits_here < lower_visits && top < kInf &&
                       next_ceiling < top * (1 - kSlack);
    ceiling = lower ? std::max(next_ceiling, proved) : asked_ceiling;
    visit_limit = lower ? lower_visits : visits_here + budget.visits;
    counting = lower, counted_top = top;
    std::fill(dropped_above.begin(), dropped_above.end(), 0);
    const int64_t visits_before = visits_here;
    proven = walk();
    // Not proven: no partition is faster than the least bound left open, or than the best.
    proved = std::max(proved, proven ? out.step : std::min(out.step, least_open));
    if (!lower || proven) break;
    if (exhausted) {
      if (visits_here < visit_limit) break;  // out of simulations or actions
      exhausted = false;                     // out of the lower walks' share: the last walk follows
      continue;
    }
    // Where the bounds dropped above this ceiling add up to kGrowth times this walk's
    // visits (the best found, when they never do).
    next_ceiling = top;
    const int64_t wanted = std::max<int64_t>(1, kGrowth * (visits_here - visits_before));
    int64_t taken = 0;
    for (int k = 0; k < kBuckets; ++k)
      if ((taken += dropped_above[k]) >= wanted) {
        next_ceiling = ceiling + (top - ceiling) * (k + 1) / kBuckets;
        break;
      }
  }
  counting = false;
  out.proven = proven || (!out.ranges.empty() && proved >= out.step * (1 - kSlack));
  out.lower_bound = out.proven ? out.step : std::min(out.step, proved);
  out.actions = actions_here;
  simulated_here = 0;
  return out;
}

PartitionSearcher::PartitionSearcher(const Sums& sums, const std::vector<UnitCost>& timed,
                                     const PartitionMemory& memory_of,
                                     const schedule::Schedule& schedule, double cap,
                                     double transfer)
    : impl_(std::make_unique<Impl>(sums, timed, memory_of, schedule, cap, transfer)) {}

PartitionSearcher::~PartitionSearcher() = default;

double PartitionSearcher::root_bound() {
  impl_->take_root_bound();
  return impl_->proved;
}

// Moving one cut by one unit while that helps makes the incumbent nearly optimal, so the
// bounds prune most prefixes: a few simulations bought here save many.
void PartitionSearcher::start_from(const std::vector<StageRange>& incumbent,
                                   int64_t max_simulations) {
  Impl& s = *impl_;
  const int64_t budget = max_simulations * s.budget_scale;
  // Whether `partition` fits and is faster than the best so far.
  auto attempt = [&](const std::vector<StageRange>& partition) {
    if (s.simulated_here >= budget || !s.fits_cap(partition)) return false;
    const double before = s.out.step;
    s.try_partition(partition);
    return s.out.step < before;
  };
  if (!incumbent.empty()) attempt(incumbent);
  // The partition the paired bound is least for: its bound is close to the optimum, so it
  // is often nearly as fast.
  if (s.paired) attempt(s.paired->least_partition());
  if (s.looped) {
    s.prepare_looped();
    const auto least = s.looped->least_partition();
    if (!least.empty()) attempt(least);
  }
  for (bool moved = !s.out.ranges.empty(); moved;) {
    moved = false;
    for (int k = 1; k < s.stages && !moved; ++k)
      for (int delta : {-1, 1}) {
        std::vector<StageRange> next = s.out.ranges;
        next[k - 1].end += delta, next[k].begin += delta;
        if (next[k - 1].end <= next[k - 1].begin || next[k].end <= next[k].begin) continue;
        if (attempt(next)) {
          moved = true;
          break;
        }
      }
  }
}

Searched PartitionSearcher::search(const SearchBudget& budget, double ceiling) {
  return impl_->search(budget, ceiling);
}

const Searched& PartitionSearcher::found() const { return impl_->out; }

// The partition whose largest rank memory is smallest, by the same search over memory: what
// a rank's known stages hold bounds its memory from below. Empty when `max_visits` ran out
// first.
std::vector<StageRange> leanest_partition(const Sums& sums, const PartitionMemory& memory_of,
                                          const schedule::Schedule& schedule, int64_t max_visits) {
  const int64_t n = static_cast<int64_t>(sums.compute.n);
  const int stages = schedule.num_stages();
  const schedule::Placement& placement = schedule.placement;
  if (placement.chunks == 1)
    return min_max_partition(n, stages,
                             [&](int s, int64_t b, int64_t e) { return memory_of.stage(s, b, e); });
  std::vector<StageRange> best, ranges(stages);
  double lowest = kInf;
  int64_t visits = 0;
  std::function<bool(int, int64_t)> place = [&](int k, int64_t b) {
    if (++visits > max_visits) return false;
    const int r = placement.rank_of(k);
    for (int64_t e = k == stages - 1 ? n : b + 1; e <= n - (stages - 1 - k); ++e) {
      ranges[k] = {b, e};
      if (memory_of.known_stages(r, ranges, k + 1) >= lowest) break;
      if (k == stages - 1) {
        const auto memory = memory_of(ranges);
        const double peak = *std::max_element(memory.begin(), memory.end());
        if (peak < lowest) lowest = peak, best = ranges;
        break;
      }
      if (!place(k + 1, e)) return false;
    }
    return true;
  };
  return place(0, 0) ? best : std::vector<StageRange>{};
}

}  // namespace conveyor::planning

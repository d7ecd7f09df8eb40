#include "engine/pipeline/partition_search.h"

#include <algorithm>
#include <functional>

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

namespace {

// See search_partition's budgets.
constexpr int64_t kBudgetActions = 4096;

// Lower bounds on the simulated step time of a partition, read off the schedule's lists. A rank
// runs its computes one at a time, so it ends no earlier than
//   head + busy + max(0, tail - after):
// busy, the sum of its computes; head, the forwards of every stage below the one of its first
// compute (that micro-batch must pass them first); tail, the gradient steps (I, or B when the
// stage does not split) of every stage below the one of its last gradient step (that
// micro-batch's gradient must pass them after it); after, the weight gradients the rank itself
// runs after that last gradient step. Transfers are left out: they can only add time.
struct StepBound {
  struct Count {
    double f = 0, i = 0, w = 0;  // how many F, I and W costs of a stage a rank runs
  };
  const schedule::Placement& placement;
  std::vector<std::vector<Count>> counts;  // [rank][stage]
  std::vector<std::vector<double>> after;  // [rank][stage]: W actions after the last gradient
  std::vector<int> first, last;            // per rank: stage of the first F, of the last I or B
  std::vector<bool> split;                 // per stage: its gradient step is I alone
  std::vector<std::vector<int>> own;       // per rank: its stages
  double multiple = kInf;  // the fewest F, I or W of one stage any rank runs (m, generated)

  explicit StepBound(const schedule::Schedule& schedule) : placement(schedule.placement) {
    using schedule::ActionKind;
    const int ranks = schedule.num_ranks(), stages = schedule.num_stages();
    counts.assign(ranks, std::vector<Count>(stages));
    after.assign(ranks, std::vector<double>(stages, 0.0));
    first.assign(ranks, 0), last.assign(ranks, 0), split.assign(stages, false);
    for (int r = 0; r < ranks; ++r) own.push_back(placement.stages_of(r));
    for (int r = 0; r < ranks; ++r) {
      bool started = false;
      for (const auto& a : schedule.ranks[r]) {
        Count& c = counts[r][a.stage];
        switch (a.kind) {
          case ActionKind::kForward:
            if (!started) first[r] = a.stage;
            started = true, c.f += 1;
            break;
          case ActionKind::kBackward:
          case ActionKind::kBackwardInput:
            c.i += 1, c.w += a.kind == ActionKind::kBackward ? 1 : 0;
            if (a.kind == ActionKind::kBackwardInput) split[a.stage] = true;
            last[r] = a.stage, started = true;
            std::fill(after[r].begin(), after[r].end(), 0.0);
            break;
          case ActionKind::kBackwardWeight:
            c.w += 1, after[r][a.stage] += 1;
            break;
          default:
            break;
        }
      }
      for (int s : own[r])
        multiple = std::min({multiple, counts[r][s].f, counts[r][s].i, counts[r][s].w});
    }
  }
  // Rank r's busy time with stage costs F, I, W, over the stages [0, known) only.
  double busy(int r, const std::vector<double>& f, const std::vector<double>& i,
              const std::vector<double>& w, int known) const {
    double total = 0;
    for (int s : own[r])
      if (s < known) total += counts[r][s].f * f[s] + counts[r][s].i * i[s] + counts[r][s].w * w[s];
    return total;
  }
  // The bound of rank r when the stages [0, known) have their costs; exact once every stage of
  // the rank and every stage below its first and last is known, smaller before.
  double rank(int r, const std::vector<double>& f, const std::vector<double>& i,
              const std::vector<double>& w, int known) const {
    double head = 0, tail = 0, later = 0;
    for (int s = 0; s < std::min(first[r], known); ++s) head += f[s];
    bool complete = last[r] < known;
    for (int s : own[r]) complete = complete && s < known;
    if (complete) {
      for (int s = 0; s < last[r]; ++s) tail += split[s] ? i[s] : i[s] + w[s];
      for (int s : own[r]) later += after[r][s] * w[s];
    }
    return head + busy(r, f, i, w, known) + std::max(0.0, tail - later);
  }
};

// Two lower bounds on the step time of every partition that begins with the stages
// [0, known), which cost f, i and w; the prefix ends at unit `end`, so stage j >= known starts
// within [end + j - known, n - stages + j] and holds at least the unit there with the least F,
// I and W.
struct Relaxed {
  // The schedule simulated with each later stage at those least costs. With every rank's list
  // fixed, the simulator's times are maxima and sums of the costs (no choice among ready
  // actions depends on them), so they never decrease when a cost grows: this bounds from below
  // the step time of every completion, bubbles included, and only grows with `end`.
  double simulated = 0;
  // At least `simulated`, and also counting the work the later stages must absorb: the units
  // [end, n) cost `extra` more compute than the least units the later stages were credited
  // with, and some rank runs that extra at least `multiple` times (see with_rank_work).
  double bound = 0;
};

// Water filling of the extra compute over the ranks holding later stages. Rank r's action j
// starts no earlier than its relaxed start S_j (monotone), and the rank then runs its later
// actions one at a time, so it ends no earlier than S_j + (their relaxed durations) + c_j *
// (the extra compute of its later stages), c_j being the fewest F, I or W of any of its later
// stages from j on. Each line (S_j + relaxed rest, c_j) is such a bound; the extra computes
// sum to `extra` whatever the cuts, so the step time is at least the least level L at which
// the ranks can absorb it: sum over ranks of min over lines (L - base) / c >= extra.
double with_rank_work(const schedule::Schedule& schedule, const schedule::Replay& sim,
                      int known, double extra) {
  using schedule::ActionKind;
  const int stages = schedule.num_stages(), ranks = schedule.num_ranks();
  struct Line {
    double base, per;
  };
  std::vector<std::vector<Line>> lines(ranks);
  std::vector<double> count_f(stages), count_i(stages), count_w(stages);
  for (int r = 0; r < ranks; ++r) {
    const std::vector<int> own = schedule.placement.stages_of(r);
    std::vector<int> later;
    for (int s : own)
      if (s >= known) later.push_back(s);
    if (later.empty()) continue;
    for (int s : later) count_f[s] = count_i[s] = count_w[s] = 0;
    const auto& list = schedule.ranks[r];
    double rest = 0;
    for (size_t j = list.size(); j-- > 0;) {
      const schedule::Action& a = list[j];
      if (!schedule::is_compute(a.kind)) continue;
      const schedule::ActionTiming& t = sim.timing(r, static_cast<int>(j));
      rest += t.end - t.start;
      if (a.stage < known) continue;
      if (a.kind == ActionKind::kForward) count_f[a.stage] += 1;
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput)
        count_i[a.stage] += 1;
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight)
        count_w[a.stage] += 1;
      double per = kInf;
      for (int s : later) per = std::min({per, count_f[s], count_i[s], count_w[s]});
      if (per <= 0) continue;
      // Scanning backwards `per` only grows: a line whose base is no higher than the new
      // one's is never the smaller (L - base) / per.
      const double base = t.start + rest;
      auto& mine = lines[r];
      while (!mine.empty() && mine.back().base <= base) mine.pop_back();
      mine.push_back({base, per});
    }
  }
  auto absorbed = [&](double level) {
    double total = 0;
    for (const auto& mine : lines) {
      if (mine.empty()) continue;
      double least = kInf;
      for (const Line& l : mine) least = std::min(least, (level - l.base) / l.per);
      total += std::max(0.0, least);
    }
    return total;
  };
  // Every base is at most the relaxed makespan, where each rank absorbs a share >= 0.
  double low = sim.makespan();
  if (absorbed(low) >= extra) return low;
  double high = low + extra * schedule.num_microbatches * 3;
  for (double step = extra; absorbed(high) < extra; step *= 2) high += step;
  for (int round = 0; round < 60 && high - low > 1e-12 * high; ++round) {
    const double mid = 0.5 * (low + high);
    (absorbed(mid) >= extra ? high : low) = mid;
  }
  return low;  // not enough at `low`: the least level is above it
}

Relaxed relaxed_step(const schedule::Schedule& schedule, schedule::Replay& replay,
                     const std::vector<UnitCost>& timed,
                     const std::vector<double>& f, const std::vector<double>& i,
                     const std::vector<double>& w, int known, int64_t end, double transfer) {
  const int stages = schedule.num_stages();
  const int64_t n = static_cast<int64_t>(timed.size());
  schedule::CostModel costs;
  costs.forward.assign(f.begin(), f.begin() + known);
  costs.backward_input.assign(i.begin(), i.begin() + known);
  costs.backward_weight.assign(w.begin(), w.begin() + known);
  double extra = 0;
  for (int64_t u = end; u < n; ++u) extra += timed[u].compute();
  for (int j = known; j < stages; ++j) {
    double least_f = kInf, least_i = kInf, least_w = kInf;
    // The last stage ends with the last unit.
    for (int64_t u = j == stages - 1 ? n - 1 : end + (j - known); u <= n - stages + j; ++u)
      least_f = std::min(least_f, timed[u].forward),
      least_i = std::min(least_i, timed[u].backward_input),
      least_w = std::min(least_w, timed[u].backward_weight);
    costs.forward.push_back(least_f);
    costs.backward_input.push_back(least_i);
    costs.backward_weight.push_back(least_w);
    extra -= least_f + least_i + least_w;
  }
  costs.latency = transfer;
  const double makespan = replay.run(costs);
  Relaxed out{makespan, makespan};
  if (known < stages && extra > 0) out.bound = with_rank_work(schedule, replay, known, extra);
  return out;
}

// Pruned comparisons leave a billionth of slack: the simulator adds times in another order,
// and a bound a few ulps over a tie must not hide it.
constexpr double kSlack = 1e-9;

// Whether partition a (step time, bottleneck, ranges) is preferred to b: faster, then more
// balanced, then the earlier cuts, so that ties are decided the same way every time.
bool preferred(double step_a, double bottleneck_a, const std::vector<StageRange>& a,
               double step_b, double bottleneck_b, const std::vector<StageRange>& b) {
  if (step_a != step_b) return step_a < step_b;
  if (bottleneck_a != bottleneck_b) return bottleneck_a < bottleneck_b;
  for (size_t s = 0; s < a.size() && s < b.size(); ++s)
    if (a[s].begin != b[s].begin) return a[s].begin < b[s].begin;
  return false;
}

}  // namespace

double relaxed_step_bound(const std::vector<UnitCost>& timed, const schedule::Schedule& schedule,
                          const std::vector<StageRange>& prefix, double transfer,
                          bool rank_work) {
  const int stages = schedule.num_stages();
  std::vector<double> f(stages, 0.0), i(stages, 0.0), w(stages, 0.0);
  for (size_t s = 0; s < prefix.size(); ++s)
    for (int64_t u = prefix[s].begin; u < prefix[s].end; ++u)
      f[s] += timed[u].forward, i[s] += timed[u].backward_input, w[s] += timed[u].backward_weight;
  schedule::Replay replay(schedule);
  const Relaxed relaxed = relaxed_step(schedule, replay, timed, f, i, w,
                                       static_cast<int>(prefix.size()),
                                       prefix.empty() ? 0 : prefix.back().end, transfer);
  return rank_work ? relaxed.bound : relaxed.simulated;
}

// Branch and bound over the contiguous partitions, stage by stage: a prefix is dropped when a
// rank's bound (StepBound), the least the remaining units add to the ranks still to come, or
// the prefix's relaxed simulation (relaxed_step, at most `max_relaxed` of them) already
// exceeds the best simulated step time, or when it overflows the cap; each complete
// partition that survives and fits is simulated. Exact for the simulated step time: a dropped
// partition is slower than one already simulated. `incumbent` (may be empty) is tried first.
Searched search_partition(const Sums& sums, const std::vector<UnitCost>& timed,
                          const PartitionMemory& memory_of, const schedule::Schedule& schedule,
                          double cap, double transfer, int64_t max_simulations,
                          int64_t max_visits, int64_t max_relaxed,
                          const std::vector<StageRange>& incumbent) {
  const int64_t n = static_cast<int64_t>(timed.size());
  const int stages = schedule.num_stages(), ranks = schedule.num_ranks();
  const schedule::Placement& placement = schedule.placement;
  const bool one_stage_per_rank = placement.chunks == 1;
  const StepBound bound(schedule);
  schedule::Replay replay(schedule);
  // The budgets count work: a simulation of a short schedule (few micro-batches) costs a
  // fraction of a long one's, so it gets as many more simulations, up to those of a schedule
  // of kBudgetActions actions; those with more keep the counts asked for.
  const int64_t actions = std::max<int64_t>(replay.actions(), 1);
  const int64_t scale = std::max<int64_t>(kBudgetActions / actions, 1);
  max_simulations *= scale, max_relaxed *= scale;
  Searched out;
  double best_bottleneck = kInf;
  int64_t visits = 0;

  auto fits_cap = [&](const std::vector<StageRange>& ranges) {
    const auto memory = memory_of(ranges);
    return fits(*std::max_element(memory.begin(), memory.end()), cap);
  };
  auto try_partition = [&](const std::vector<StageRange>& ranges) {
    if (out.simulated >= max_simulations) return void(out.proven = false);
    ++out.simulated;
    const double step = replay.run(cost_model(timed, ranges, transfer));
    const double bottleneck = bottleneck_of(sums, ranges, placement);
    if (out.ranges.empty() ||
        preferred(step, bottleneck, ranges, out.step, best_bottleneck, out.ranges))
      out.ranges = ranges, out.step = step, best_bottleneck = bottleneck;
  };
  if (!incumbent.empty() && fits_cap(incumbent)) try_partition(incumbent);
  // Moving one cut by one unit while that helps makes the incumbent nearly optimal, so the
  // bounds below prune most prefixes: a few simulations bought here save many.
  for (bool moved = !out.ranges.empty(); moved && out.proven;) {
    moved = false;
    for (int k = 1; k < stages && !moved && out.proven; ++k)
      for (int delta : {-1, 1}) {
        std::vector<StageRange> next = out.ranges;
        next[k - 1].end += delta, next[k].begin += delta;
        if (next[k - 1].end <= next[k - 1].begin || next[k].end <= next[k].begin) continue;
        if (!fits_cap(next)) continue;
        const double before = out.step;
        try_partition(next);
        if (out.step < before) {
          moved = true;
          break;
        }
      }
  }

  // Whether stage k of units [b, e) fits, remembered: the search asks again for every prefix.
  std::vector<int8_t> stage_fit(one_stage_per_rank && cap > 0 ? stages * (n + 1) * (n + 1) : 0, -1);
  auto stage_fits = [&](int k, int64_t b, int64_t e) {
    if (stage_fit.empty()) return true;
    int8_t& known = stage_fit[(k * (n + 1) + b) * (n + 1) + e];
    if (known < 0) known = fits(memory_of.stage(k, b, e), cap) ? 1 : 0;
    return known == 1;
  };
  std::vector<double> f(stages, 0.0), i(stages, 0.0), w(stages, 0.0), state(ranks, 0.0);
  std::vector<StageRange> ranges(stages);
  auto limit = [&] { return out.ranges.empty() ? kInf : out.step * (1 + kSlack); };
  // The least largest busy time of the ranks holding stages after `k`, when the units [e, n)
  // are still to be spread over them (water filling over their busy times so far).
  auto remaining = [&](int k, int64_t e) {
    std::vector<double> levels;
    for (int r = 0; r < ranks; ++r)
      if (std::any_of(bound.own[r].begin(), bound.own[r].end(), [&](int s) { return s > k; }))
        levels.push_back(bound.busy(r, f, i, w, k + 1));
    std::sort(levels.begin(), levels.end());
    double water = bound.multiple * sums.compute.over(e, n), level = levels.front();
    size_t under = 1;
    for (; under < levels.size() && water >= (levels[under] - level) * under; ++under)
      water -= (levels[under] - level) * under, level = levels[under];
    return level + water / under + sums.forward.over(0, e) * (one_stage_per_rank ? 1 : 0);
  };
  std::function<void(int, int64_t)> place = [&](int k, int64_t b) {
    if (!out.proven) return;
    if (++visits > max_visits) return void(out.proven = false);
    const int r = placement.rank_of(k);
    const int64_t last_end = k == stages - 1 ? n : n - (stages - 1 - k);
    for (int64_t e = k == stages - 1 ? n : b + 1; e <= last_end && out.proven; ++e) {
      // One stage per rank: the stage's memory is its own, checked here. Several: a rank's
      // state only grows with more units, so past the cap no longer cut helps.
      if (one_stage_per_rank && !stage_fits(k, b, e)) continue;
      if (!one_stage_per_rank && !fits(state[r] + sums.state.over(b, e), cap)) break;
      ranges[k] = {b, e};
      f[k] = sums.forward.over(b, e), i[k] = sums.input.over(b, e), w[k] = sums.weight.over(b, e);
      // The rank's bound only grows with e: past the best step time, stop.
      if (bound.rank(r, f, i, w, k + 1) > limit()) break;
      if (k == stages - 1) {
        bool within = true;
        for (int q = 0; q < ranks && within; ++q) within = bound.rank(q, f, i, w, stages) <= limit();
        if (within && (one_stage_per_rank || fits_cap(ranges))) try_partition(ranges);
        break;
      }
      // Too few units here leave too much for the rest: try a later cut.
      if (remaining(k, e) > limit()) continue;
      // The relaxed simulation sees the bubble the sums above miss. It only grows with e
      // (each later stage's least unit is taken over fewer units), so past the limit, stop;
      // the bound with the later work spread over the ranks need not, so it only skips e.
      // Only in the first three quarters of the stages: deeper, a prune drops few partitions
      // per simulation (measured at 8 ranks, 26 units: the last quarter proved two more
      // interleaved rows in three times the time); never next to the last stage, whose one
      // completion is simulated anyway.
      if (k + 2 < stages && 4 * k < 3 * stages && out.relaxed < max_relaxed) {
        ++out.relaxed;
        const Relaxed relaxed = relaxed_step(schedule, replay, timed, f, i, w, k + 1, e, transfer);
        if (relaxed.simulated > limit()) break;
        if (relaxed.bound > limit()) continue;
      }
      state[r] += sums.state.over(b, e);
      place(k + 1, e);
      state[r] -= sums.state.over(b, e);
    }
    f[k] = i[k] = w[k] = 0;
  };
  place(0, 0);
  return out;
}

// The partition whose largest rank memory is smallest, by the same search over memory: a
// rank's state bounds its memory from below. Empty when `max_visits` ran out first.
std::vector<StageRange> leanest_partition(const Sums& sums, const PartitionMemory& memory_of,
                                          const schedule::Schedule& schedule, int64_t max_visits) {
  const int64_t n = static_cast<int64_t>(sums.compute.n);
  const int stages = schedule.num_stages();
  const schedule::Placement& placement = schedule.placement;
  if (placement.chunks == 1)
    return min_max_partition(n, stages, [&](int s, int64_t b, int64_t e) {
      return memory_of.stage(s, b, e);
    });
  std::vector<StageRange> best, ranges(stages);
  std::vector<double> state(schedule.num_ranks(), 0.0);
  double lowest = kInf;
  int64_t visits = 0;
  std::function<bool(int, int64_t)> place = [&](int k, int64_t b) {
    if (++visits > max_visits) return false;
    const int r = placement.rank_of(k);
    for (int64_t e = k == stages - 1 ? n : b + 1; e <= n - (stages - 1 - k); ++e) {
      if (state[r] + sums.state.over(b, e) >= lowest) break;
      ranges[k] = {b, e};
      if (k == stages - 1) {
        const auto memory = memory_of(ranges);
        const double peak = *std::max_element(memory.begin(), memory.end());
        if (peak < lowest) lowest = peak, best = ranges;
        break;
      }
      state[r] += sums.state.over(b, e);
      const bool finished = place(k + 1, e);
      state[r] -= sums.state.over(b, e);
      if (!finished) return false;
    }
    return true;
  };
  return place(0, 0) ? best : std::vector<StageRange>{};
}

}  // namespace conveyor::planning

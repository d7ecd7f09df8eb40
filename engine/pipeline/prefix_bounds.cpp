#include "engine/pipeline/prefix_bounds.h"

#include <algorithm>

#include "engine/pipeline/partition_search.h"

namespace conveyor::planning {

double multiple = kInf;  // the fewest F, I or W of one stage any rank runs (m, generated)

StepBound::StepBound(const schedule::Schedule& schedule) : placement(schedule.placement) {
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
  split_below.assign(stages, false);
  for (int s = 1; s < stages; ++s) split_below[s] = split_below[s - 1] || split[s - 1];
}

RankWork::RankWork(const schedule::Schedule& schedule, const schedule::Replay& sim, int known,
                   double extra)
    : extra_(extra), makespan_(sim.makespan()), microbatches_(schedule.num_microbatches) {
  if (known >= schedule.num_stages() || extra <= 0) return;
  const int stages = schedule.num_stages(), ranks = schedule.num_ranks();
  lines_.resize(ranks);
  std::vector<double> count_f(stages), count_i(stages), count_w(stages);
  for (int r = 0; r < ranks; ++r) {
    std::vector<int> later;
    for (int s : schedule.placement.stages_of(r))
      if (s >= known) later.push_back(s);
    if (later.empty()) continue;
    for (int s : later) count_f[s] = count_i[s] = count_w[s] = 0;
    add_lines(schedule.ranks[r], sim, r, known, later, count_f, count_i, count_w);
  }
}

double RankWork::level() const {
  // Every base is at most the relaxed makespan, where each rank absorbs a share >= 0.
  double low = makespan_;
  if (lines_.empty() || absorbed(low) >= extra_) return low;
  double high = low + extra_ * microbatches_ * 3;
  for (double step = extra_; absorbed(high) < extra_; step *= 2) high += step;
  for (int round = 0; round < 60 && high - low > 1e-12 * high; ++round) {
    const double mid = 0.5 * (low + high);
    (absorbed(mid) >= extra_ ? high : low) = mid;
  }
  return low;  // not enough at `low`: the least level is above it
}

void RankWork::add_lines(const std::vector<schedule::Action>& list, const schedule::Replay& sim,
                         int r, int known, const std::vector<int>& later,
                         std::vector<double>& count_f, std::vector<double>& count_i,
                         std::vector<double>& count_w) {
  using schedule::ActionKind;
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
    auto& mine = lines_[r];
    while (!mine.empty() && mine.back().base <= base) mine.pop_back();
    mine.push_back({base, per});
  }
}

double RankWork::absorbed(double level) const {
  double total = 0;
  for (const auto& mine : lines_) {
    if (mine.empty()) continue;
    double least = kInf;
    for (const Line& l : mine) least = std::min(least, (level - l.base) / l.per);
    total += std::max(0.0, least);
  }
  return total;
}

Relaxed relaxed_step(const schedule::Schedule& schedule, schedule::Replay& replay,
                     const std::vector<UnitCost>& timed, const std::vector<double>& f,
                     const std::vector<double>& i, const std::vector<double>& w, int known,
                     int64_t end, double transfer) {
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
  return {replay.run(costs), extra};
}

bool preferred(double step_a, double bottleneck_a, const std::vector<StageRange>& a, double step_b,
               double bottleneck_b, const std::vector<StageRange>& b) {
  if (step_a != step_b) return step_a < step_b;
  if (bottleneck_a != bottleneck_b) return bottleneck_a < bottleneck_b;
  for (size_t s = 0; s < a.size() && s < b.size(); ++s)
    if (a[s].begin != b[s].begin) return a[s].begin < b[s].begin;
  return false;
}

double relaxed_step_bound(const std::vector<UnitCost>& timed, const schedule::Schedule& schedule,
                          const std::vector<StageRange>& prefix, double transfer, bool rank_work) {
  const int stages = schedule.num_stages();
  std::vector<double> f(stages, 0.0), i(stages, 0.0), w(stages, 0.0);
  for (size_t s = 0; s < prefix.size(); ++s)
    for (int64_t u = prefix[s].begin; u < prefix[s].end; ++u)
      f[s] += timed[u].forward, i[s] += timed[u].backward_input, w[s] += timed[u].backward_weight;
  schedule::Replay replay(schedule);
  const Relaxed relaxed =
      relaxed_step(schedule, replay, timed, f, i, w, static_cast<int>(prefix.size()),
                   prefix.empty() ? 0 : prefix.back().end, transfer);
  return rank_work
             ? RankWork(schedule, replay, static_cast<int>(prefix.size()), relaxed.extra).level()
             : relaxed.simulated;
}

CostPath::CostPath(const std::vector<schedule::Action>& steps, int stages)
    : f(stages, 0.0), i(stages, 0.0), w(stages, 0.0) {
  using schedule::ActionKind;
  for (const schedule::Action& a : steps) switch (a.kind) {
      case ActionKind::kForward:
        f[a.stage] += 1;
        break;
      case ActionKind::kBackward:
        i[a.stage] += 1, w[a.stage] += 1;
        break;
      case ActionKind::kBackwardInput:
        i[a.stage] += 1;
        break;
      case ActionKind::kBackwardWeight:
        w[a.stage] += 1;
        break;
      case ActionKind::kAllReduceGrad:  // none in a planned schedule; left out, it only
        break;                          // shortens the path
      default:
        transfers += schedule::is_send(a.kind) ? 1 : 0;
        break;
    }
  below_f.assign(stages + 1, 0.0), below_i = below_f, below_w = below_f;
  for (int s = 0; s < stages; ++s)
    below_f[s + 1] = below_f[s] + f[s], below_i[s + 1] = below_i[s] + i[s],
                below_w[s + 1] = below_w[s] + w[s];
}

bool CostPath::same_counts(const CostPath& o) const {
  return f == o.f && i == o.i && w == o.w && transfers == o.transfers;
}

double CostPath::known_length(const std::vector<double>& sf, const std::vector<double>& si,
                              const std::vector<double>& sw, int known, double transfer) const {
  double total = transfers * transfer;
  for (int s = 0; s < known; ++s) total += f[s] * sf[s] + i[s] * si[s] + w[s] * sw[s];
  return total;
}

void CostPath::fill_completion(const Sums& sums) {
  const int stages = static_cast<int>(f.size());
  const int64_t n = sums.compute.n;
  completion.assign(stages + 1, std::vector<double>(n + 1, kInf));
  completion[stages][n] = 0;
  for (int k = stages - 1; k >= 0; --k)
    for (int64_t b = k; b <= n - (stages - k); ++b) {
      double least = kInf;
      for (int64_t e = k == stages - 1 ? n : b + 1; e <= n - (stages - 1 - k); ++e)
        least = std::min(least, f[k] * sums.forward.over(b, e) + i[k] * sums.input.over(b, e) +
                                    w[k] * sums.weight.over(b, e) + completion[k + 1][e]);
      completion[k][b] = least;
    }
}

}  // namespace conveyor::planning

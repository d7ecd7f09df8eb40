#include "engine/pipeline/stage_bounds.h"

#include <algorithm>

namespace conveyor::planning {

OwnStageBound::OwnStageBound(const schedule::Schedule& schedule, const Sums& sums)
    : sums_(sums), n_(sums.compute.n) {
  using schedule::ActionKind;
  const int stages = schedule.num_stages();
  std::vector<bool> split(stages, false);
  for (const auto& list : schedule.ranks)
    for (const auto& a : list)
      if (a.kind == ActionKind::kBackwardInput) split[a.stage] = true;
  split_below_.assign(stages, false), split_above_.assign(stages, false);
  for (int s = 1; s < stages; ++s) split_below_[s] = split_below_[s - 1] || split[s - 1];
  for (int s = stages - 2; s >= 0; --s) split_above_[s] = split_above_[s + 1] || split[s + 1];
  const int last_microbatch = schedule.num_microbatches - 1;
  for (int r = 0; r < schedule.num_ranks(); ++r) {
    Rank rank;
    rank.stages = schedule.placement.stages_of(r);
    const size_t own = rank.stages.size();
    std::vector<int> index_of(stages, -1);
    for (size_t k = 0; k < own; ++k) index_of[rank.stages[k]] = static_cast<int>(k);
    const auto& list = schedule.ranks[r];
    auto gradient = [](ActionKind k) {
      return k == ActionKind::kBackward || k == ActionKind::kBackwardInput;
    };
    int last = -1;
    for (int j = 0; j < static_cast<int>(list.size()); ++j)
      if (gradient(list[j].kind)) last = j;
    // Counts from each action on, scanning backwards; a line opens at the first forward and
    // the first gradient step of each own stage.
    std::vector<double> f(own, 0.0), i(own, 0.0), w(own, 0.0);
    rank.after_f = rank.after_i = rank.after_w = f;
    rank.relays.resize(own);
    std::vector<Line> first_forward(own), first_gradient(own);
    std::vector<bool> has_forward(own, false), has_gradient(own, false);
    for (int j = static_cast<int>(list.size()); j-- > 0;) {
      const schedule::Action& a = list[j];
      if (!schedule::is_compute(a.kind) || a.kind == ActionKind::kAllReduceGrad) continue;
      const int k = index_of[a.stage];
      if (k < 0) continue;
      // The counts after this action, before it adds its own.
      if (gradient(a.kind) && a.microbatch == last_microbatch)
        rank.relays[k] = {j, {}, {}, {}, f, i, w};
      const bool forward = a.kind == ActionKind::kForward;
      f[k] += forward, i[k] += gradient(a.kind),
          w[k] += a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight;
      if (j > last) rank.after_f = f, rank.after_i = i, rank.after_w = w;
      if (j == last) rank.last_own = k;
      if (gradient(a.kind) && a.microbatch == last_microbatch)
        rank.relays[k].from_f = f, rank.relays[k].from_i = i, rank.relays[k].from_w = w;
      if (forward) first_forward[k] = {k, j, false, j <= last, f, i, w}, has_forward[k] = true;
      if (gradient(a.kind))
        first_gradient[k] = {k, j, true, j <= last, f, i, w}, has_gradient[k] = true;
    }
    rank.total_f = f, rank.total_i = i, rank.total_w = w;
    for (size_t k = 0; k < own; ++k) {
      if (has_forward[k]) rank.lines.push_back(first_forward[k]);
      if (has_gradient[k]) rank.lines.push_back(first_gradient[k]);
    }
    ranks_.push_back(std::move(rank));
  }
}

double OwnStageBound::busy(int r, const StageRange* own) const {
  const Rank& rank = ranks_[r];
  double total = 0;
  for (size_t k = 0; k < rank.stages.size(); ++k)
    total += rank.total_f[k] * sums_.forward.over(own[k]) +
             rank.total_i[k] * sums_.input.over(own[k]) +
             rank.total_w[k] * sums_.weight.over(own[k]);
  return total;
}

OwnStageBound::Terms OwnStageBound::terms(int r, const StageRange* own, int relay_own) const {
  const Rank& rank = ranks_[r];
  const size_t count = rank.stages.size();
  double fs[8], is[8], ws[8];  // two to a few stages a rank
  std::vector<double> heap;
  double* F = fs;
  double* I = is;
  double* W = ws;
  if (count > 8) heap.resize(3 * count), F = heap.data(), I = F + count, W = I + count;
  auto work = [&](const std::vector<double>& cf, const std::vector<double>& ci,
                  const std::vector<double>& cw) {
    double total = 0;
    for (size_t k = 0; k < count; ++k) total += cf[k] * F[k] + ci[k] * I[k] + cw[k] * W[k];
    return total;
  };
  for (size_t k = 0; k < count; ++k)
    F[k] = sums_.forward.over(own[k]), I[k] = sums_.input.over(own[k]),
    W[k] = sums_.weight.over(own[k]);
  const double later = work(rank.after_f, rank.after_i, rank.after_w);
  double tail = 0;
  if (rank.last_own >= 0) {
    const int s = rank.stages[rank.last_own];
    const int64_t b = own[rank.last_own].begin;
    tail = sums_.input.over(0, b) + (split_below_[s] ? 0.0 : sums_.weight.over(0, b));
  }
  const double beyond = std::max(0.0, tail - later);
  const double all_forwards = sums_.forward.over(0, n_);
  const Relay* relay =
      relay_own >= 0 && rank.relays[relay_own].at >= 0 ? &rank.relays[relay_own] : nullptr;
  const double after_relay = relay ? work(relay->after_f, relay->after_i, relay->after_w) : 0;
  Terms out{0, -kInf, -kInf};
  if (relay) out.relay_rest = work(relay->from_f, relay->from_i, relay->from_w) + beyond;
  for (const Line& line : rank.lines) {
    const int s = rank.stages[line.own_index];
    const StageRange& at = own[line.own_index];
    double start = sums_.forward.over(0, at.begin);
    if (line.gradient)
      start = all_forwards + sums_.input.over(at.end, n_) +
              (split_above_[s] ? 0.0 : sums_.weight.over(at.end, n_));
    const double from_line = work(line.f, line.i, line.w);
    out.bound = std::max(out.bound, start + from_line + (line.with_tail ? beyond : 0.0));
    if (relay && line.at <= relay->at)
      out.relay_end = std::max(out.relay_end, start + from_line - after_relay);
  }
  return out;
}

PairedStageBound::PairedStageBound(const schedule::Schedule& schedule, const Sums& sums)
    : own_(schedule, sums), n_(sums.compute.n), ranks_(schedule.num_ranks()) {
  const int p = schedule.num_ranks();
  const int64_t n = n_;
  table_.assign(static_cast<size_t>(p + 1) * (n + 1) * (n + 1), kInf);
  relay_.assign(table_.size(), kInf);
  choice_.assign(table_.size(), {-1, -1});
  auto index = [&](int r, int64_t a, int64_t b) {
    return (static_cast<size_t>(r) * (n + 1) + a) * (n + 1) + b;
  };
  // No rank inside the middle pair: nothing for a relay to reach.
  for (int64_t x = 0; x <= n; ++x) table_[index(p, x, x)] = 0, relay_[index(p, x, x)] = -kInf;
  StageRange mine[2];
  for (int r = p - 1; r >= 0; --r) {
    // The ranks r .. p-1 hold 2(p - r) stages of at least one unit each.
    const int64_t inner_stages = 2 * (p - r - 1);
    for (int64_t a = r; a <= n; ++a)
      for (int64_t b = a + 2 + inner_stages; b <= n - r; ++b) {
        double least = kInf, least_relay = kInf;
        for (int64_t a2 = a + 1; a2 + inner_stages < b; ++a2)
          for (int64_t b2 = a2 + inner_stages; b2 < b; ++b2) {
            const double rest = table_[index(r + 1, a2, b2)];
            if (rest == kInf) continue;
            const double inner_relay = relay_[index(r + 1, a2, b2)];
            const double entering = sums.input.over(b2, b) + inner_relay;
            if (rest >= least && entering >= least_relay) continue;
            mine[0] = {a, a2}, mine[1] = {b2, b};
            // Rank r's returning stage [b2, b) is right above the inner ranks' ones.
            const OwnStageBound::Terms t = own_.terms(r, mine, 1);
            const double value = std::max({rest, t.bound, t.relay_end + inner_relay});
            if (value < least) least = value, choice_[index(r, a, b)] = {a2, b2};
            least_relay = std::min(least_relay, std::max(t.relay_rest, entering));
          }
        table_[index(r, a, b)] = least, relay_[index(r, a, b)] = least_relay;
      }
  }
  prefix_.assign(static_cast<size_t>(p + 1) * (n + 1), kInf);
  for (int k = 0; k <= p; ++k)
    for (int64_t a = 0; a <= n; ++a) {
      double least = kInf;
      for (int64_t b = a; b <= n; ++b) least = std::min(least, table_[index(k, a, b)]);
      prefix_[static_cast<size_t>(k) * (n + 1) + a] = least;
    }
}

PairedStageBound::Placed PairedStageBound::place(int r, const Outer& outer, int64_t a, int64_t a2,
                                                 int64_t b2, int64_t b) const {
  const StageRange mine[2] = {{a, a2}, {b2, b}};
  const OwnStageBound::Terms t = own_.terms(r, mine, 1);
  Placed out;
  // Rank r as a relay's end, after the ranks placed; then as its start, with them, for the
  // ranks inside, whose returning stages the last micro-batch's gradient enters at b2.
  out.next.placed = std::max({outer.placed, t.bound, outer.arrival + t.relay_rest});
  out.next.arrival = std::max(outer.arrival + own_.sums().input.over(b2, b), t.relay_end);
  out.bound = out.next.placed;
  if (r + 1 < ranks_)
    out.bound =
        std::max({out.bound, inner(r + 1, a2, b2), out.next.arrival + relay(r + 1, a2, b2)});
  return out;
}

std::vector<StageRange> PairedStageBound::least_partition() const {
  const int p = ranks_;
  const int64_t n = n_;
  if (inner(0, 0, n) == kInf) return {};
  std::vector<StageRange> ranges(2 * p);
  int64_t a = 0, b = n;
  for (int r = 0; r < p; ++r) {
    const auto [a2, b2] = choice_[(static_cast<size_t>(r) * (n + 1) + a) * (n + 1) + b];
    ranges[r] = {a, a2}, ranges[2 * p - 1 - r] = {b2, b};
    a = a2, b = b2;
  }
  return ranges;
}

LoopedPairBound::LoopedPairBound(const schedule::Schedule& schedule, const Sums& sums)
    : own_(schedule, sums), n_(sums.compute.n), ranks_(schedule.num_ranks()) {}

void LoopedPairBound::prepare(double cap) {
  if (cap_ >= 0 && cap <= cap_) return;
  cap_ = cap;
  middle_.assign(n_ + 1, kInf);
  tables_.assign(n_ + 1, {});
  choices_.assign(n_ + 1, {});
  prefix_.assign(static_cast<size_t>(ranks_ + 1) * (n_ + 1), kInf);
  for (int64_t m = ranks_; m <= n_ - ranks_; ++m) {
    fill(m);
    prefix_[static_cast<size_t>(ranks_) * (n_ + 1) + m] = middle_[m];
    for (int k = 1; k < ranks_; ++k)
      for (int64_t e = k; e <= m - (ranks_ - k); ++e) {
        double& least = prefix_[static_cast<size_t>(k) * (n_ + 1) + e];
        for (int64_t b = m + k; b <= n_ - (ranks_ - k); ++b)
          least = std::min(least, inner(m, k, e, b));
      }
  }
}

void LoopedPairBound::fill(int64_t m) {
  const int p = ranks_;
  const int64_t n = n_;
  const size_t size = static_cast<size_t>(p) * (n + 1) * (n + 1);
  std::vector<double>& table = tables_[m];
  std::vector<std::pair<int32_t, int32_t>>& choice = choices_[m];
  table.assign(size, kInf);
  choice.assign(size, {-1, -1});
  auto index = [&](int r, int64_t a, int64_t b) {
    return (static_cast<size_t>(r) * (n + 1) + a) * (n + 1) + b;
  };
  StageRange mine[2];
  for (int r = p - 1; r >= 0; --r) {
    // c_r = a and c_{p+r} = b, each of the stages r .. p-1 and p+r .. 2p-1 at least a unit.
    const int64_t a_last = m - (p - r), b_last = n - (p - r);
    for (int64_t a = r; a <= a_last; ++a)
      for (int64_t b = m + r; b <= b_last; ++b) {
        if (r == 0 && (a != 0 || b != m)) continue;
        double least = cap_;
        if (r == p - 1) {
          mine[0] = {a, m}, mine[1] = {b, n};
          least = std::min(least, std::max(own_.busy(r, mine), own_.rank(r, mine)));
        } else {
          // The busy time grows with either cut: past the least, no later one helps.
          for (int64_t a2 = a + 1; a2 <= a_last + 1; ++a2) {
            mine[0] = {a, a2}, mine[1] = {b, b + 1};
            if (own_.busy(r, mine) >= least) break;
            for (int64_t b2 = b + 1; b2 <= b_last + 1; ++b2) {
              const double rest = table[index(r + 1, a2, b2)];
              if (rest >= least) continue;
              mine[1] = {b, b2};
              const double busy = own_.busy(r, mine);
              if (busy >= least) break;
              const double value = std::max({rest, busy, own_.rank(r, mine)});
              if (value < least)
                least = value,
                choice[index(r, a, b)] = {static_cast<int32_t>(a2), static_cast<int32_t>(b2)};
            }
          }
        }
        table[index(r, a, b)] = least;
      }
  }
  middle_[m] = table[index(0, 0, m)];
  // A middle cut whose bound reached the cap is never searched: its table goes.
  if (middle_[m] >= cap_)
    table.clear(), table.shrink_to_fit(), choice.clear(), choice.shrink_to_fit();
}

double LoopedPairBound::place(int64_t m, int r, double placed, int64_t a, int64_t a2, int64_t b,
                              int64_t b2, double* own) const {
  const StageRange mine[2] = {{a, a2}, {b, b2}};
  *own = std::max({placed, own_.busy(r, mine), own_.rank(r, mine)});
  return r + 1 < ranks_ ? std::max(*own, inner(m, r + 1, a2, b2)) : *own;
}

double LoopedPairBound::least() const {
  return middle_.empty() ? 0 : *std::min_element(middle_.begin(), middle_.end());
}

std::vector<StageRange> LoopedPairBound::least_partition() const {
  const int p = ranks_;
  const int64_t n = n_;
  if (middle_.empty()) return {};
  const int64_t m = std::min_element(middle_.begin(), middle_.end()) - middle_.begin();
  if (middle_[m] >= cap_) return {};
  std::vector<StageRange> ranges(2 * p);
  int64_t a = 0, b = m;
  for (int r = 0; r < p; ++r) {
    int64_t a2 = m, b2 = n;
    if (r < p - 1) {
      const auto [x, y] = choices_[m][(static_cast<size_t>(r) * (n + 1) + a) * (n + 1) + b];
      a2 = x, b2 = y;
    }
    ranges[r] = {a, a2}, ranges[p + r] = {b, b2};
    a = a2, b = b2;
  }
  return ranges;
}

}  // namespace conveyor::planning

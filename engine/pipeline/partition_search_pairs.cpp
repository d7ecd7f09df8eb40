// The search two stages a rank, a pair of stages at a time from the outside in.
#include <algorithm>
#include <vector>

#include "engine/pipeline/partition_searcher.h"

namespace conveyor::planning {

double PartitionSearcher::Impl::paired_path_bound(int r, int64_t a2, int64_t b2, CostPath** longest,
                                                  std::vector<std::pair<int64_t, double>>& outer) {
  if (paths.empty()) return 0;
  const int mine = partner(r);
  // The inner stages: one run of units in the V; two in the loop, [a2, m) and [b2, n).
  const int64_t low = a2 * (n + 1) + ((paired ? b2 : middle) - 1);
  const int64_t high = b2 * (n + 1) + (n - 1);
  if (outer.size() < paths.size()) outer.resize(paths.size(), {-1, 0.0});
  double most = 0;
  for (size_t k = 0; k < paths.size(); ++k) {
    CostPath& path = paths[k];
    if (outer[k].first != path.serial) {
      double placed = transfer * path.transfers;
      for (int s = 0; s < r; ++s) placed += path.f[s] * f[s] + path.i[s] * i[s] + path.w[s] * w[s];
      for (int s = paired ? mine + 1 : ranks; s < (paired ? stages : mine); ++s)
        placed += path.f[s] * f[s] + path.i[s] * i[s] + path.w[s] * w[s];
      outer[k] = {path.serial, placed};
    }
    double length = outer[k].second + path.f[r] * f[r] + path.i[r] * i[r] + path.w[r] * w[r] +
                    path.f[mine] * f[mine] + path.i[mine] * i[mine] + path.w[mine] * w[mine];
    // The stages [r+1, partner) of the V, or [r+1, p) of the loop, over the first run.
    const int first_end = paired ? mine : ranks;
    length += (path.below_f[first_end] - path.below_f[r + 1]) * least_f[low] +
              (path.below_i[first_end] - path.below_i[r + 1]) * least_i[low] +
              (path.below_w[first_end] - path.below_w[r + 1]) * least_w[low];
    if (!paired)
      length += (path.below_f[stages] - path.below_f[mine + 1]) * least_f[high] +
                (path.below_i[stages] - path.below_i[mine + 1]) * least_i[high] +
                (path.below_w[stages] - path.below_w[mine + 1]) * least_w[high];
    if (length > most) most = length, *longest = &path;
  }
  return most;
}

void PartitionSearcher::Impl::place_pairs(int r, const PairedStageBound::Outer& placed) {
  const int p = ranks, mine = partner(r);
  const int64_t a = r == 0 ? 0 : ranges[r - 1].end;
  const int64_t b =
      paired ? (r == 0 ? n : ranges[mine + 1].begin) : (r == 0 ? middle : ranges[mine - 1].end);
  std::vector<PairChoice> choices;
  std::vector<std::pair<int64_t, double>> outer;
  auto consider = [&](int64_t a2, int64_t b2) {
    // The ranks after r: their pair table.
    // (In the V, inner(p, a2, b2) is finite only where the middle stages meet, a2 = b2.)
    const double rest = paired       ? paired->inner(r + 1, a2, b2)
                        : r == p - 1 ? 0.0
                                     : looped->inner(middle, r + 1, a2, b2);
    if (rest == kInf) return;
    // Slower than the best found whatever rank r's own bound: dropped without it, as
    // drop() would, keeping nothing; most choices at the ranks placed first are.
    if (!out.ranges.empty() && std::max(placed.placed, rest) > out.step * (1 + kSlack)) return;
    PairChoice choice{0, {}, a2, b2};
    if (paired) {
      const PairedStageBound::Placed next = paired->place(r, placed, a, a2, b2, b);
      choice.bound = next.bound, choice.next = next.next;
    } else {
      choice.bound = looped->place(middle, r, placed.placed, a, a2, b, b2, &choice.next.placed);
    }
    if (choice.bound > limit()) {
      drop(choice.bound);  // keeps it for the lower bound when only the ceiling is past
      return;
    }
    choices.push_back(choice);
  };
  if (paired) {
    const int64_t inner_stages = 2 * (p - r - 1);
    for (int64_t a2 = a + 1; a2 + inner_stages < b; ++a2)
      for (int64_t b2 = a2 + inner_stages; b2 < b; ++b2) consider(a2, b2);
  } else if (r == p - 1) {
    consider(middle, n);
  } else {
    for (int64_t a2 = a + 1; a2 <= middle - (p - 1 - r); ++a2)
      for (int64_t b2 = b + 1; b2 <= n - (p - 1 - r); ++b2) consider(a2, b2);
  }
  std::sort(choices.begin(), choices.end(), [](const PairChoice& x, const PairChoice& y) {
    return x.bound != y.bound ? x.bound < y.bound : x.a2 != y.a2 ? x.a2 < y.a2 : x.b2 < y.b2;
  });
  for (const PairChoice& choice : choices) {
    known = 0;                      // no prefix to compare in a tie
    if (drop(choice.bound)) break;  // the rest are no lower
    ranges[r] = {a, choice.a2};
    ranges[mine] = paired ? StageRange{choice.b2, b} : StageRange{b, choice.b2};
    for (int s : {r, mine})
      f[s] = sums.forward.over(ranges[s]), i[s] = sums.input.over(ranges[s]),
      w[s] = sums.weight.over(ranges[s]);
    if (r == p - 1) {
      known = stages;
      finish();
      continue;
    }
    // The remembered critical paths, each later stage at the least F, I and W of a unit
    // it may hold: they see the bubbles of partitions like those simulated.
    CostPath* longest = nullptr;
    const double path = paired_path_bound(r, choice.a2, choice.b2, &longest, outer);
    if (path > choice.bound && drop(path)) {
      touch(longest);
      continue;
    }
    if (exhausted || visits_here >= visit_limit || !affords_run()) {
      exhausted = true;
      leave_open(choice.bound);
      continue;
    }
    ++visits_here, ++out.visits;
    place_pairs(r + 1, choice.next);
  }
  f[r] = i[r] = w[r] = f[mine] = i[mine] = w[mine] = 0;
}

void PartitionSearcher::Impl::place_middles() {
  prepare_looped();
  std::vector<std::pair<double, int64_t>> order;
  for (int64_t m = ranks; m <= n - ranks; ++m) {
    const double least = looped->middle(m);
    if (least > limit()) {
      drop(least);
      continue;
    }
    order.push_back({least, m});
  }
  std::sort(order.begin(), order.end());
  for (const auto& [least, m] : order) {
    known = 0;
    if (drop(least)) break;
    if (exhausted || visits_here >= visit_limit || !affords_run()) {
      exhausted = true;
      leave_open(least);
      continue;
    }
    ++visits_here, ++out.visits;
    middle = m;
    place_pairs(0, {});
  }
}

}  // namespace conveyor::planning

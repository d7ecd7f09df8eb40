#pragma once
// Sums of per-unit costs over unit ranges, and the cap test: what the partition search, its
// lower bounds and the planner share.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "engine/pipeline/partition.h"
#include "engine/pipeline/planner.h"

namespace conveyor::planning {

inline constexpr double kInf = std::numeric_limits<double>::infinity();
// Bounds are compared with step times with a billionth of slack: the simulator adds times in
// another order, and a bound a few ulps over a tie must not hide it.
inline constexpr double kSlack = 1e-9;

// Sums of one per-unit quantity over every range [b, e), each added up in unit order, so a
// stage's total is the same number however it is reached (no prefix differences).
struct Prefix {
  int64_t n = 0;
  std::vector<double> table;  // table[b * (n + 1) + e]
  Prefix(const std::vector<UnitCost>& units, double (*of)(const UnitCost&))
      : n(static_cast<int64_t>(units.size())), table((n + 1) * (n + 1), 0.0) {
    for (int64_t b = 0; b < n; ++b)
      for (int64_t e = b + 1; e <= n; ++e)
        table[b * (n + 1) + e] = table[b * (n + 1) + e - 1] + of(units[e - 1]);
  }
  double over(int64_t begin, int64_t end) const { return table[begin * (n + 1) + end]; }
  double over(const StageRange& r) const { return over(r.begin, r.end); }
};

// Bytes within a billionth of the cap fit: sums taken in another order may differ in the last
// bits, and that must not decide whether a partition runs.
inline bool fits(double bytes, double cap) { return cap <= 0 || bytes <= cap * (1 + 1e-9); }

struct Sums {
  Prefix compute, activation, state, forward, input, weight;
  std::vector<double> workspace;  // per unit
  explicit Sums(const std::vector<UnitCost>& units)
      : compute(units, [](const UnitCost& u) { return u.compute(); }),
        activation(units, [](const UnitCost& u) { return u.activation_bytes; }),
        state(units, [](const UnitCost& u) { return u.state_bytes; }),
        forward(units, [](const UnitCost& u) { return u.forward; }),
        input(units, [](const UnitCost& u) { return u.backward_input; }),
        weight(units, [](const UnitCost& u) { return u.backward_weight; }) {
    for (const auto& u : units) workspace.push_back(u.workspace_bytes);
  }
  // The largest workspace of units [begin, end): one unit runs at a time.
  double workspace_over(int64_t begin, int64_t end) const {
    return *std::max_element(workspace.begin() + begin, workspace.begin() + end);
  }
};

}  // namespace conveyor::planning

#pragma once
// The planner's search for the contiguous partition with the smallest simulated step time
// under a memory cap (branch and bound), and the helpers it shares with the planner: sums of
// unit costs over ranges and the cap test. The memory model stays the planner's; the search
// sees it through PartitionMemory.
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <vector>

#include "engine/pipeline/partition.h"
#include "engine/pipeline/planner.h"
#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"

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

// Bytes per rank of a partition, as the planner's memory model counts them.
class PartitionMemory {
 public:
  virtual ~PartitionMemory() = default;
  virtual std::vector<double> operator()(const std::vector<StageRange>& ranges) const = 0;
  // Stage s of units [b, e) on a rank that holds only it (placement.chunks == 1).
  virtual double stage(int s, int64_t b, int64_t e) const = 0;
  // A lower bound on rank r's bytes in every partition whose first `known` stages are those
  // of `ranges`.
  virtual double known_stages(int r, const std::vector<StageRange>& ranges, int known) const = 0;
};

// The largest per-rank compute of one micro-batch (F + I + W).
double bottleneck_of(const Sums& sums, const std::vector<StageRange>& ranges,
                     const schedule::Placement& placement);

// The simulator's costs of a partition: per stage, the sums over its units.
schedule::CostModel cost_model(const std::vector<UnitCost>& units,
                               const std::vector<StageRange>& ranges, double transfer);

// Min over contiguous partitions of max over stages of cost(stage, begin, end), where a cost of
// +inf marks a stage that is not allowed: O(S · U²) dynamic programming. Empty when every
// partition has an infinite stage.
std::vector<StageRange> min_max_partition(
    int64_t units, int stages, const std::function<double(int, int64_t, int64_t)>& cost);

// A lower bound on the simulated step time (`transfer` per transfer) of every partition of
// `timed` whose first stages are `prefix`: the schedule simulated with the prefix's costs and,
// for each later stage, the least F, I and W of a unit it must hold (relaxed_step); with
// `rank_work`, raised by the compute of the remaining units that the ranks holding later
// stages must run beyond those least units.
double relaxed_step_bound(const std::vector<UnitCost>& timed, const schedule::Schedule& schedule,
                          const std::vector<StageRange>& prefix, double transfer,
                          bool rank_work = true);

// A lower bound on the simulated step time from one rank's own stages alone: every action of
// a rank is of one of its stages, so where each of them begins and ends fixes, from the unit
// sums, when the rank's actions can start and what the gradient still has to cross after its
// last one. For each own stage, the first forward and the first gradient step (I, or B where
// the stage does not split) open a line: the action starts no earlier than the chain of its
// micro-batch before it (the forwards of every stage below; for a gradient step, every forward
// and the gradient steps of every stage above), then the rank runs the rest of its list one
// action at a time, and after its last gradient step that gradient still crosses the stages
// below (their I, and W too where none of them splits) while the rank runs what follows it.
// Transfers are left out: they only add time.
class OwnStageBound {
 public:
  OwnStageBound(const schedule::Schedule& schedule, const Sums& sums);
  // Rank r's bound when its stages (placement.stages_of(r), in that order) hold `own`.
  double rank(int r, const StageRange* own) const;

 private:
  struct Line {
    int own_index;   // the stage whose action opens it, as an index into stages_of(r)
    bool gradient;   // a gradient step (else a forward)
    bool with_tail;  // at or before the rank's last gradient step
    std::vector<double> f, i, w;  // per own stage: F, I and W costs from the action on
  };
  struct Rank {
    std::vector<int> stages;
    std::vector<Line> lines;
    std::vector<double> after_f, after_i, after_w;  // per own stage: after the last gradient
    int last_own = -1;  // own index of the last gradient step's stage (-1: none)
  };
  const Sums& sums_;
  int64_t n_;
  std::vector<Rank> ranks_;
  std::vector<bool> split_below_, split_above_;  // per stage: some stage below (above) splits
};

// For a V-shaped placement of two stages a rank (rank r holds stages r and 2p-1-r, nested):
// inner(r, a, b), the least over every cut of the units [a, b) into the stages r .. 2p-1-r of
// the largest OwnStageBound of the ranks r .. p-1, by dynamic programming from the middle
// pair outwards (the memory cap is left out, which only lowers it). inner(0, 0, n) bounds
// every partition's step time; with the ranks before r placed, inner(r, c_r, c_{2p-r}) bounds
// every completion.
class PairedStageBound {
 public:
  PairedStageBound(const schedule::Schedule& schedule, const Sums& sums);
  static bool applies(const schedule::Placement& placement) {
    return placement.layout == schedule::Layout::kVShape && placement.chunks == 2;
  }
  double inner(int r, int64_t a, int64_t b) const {
    return table_[(static_cast<size_t>(r) * (n_ + 1) + a) * (n_ + 1) + b];
  }
  // With the stages [0, k) placed and ending at unit a (k <= p): the least inner(k, a, b) over
  // every b, a bound on the ranks k .. p-1 whatever the later cuts.
  double after_prefix(int k, int64_t a) const {
    return prefix_[static_cast<size_t>(k) * (n_ + 1) + a];
  }
  const OwnStageBound& own() const { return own_; }
  // A partition that attains inner(0, 0, n): a good first incumbent, as the bound is close.
  std::vector<StageRange> least_partition() const;

 private:
  OwnStageBound own_;
  int64_t n_;
  int ranks_;
  std::vector<double> table_;              // [r][a][b]
  std::vector<double> prefix_;             // [k][a]: after_prefix
  std::vector<std::pair<int64_t, int64_t>> choice_;  // [r][a][b]: the inner cuts (a2, b2)
};

// For a looped placement of two stages a rank (rank r holds stages r and p+r): the least over
// every partition of the largest OwnStageBound, by dynamic programming over the pairs of cuts
// (c_r, c_{p+r}), which advance together, once for each middle cut c_p; the memory cap is left
// out, which only lowers it. A lower bound on every partition's step time.
double looped_pair_bound(const schedule::Schedule& schedule, const Sums& sums);
inline bool looped_pair_bound_applies(const schedule::Placement& placement) {
  return placement.layout == schedule::Layout::kLooped && placement.chunks == 2;
}

struct SearchBudget {
  int64_t simulations = 0;  // complete partitions simulated
  // Prefixes descended into; for zbv without a cap, the walks under ceilings below the best
  // found take up to a quarter as many again (PartitionSearcher::search).
  int64_t visits = 0;
  int64_t relaxed = 0;  // relaxed simulations of prefixes (relaxed_step)
  // Actions timed by all of them together (Replay::actions per run): what their time is.
  int64_t actions = std::numeric_limits<int64_t>::max();
};

struct Searched {
  std::vector<StageRange> ranges;  // the fastest partition simulated that fits; empty: none
  double step = kInf;              // its simulated step time
  // No partition that fits the cap is faster than this (kInf: none fits). Equal to `step`
  // when the search proved `ranges` the fastest; below it when the budget ran out first, or
  // when the search skipped partitions slower than its ceiling (then above the ceiling).
  double lower_bound = 0;
  // Every partition faster than `ranges` was ruled out (with `ranges` empty: none fits).
  bool proven = false;
  int64_t simulated = 0;  // partitions simulated, every call together
  int64_t relaxed = 0;    // relaxed simulations of prefixes
  int64_t visits = 0;     // prefixes descended into
  int64_t actions = 0;    // actions timed by the simulations of the last search, relaxed ones too
};

// Branch and bound over the contiguous partitions of `timed` (costs with recomputation
// added) for the smallest simulated step time within `cap`; see the definition. Keeps the
// fastest partition found across calls, so a search can be resumed with more budget or a
// higher ceiling. The references must outlive it.
class PartitionSearcher {
 public:
  PartitionSearcher(const Sums& sums, const std::vector<UnitCost>& timed,
                    const PartitionMemory& memory_of, const schedule::Schedule& schedule,
                    double cap, double transfer);
  ~PartitionSearcher();
  PartitionSearcher(const PartitionSearcher&) = delete;
  PartitionSearcher& operator=(const PartitionSearcher&) = delete;

  // A lower bound on the step time of every partition that fits: the root's bounds, or what
  // the searches so far proved when that is more.
  double root_bound();
  // Simulates `incumbent` when it fits, then moves one cut by one unit while that helps, at
  // most `max_simulations` simulations (counted as work, as the search's are); they count
  // against the next search's budget too.
  void start_from(const std::vector<StageRange>& incumbent, int64_t max_simulations);
  // Searches every partition, skipping those that cannot be faster than `ceiling` or than
  // the best found so far; `budget` counts this call's work (simulations and relaxed
  // simulations scaled as the search's budgets say). For zbv without a cap, first under
  // growing ceilings below both (iterative deepening on the bound), which finds a fast
  // partition early when the bound is close; a search resumed goes on from the last of them.
  Searched search(const SearchBudget& budget, double ceiling = kInf);
  // The best found so far, with the lower bound of the last search.
  const Searched& found() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// search() once from `incumbent`, which is first improved one cut at a time.
Searched search_partition(const Sums& sums, const std::vector<UnitCost>& timed,
                          const PartitionMemory& memory_of, const schedule::Schedule& schedule,
                          double cap, double transfer, const SearchBudget& budget,
                          const std::vector<StageRange>& incumbent);

// The partition whose largest rank memory is smallest. Empty when `max_visits` ran out first.
std::vector<StageRange> leanest_partition(const Sums& sums, const PartitionMemory& memory_of,
                                          const schedule::Schedule& schedule, int64_t max_visits);

}  // namespace conveyor::planning

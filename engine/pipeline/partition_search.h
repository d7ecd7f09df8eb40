#pragma once
// The planner's search for the contiguous partition with the smallest simulated step time
// under a memory cap (branch and bound), pruned by the bounds of stage_bounds.h and by
// relaxed simulations of prefixes. The memory model stays the planner's; the search sees it
// through PartitionMemory.
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "engine/pipeline/partition.h"
#include "engine/pipeline/partition_sums.h"
#include "engine/pipeline/planner.h"
#include "engine/pipeline/stage_bounds.h"
#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"

namespace conveyor::planning {

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
std::vector<StageRange> min_max_partition(int64_t units, int stages,
                                          const std::function<double(int, int64_t, int64_t)>& cost);

// A lower bound on the simulated step time (`transfer` per transfer) of every partition of
// `timed` whose first stages are `prefix`: the schedule simulated with the prefix's costs and,
// for each later stage, the least F, I and W of a unit it must hold (relaxed_step); with
// `rank_work`, raised by the compute of the remaining units that the ranks holding later
// stages must run beyond those least units.
double relaxed_step_bound(const std::vector<UnitCost>& timed, const schedule::Schedule& schedule,
                          const std::vector<StageRange>& prefix, double transfer,
                          bool rank_work = true);

struct SearchBudget {
  int64_t simulations = 0;  // complete partitions simulated
  // Prefixes descended into; where a search deepens on the bound (zbv without a cap, and
  // interleaved v=2 without one under a ceiling below the best found), the walks under
  // ceilings below the best found take up to a quarter as many again (PartitionSearcher::search).
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
  // simulations scaled as the search's budgets say). For zbv without a cap, and for
  // interleaved v=2 without one under a ceiling below the best found, first under growing
  // ceilings below both (iterative deepening on the bound), which finds a fast partition early
  // when the bound is close; a search resumed goes on from the last of them.
  Searched search(const SearchBudget& budget, double ceiling = kInf);
  // The best found so far, with the lower bound of the last search.
  const Searched& found() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The partition whose largest rank memory is smallest. Empty when `max_visits` ran out first.
std::vector<StageRange> leanest_partition(const Sums& sums, const PartitionMemory& memory_of,
                                          const schedule::Schedule& schedule, int64_t max_visits);

}  // namespace conveyor::planning
